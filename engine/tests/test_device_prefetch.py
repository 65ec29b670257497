"""The device decoders' training path off the loop's thread (the next batch prepared by a background thread, on a side
stream on CUDA), and their fallbacks, with a stub decoder standing in for a broken nvJPEG on the CPU.

    python -m pytest engine/tests/test_device_prefetch.py
"""

import logging
import signal
import threading

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from classifier_engine import ImageFolderDataModule
from classifier_engine.data.device_decode import CroppedBatch, DeviceDecoder, DevicePipeline, TrainCrop
from classifier_engine.data.device_prefetch import Prefetcher, PrefetchingLoader
from classifier_engine.data.image_folders import EncodedImages, collate_encoded
from classifier_engine.data.layout import folder_samples
from classifier_engine.data.transforms import eval_preset
from classifier_engine.errors import ConfigError
from conftest import callback, cli_main, project_in_process, run_project, tiny_args

CPU = torch.device("cpu")
LOGGER = "classifier_engine.data.device_decode"
NOT_INITIALIZED = RuntimeError("nvjpegCreateSimple failed: NVJPEG_STATUS_NOT_INITIALIZED")  # nvJPEG's, where it is not


class StubDecoder(DeviceDecoder):
    """nvJPEG's stand-in: fails every batched and single decode whose payload index is in `broken` (all: None), or
    raises `error`; counts its calls."""

    def __init__(self, error: Exception = NOT_INITIALIZED):
        super().__init__("nvjpeg")
        self.error, self.broken, self.calls = error, None, 0

    def _decode(self, payloads, device):
        self.calls += 1
        if self.broken is None or any(id(p) in self.broken for p in payloads):
            raise self.error
        return super()._decode(payloads, device)


def batches(root, count: int = 3, size: int = 4):
    images = EncodedImages(folder_samples(root / "train"), decoder="nvjpeg")
    return [collate_encoded([images[i] for i in range(start, start + size)])
            for start in range(0, count * size, size)]


def test_a_broken_device_decoder_warns_once_and_stops_on_its_second_whole_batch_in_a_row(tiny_root, caplog):
    decoder, (first, partial, second, third) = StubDecoder(), batches(tiny_root, 4)
    reference = DeviceDecoder("nvjpeg")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        images = decoder(first.payloads(), first.paths, CPU)  # every image on the CPU instead, and one line
        assert decoder.calls == 1 + 4 and decoder.cpu_fallbacks == 4
        assert all(torch.equal(a, b) for a, b in zip(images, reference(first.payloads(), first.paths, CPU)))
        payloads = partial.payloads()
        decoder.broken = {id(payloads[1])}  # one file the device cannot decode: the streak ends, nothing logged
        assert all(image is not None for image in decoder(payloads, partial.paths, CPU))
        decoder.broken = None
        decoder(second.payloads(), second.paths, CPU)  # a whole batch again, but not twice in a row
        with pytest.raises(ConfigError) as error:
            decoder(third.payloads(), third.paths, CPU)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("data.decoder=nvjpeg: 4 of 4 images of a batch did not decode on cpu (RuntimeError: "
                              "nvjpegCreateSimple failed") and first.paths[0] in warning
    assert decoder.cpu_fallbacks == 4 + 1 + 4 + 4
    message = str(error.value)
    assert "\n" not in message and message.startswith("data.decoder=nvjpeg decoded none of the images of two batches "
                                                      "in a row on cpu (RuntimeError: nvjpegCreateSimple failed")
    assert "use data.decoder=auto" in message


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("nvjpegDecodeBatched failed: CUDA error: out of memory")])
def test_an_out_of_memory_in_the_device_decode_propagates_and_never_falls_back(tiny_root, caplog, error):
    decoder, (batch,) = StubDecoder(error), batches(tiny_root, 1)
    pipeline = DevicePipeline(TrainCrop.for_options(crop_size=24), eval_preset(normalize=False))
    pipeline.decoder = decoder
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(type(error), match="out of memory"):
        pipeline(batch, CPU, training=False)
    assert decoder.calls == 1 and decoder.cpu_fallbacks == 0 and caplog.records == []


def test_the_prefetcher_prepares_the_next_batch_in_its_thread_while_the_current_one_is_used():
    prepared, second_ready = [], threading.Event()

    def prepare(item):
        prepared.append((item, threading.current_thread().name))
        if item == 1:
            second_ready.set()
        return item * 10

    batches = Prefetcher(iter(range(4)), prepare, CPU)
    assert next(batches) == 0
    assert second_ready.wait(timeout=30)  # prepared before it is asked for
    assert list(batches) == [10, 20, 30]
    assert prepared == [(item, "prefetch") for item in range(4)]


def test_the_prefetchers_error_is_raised_in_the_loop_and_an_early_stop_ends_its_thread():
    def prepare(item):
        if item == 2:
            raise ConfigError("data.decoder=nvjpeg decoded none ...")
        return item

    batches = Prefetcher(iter(range(5)), prepare, CPU)
    assert [next(batches), next(batches)] == [0, 1]
    with pytest.raises(ConfigError, match="decoded none"):
        next(batches)
    endless = Prefetcher(iter(range(10**9)), lambda item: item, CPU)
    assert next(endless) == 0
    endless.close()  # what the loader's generator does when the loop drops it mid-epoch
    assert not endless._thread.is_alive()


def test_the_loaders_position_counts_the_batches_handed_out_not_those_prepared_ahead(tiny_root):
    module = ImageFolderDataModule(str(tiny_root), decoder="nvjpeg", batch_size=8, num_workers=0, pin_memory=False,
                                   train_crop_size=24)
    module.setup("fit")
    loader = module.train_dataloader()
    assert isinstance(loader, PrefetchingLoader)
    crop, ahead = loader.prepare, threading.Event()

    def prepare(batch, device, epoch):
        result = crop(batch, device, epoch)
        if len(prepared) == 1:
            ahead.set()
        prepared.append(result)
        return result

    prepared, loader.prepare = [], prepare
    batches = iter(loader)
    batch = next(batches)
    assert ahead.wait(timeout=30) and len(prepared) >= 2  # the next batch is ready ...
    assert isinstance(batch, CroppedBatch) and batch.images.shape == (8, 3, 24, 24)
    assert loader.state_dict()["position"] == 8  # ... but a checkpoint now resumes after the first only
    assert len(list(batches)) == 4 and loader.state_dict()["position"] == 40


class BatchSides(L.Callback):
    def __init__(self):
        self.sides: dict[int, set[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sides.setdefault(trainer.current_epoch, set()).add(batch[0].shape[-1])


def test_a_fit_decodes_training_batches_in_the_prefetch_thread_with_the_recipes_augmentations(
        tiny_root, tmp_path, monkeypatch):
    threads = []
    real = DeviceDecoder._decode

    def recording(self, payloads, device):
        threads.append(threading.current_thread().name)
        return real(self, payloads, device)

    monkeypatch.setattr(DeviceDecoder, "_decode", recording)
    ramp = "{start_size: 32, end_size: 64, start_epoch: 0, end_epoch: 1}"
    args = tiny_args(tiny_root, tmp_path, "--data.decoder=nvjpeg", "--data.auto_augment=trivialaugment_wide",
                     "--data.random_erase_prob=0.25", f"--data.progressive_resizing={ramp}",
                     "--trainer.max_epochs=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
                     "--trainer.logger=false")
    cli = cli_main(args, run=False)
    sides = BatchSides()
    cli.trainer.callbacks.append(sides)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 4 and sides.sides == {0: {32}, 1: {64}}
    assert isinstance(cli.trainer.train_dataloader, PrefetchingLoader)
    # Training batches in the prefetch thread (2 steps an epoch, and what was prepared ahead), evaluation in the loop's
    assert threads.count("prefetch") >= 4 and threads.count("MainThread") >= 2 and len(set(threads)) == 2


def test_a_fit_whose_device_decoder_cannot_decode_stops_with_one_line(tiny_root, tmp_path, monkeypatch, capsys,
                                                                      caplog):
    def broken(self, payloads, device):
        raise RuntimeError("nvjpegCreateSimple failed: NVJPEG_STATUS_NOT_INITIALIZED")

    monkeypatch.setattr(DeviceDecoder, "_decode", broken)
    args = tiny_args(tiny_root, tmp_path, "--data.decoder=nvjpeg", "--trainer.logger=false")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        code, _, err = project_in_process(["fit", *args], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].endswith(
        "data.decoder=nvjpeg decoded none of the images of two batches in a row on cpu (RuntimeError: "
        "nvjpegCreateSimple failed: NVJPEG_STATUS_NOT_INITIALIZED), which the CPU decodes: use data.decoder=auto "
        "(decode in the workers), or a torchvision/torchcodec built with nvJPEG for this GPU")
    [warning] = [r.getMessage() for r in caplog.records]  # the first batch's fallback, one line
    assert warning.startswith("data.decoder=nvjpeg: 8 of 8 images of a batch did not decode on cpu")


@pytest.mark.slow  # a killed process and two in-process fits
def test_a_device_decoded_run_killed_mid_epoch_resumes_as_the_uninterrupted_run(tiny_root, tmp_path):
    # The prefetch thread prepares batches ahead of the loop: the checkpoint must still resume after the last batch
    # trained, with each sample's crop, flip, TrivialAugment and erasing drawn again as before (test_resume.py's run).
    from test_resume import EPOCHS, EVERY_STEP, LAST, WORKERS, assert_same_training, final_state

    device = [*EPOCHS, *WORKERS, "--data.decoder=nvjpeg"]
    cli_main(["fit", *tiny_args(tiny_root, tmp_path / "reference", *device)])
    args = tiny_args(tiny_root, tmp_path / "run", *device)
    killed = run_project(["fit", *args, *EVERY_STEP, callback("stop_callbacks.SignalAtStep", step=7)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    stopped = torch.load(tmp_path / "run" / LAST, map_location="cpu", weights_only=True)
    assert (stopped["global_step"], stopped["epoch"]) == (7, 1)
    cli_main(["fit", *args, "--ckpt_path=last"])
    assert_same_training(final_state(tmp_path / "run"), final_state(tmp_path / "reference"))


@pytest.mark.gpu
def test_gpu_prefetched_batches_equal_the_loop_threads_and_wait_for_the_side_stream(tiny_root):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    module = ImageFolderDataModule(str(tiny_root), decoder="nvjpeg", batch_size=8, num_workers=0, pin_memory=True,
                                   train_crop_size=24)
    module.setup("fit")
    loader = module.train_dataloader()
    loader.device = device
    prefetched = []
    for batch in loader:
        torch.cuda._sleep(50_000_000)  # the training stream busy while the next batch is decoded on the side stream
        prefetched.append(batch)
        assert batch.images.is_cuda and batch.images.float().sum().item() > 0  # read after the side stream's writes
    # The same epoch's encoded batches without the prefetcher (a new loader: the sampler's order for epoch 0)
    direct = [module.device_pipeline.crop(b, device) for b in DataLoader.__iter__(module.train_dataloader())]
    assert len(direct) == len(prefetched) == 5
    for a, b in zip(prefetched, direct):
        assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)


@pytest.mark.gpu
def test_gpu_training_batches_of_a_cpu_decoder_are_copied_by_the_prefetch_thread(tiny_root):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    module = ImageFolderDataModule(str(tiny_root), decoder="torchvision", batch_size=8, num_workers=1, pin_memory=True,
                                   train_crop_size=24)
    module.trainer = L.Trainer(accelerator="gpu", devices=1, logger=False)
    module.setup("fit")
    loader = module.train_dataloader()
    assert isinstance(loader, PrefetchingLoader) and loader.prepare is not None
    on_gpu = list(loader)
    on_cpu = list(DataLoader.__iter__(module.train_dataloader()))  # the same epoch, as the workers made it
    assert len(on_gpu) == len(on_cpu) == 5
    for (images, targets), (cpu_images, cpu_targets) in zip(on_gpu, on_cpu):
        assert images.is_cuda and images.dtype == torch.uint8 and torch.equal(images.cpu(), cpu_images)
        assert torch.equal(targets.cpu(), cpu_targets)
