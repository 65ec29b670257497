"""Device decoders (nvjpeg, torchcodec-cuda), run here on the CPU with the same calls (decode_jpeg(device="cpu")):
eval batches equal the worker path's exactly, train crops are the worker path's draws per sample key, applied
batch-wise in a number of ops that does not grow with the batch and without reading a tensor back to the host.

    python -m pytest tests/test_device_decode.py
"""

import importlib.util
import io
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision import tv_tensors

from classifier_engine import ImageFolderDataModule
from classifier_engine.data.decoders import DEVICE_DECODERS as DEVICE_DECODER_NAMES
from classifier_engine.data.decoders import decode_torchvision
from classifier_engine.data.device_decode import (
    Crop,
    DeviceDecoder,
    DevicePipeline,
    TrainCrop,
    eval_batch,
    load_for_device,
    resized_crops,
)
from classifier_engine.data.image_folders import DecodedImages, EncodedBatch, EncodedImages, collate_encoded
from classifier_engine.data.layout import folder_samples
from classifier_engine.data.partial_decode import encoded_jpeg, jpeg_header
from classifier_engine.data.transforms import eval_preset, train_preset
from classifier_engine.seeds import SeededSamples
from test_decode import two_colour

NEEDS_TORCHCODEC = pytest.mark.skipif(importlib.util.find_spec("torchcodec") is None,
                                      reason='torchcodec is not installed: pip install -e "./engine[torchcodec]"')
DEVICE_DECODERS = ["nvjpeg", pytest.param("torchcodec-cuda", marks=NEEDS_TORCHCODEC)]
SIZES = [(60, 80), (80, 60), (48, 48), (75, 100)]  # (height, width): several per batch, as in ImageNet


def smooth(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth colour field: resize filters agree on it within a level or two, distinct crops clearly differ."""
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = np.random.default_rng(seed).uniform(0, 6, 3)
    pixels = [127 + 100 * np.sin(3 * x + 2 * y + p) for p in phase]
    return np.clip(np.stack(pixels, -1), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def mixed_root(tmp_path_factory):
    """2 classes, 12 train / 8 val JPEGs of four sizes, one of them progressive."""
    root = tmp_path_factory.mktemp("mixed")
    for split, count in (("train", 12), ("val", 8)):
        for i in range(count):
            height, width = SIZES[i % len(SIZES)]
            folder = root / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(smooth(height, width, i)).save(folder / f"{i:02d}.JPEG", quality=95, progressive=i == 5)
    return root


EVAL_PRESET = eval_preset(resize_size=28, crop_size=24, normalize=False)


def train_set(root, decoder: str, run_seed: int = 7):
    """The training set as the data module builds it, keyed by (index, epoch, repeat), and its device crop (or None)."""
    if decoder in DEVICE_DECODER_NAMES:
        crop = TrainCrop.for_options(crop_size=24)
        folder = EncodedImages(folder_samples(root / "train"), crop=crop, decoder=decoder)
    else:
        crop, transform = None, train_preset(crop_size=24, normalize=False)
        folder = DecodedImages(folder_samples(root / "train"), transform=transform, decoder=decoder)
    return SeededSamples(folder, run_seed), crop


def device_train_batch(root, decoder: str, keys) -> torch.Tensor:
    dataset, crop = train_set(root, decoder)
    batch = collate_encoded([dataset[key] for key in keys])
    images, _ = DevicePipeline(crop, EVAL_PRESET, decoder=decoder)(batch, torch.device("cpu"), training=True)
    return images


def test_jpeg_frame_header_routes_files_nvjpeg_cannot_decode_to_the_workers(tmp_path):
    source = Image.fromarray(two_colour())
    source.save(tmp_path / "plain.JPEG", quality=90)
    source.save(tmp_path / "progressive.JPEG", quality=90, progressive=True)
    source.convert("L").save(tmp_path / "gray.JPEG", quality=90)
    source.convert("CMYK").save(tmp_path / "cmyk.JPEG", quality=90)
    source.save(tmp_path / "png_named.JPEG", format="PNG")
    # A 12-bit frame (extended sequential, SOF1), which nvJPEG does not decode: the header of an 8-bit one, relabelled.
    plain = (tmp_path / "plain.JPEG").read_bytes()
    frame = plain.index(b"\xff\xc0")
    twelve = plain[:frame] + b"\xff\xc1" + plain[frame + 2 : frame + 4] + b"\x0c" + plain[frame + 5 :]
    frames = {path.stem: jpeg_header(path.read_bytes()) for path in tmp_path.iterdir()}
    assert frames == {"plain": (0xC0, 8, 3, 48, 64, 1), "progressive": (0xC2, 8, 3, 48, 64, 1),
                      "gray": (0xC0, 8, 1, 48, 64, 1), "cmyk": (0xC0, 8, 4, 48, 64, 1), "png_named": None}
    assert jpeg_header(twelve) == (0xC1, 12, 3, 48, 64, 1)
    assert encoded_jpeg(plain, whole=lambda: None) is not None and encoded_jpeg(twelve, whole=lambda: None) is None
    loaded = {path.stem: load_for_device(str(path), decode_torchvision) for path in tmp_path.iterdir()}
    assert {name: (p.dim(), size) for name, (p, size) in loaded.items()} == {
        "plain": (1, (48, 64)), "progressive": (1, (48, 64)), "gray": (1, (48, 64)),  # bytes for the device
        "cmyk": (3, (48, 64)), "png_named": (3, (48, 64))}  # pixels decoded in the worker
    (tmp_path / "twelve.JPEG").write_bytes(twelve)
    assert load_for_device(str(tmp_path / "twelve.JPEG"), lambda path: torch.zeros(3, 48, 64))[0].dim() == 3


@pytest.mark.parametrize("decoder", DEVICE_DECODERS)
@pytest.mark.parametrize("root_name", ["tiny_root", "mixed_root"])
def test_device_decode_gives_the_worker_path_eval_batch_exactly(request, root_name, decoder):
    root = request.getfixturevalue(root_name)
    options = dict(batch_size=64, num_workers=0, pin_memory=False, eval_resize_size=28, eval_crop_size=24)
    reference = ImageFolderDataModule(str(root), decoder="torchvision", **options)
    reference.setup("validate")
    images, targets = next(iter(reference.val_dataloader()))
    module = ImageFolderDataModule(str(root), decoder=decoder, **options)
    module.setup("validate")
    encoded = next(iter(module.val_dataloader()))
    assert isinstance(encoded, EncodedBatch) and all(p.dim() == 1 for p in encoded.payloads())
    decoded, decoded_targets = module.device_pipeline(encoded, torch.device("cpu"), training=False)
    assert torch.equal(decoded, images) and torch.equal(decoded_targets, targets)


def tensors_in(batch) -> list[torch.Tensor]:
    """Every tensor a batch holds: each crosses from a worker as its own shared-memory block (an fd and a handshake)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [tensor for item in batch for tensor in tensors_in(item)]
    return []


def test_a_device_batch_crosses_from_the_workers_as_one_block_and_decodes_as_before(mixed_root, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(mixed_root, root)
    odd = Image.fromarray(smooth(40, 56, 99))
    odd.convert("CMYK").save(root / "val" / "c0" / "cmyk.JPEG", quality=90)  # decoded in the worker (3-D payloads)
    odd.save(root / "val" / "c1" / "png_named.JPEG", format="PNG")
    module = ImageFolderDataModule(str(root), decoder="nvjpeg", batch_size=64, num_workers=1, pin_memory=False,
                                eval_resize_size=28, eval_crop_size=24)
    module.setup("validate")
    batch = next(iter(module.val_dataloader()))  # through a worker process, as in training
    assert len(tensors_in(batch)) == 2, [tuple(t.shape) for t in tensors_in(batch)]  # the payloads, the targets
    samples = [module.datasets["val"][i] for i in range(len(module.datasets["val"]))]
    unpacked = [payload for payload, *_ in samples]
    payloads = batch.payloads()
    assert [p.shape for p in payloads] == [p.shape for p in unpacked] and sum(p.dim() == 3 for p in payloads) == 2
    assert all(torch.equal(a, b) for a, b in zip(payloads, unpacked))
    decoder = module.device_pipeline.decoder
    cpu = torch.device("cpu")
    assert all(torch.equal(a, b) for a, b in zip(decoder(payloads, batch.paths, cpu), decoder(unpacked, batch.paths,
                                                                                                 cpu)))
    images, targets = module.device_pipeline(batch, cpu, training=False)
    assert images.shape == (10, 3, 24, 24) and torch.equal(targets, torch.tensor([t for _, t, *_ in samples]))


def test_worker_draws_the_box_and_flip_the_cpu_preset_draws():
    # Both built from the same data options, never one read out of the other.
    options = dict(crop_size=24, scale=(0.25, 0.9), hflip_prob=0.3)
    preset = train_preset(**options, normalize=False)
    crop_step, flip_step = preset.transforms[1], preset.transforms[2]
    spec = TrainCrop.for_options(**options)
    assert (spec.size, spec.scale, spec.ratio, spec.hflip_prob) == (
        tuple(crop_step.size), tuple(crop_step.scale), tuple(crop_step.ratio), flip_step.p)
    assert str(getattr(crop_step.interpolation, "value", crop_step.interpolation)).lower() == "bilinear"  # as roi_align
    image = tv_tensors.Image(torch.zeros(3, 75, 100, dtype=torch.uint8))
    make_params = getattr(crop_step, "make_params", None) or crop_step._get_params  # renamed in torchvision 0.21
    for seed in range(20):
        torch.manual_seed(seed)
        box = make_params([image])
        flip = bool(torch.rand(1) < flip_step.p)  # RandomHorizontalFlip's draw, right after the crop's
        torch.manual_seed(seed)
        # ... and the seed they came from, which the rest of the preset draws from after them (on the device)
        assert spec.draw(75, 100) == Crop(box["top"], box["left"], box["height"], box["width"], flip, 75, 100, seed)


@pytest.mark.parametrize("decoder", DEVICE_DECODERS)
def test_train_crops_follow_the_sample_key(mixed_root, decoder):
    keys = [(index, 0, 0) for index in range(12)]
    dataset, _ = train_set(mixed_root, decoder)
    boxes = {key: dataset[key][3] for key in [*keys, (0, 1, 0), (0, 0, 1), (1, 1, 0)]}
    assert len(set(boxes.values())) == len(boxes) and boxes[(0, 0, 0)] == dataset[(0, 0, 0)][3]
    first = device_train_batch(mixed_root, decoder, keys)
    again = device_train_batch(mixed_root, decoder, keys)
    other_epoch = device_train_batch(mixed_root, decoder, [(index, 1, 0) for index in range(12)])
    other_repeat = device_train_batch(mixed_root, decoder, [(index, 0, 1) for index in range(12)])
    assert first.shape == (12, 3, 24, 24) and first.dtype == torch.uint8
    assert torch.equal(first, again)
    for other in (other_epoch, other_repeat):  # another key, another crop
        assert (first.float() - other.float()).abs().mean() > 10
    # The worker path with the same keys crops the same boxes; only the resize filter differs.
    cpu_dataset, _ = train_set(mixed_root, "torchvision")
    cpu = torch.stack([cpu_dataset[key][0] for key in keys])
    assert (first.float() - cpu.float()).abs().mean(dim=(1, 2, 3)).max() < 2.5


def test_flip_is_applied_per_image_in_one_batch():
    crops = [Crop(5, 3, 40, 50, flip=i % 3 == 0, image_height=60, image_width=80) for i in range(4)]
    images = [torch.from_numpy(smooth(60, 80, i)).permute(2, 0, 1).contiguous() for i in range(4)]
    flipped = resized_crops(images, crops, (24, 24))
    plain = resized_crops(images, [c._replace(flip=False) for c in crops], (24, 24))
    for i, crop in enumerate(crops):
        assert torch.equal(flipped[i], plain[i].flip(-1) if crop.flip else plain[i])


def test_batched_resize_is_bilinear_with_area_averaging_and_ignores_the_padding():
    images = [torch.from_numpy(smooth(h, w, i)).permute(2, 0, 1).contiguous() for i, (h, w) in enumerate(SIZES)]
    whole = [Crop(0, 0, h, w, False, h, w) for h, w in SIZES]
    # A crop of the whole image at its own size is the image (samples fall on pixel centres).
    for image, crop in zip(images, whole):
        assert torch.equal(resized_crops([image, images[3]], [crop, whole[3]], (crop.height, crop.width))[0], image)
    # Enlarging: torch's bilinear interpolation (align_corners=False), up to rounding.
    box = Crop(10, 20, 12, 16, False, 60, 80)
    expected = F.interpolate(images[0][None, :, 10:22, 20:36].float(), size=(24, 32), mode="bilinear").round()
    assert (resized_crops([images[0]], [box], (24, 32)).float() - expected).abs().max() <= 1
    # Halving: the mean of each 2x2 block (an area filter).
    half = F.avg_pool2d(images[2][None].float(), 2).round()
    assert (resized_crops([images[2]], [whole[2]], (24, 24)).float() - half).abs().max() <= 1
    # One padded bucket for all or one bucket per image: the same pixels, so the padding is never read.
    crops = [Crop(2, 3, h - 10, w - 20, i % 2 == 0, h, w) for i, (h, w) in enumerate(SIZES)]
    assert torch.equal(resized_crops(images, crops, (24, 24)), resized_crops(images, crops, (24, 24), budget=1))


class CountOps(TorchDispatchMode):
    """Counts the ATen ops that compute something (views left out): on a GPU, about one kernel launch each."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def count_ops(function, *args) -> int:
    with CountOps() as counter:
        function(*args)
    return counter.count


@pytest.mark.parametrize("split", ["train", "eval"])
def test_batch_wise_augmentation_does_not_launch_more_ops_for_more_images(split):
    def batch(n):
        images = [torch.from_numpy(smooth(*SIZES[i % 2], i)).permute(2, 0, 1).contiguous() for i in range(n)]
        crops = [Crop(i % 5, i % 7, 40, 44, i % 2 == 0, *SIZES[i % 2]) for i in range(n)]
        return images, crops

    transform = EVAL_PRESET
    small, large = batch(8), batch(64)
    if split == "train":
        ops = [count_ops(resized_crops, images, crops, (24, 24)) for images, crops in (small, large)]
    else:
        ops = [count_ops(eval_batch, images, transform) for images, _ in (small, large)]
    assert ops[0] == ops[1] and ops[1] < 40, ops  # 8 or 64 images: one bucket (train), two sizes (eval)


@pytest.mark.parametrize("decoder", DEVICE_DECODERS)
@pytest.mark.parametrize("training", [True, False])
def test_device_decoder_reads_no_tensor_back_to_the_host(mixed_root, monkeypatch, decoder, training):
    dataset, crop = train_set(mixed_root, decoder)
    samples = [dataset[(i, 0, 0)] for i in range(12)] if training else [
        EncodedImages(folder_samples(mixed_root / "val"), decoder=decoder)[i] for i in range(8)]
    batch = collate_encoded(samples)
    pipeline = DevicePipeline(crop, EVAL_PRESET, decoder=decoder)
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: reads.append(_n) or _o(self, *a, **k))
    images, _ = pipeline(batch, torch.device("cpu"), training=training)
    monkeypatch.undo()
    assert reads == [] and images.shape[1:] == (3, 24, 24)


@pytest.mark.parametrize("policy", ["trivialaugment_wide", "randaugment", "autoaugment"])
def test_auto_augment_and_random_erasing_on_the_device_draw_what_the_worker_path_draws_per_sample(mixed_root, policy):
    options = dict(crop_size=24, auto_augment=policy, random_erase_prob=0.5)
    module = ImageFolderDataModule(str(mixed_root), decoder="nvjpeg", batch_size=12, num_workers=0, pin_memory=False,
                                   train_crop_size=24, auto_augment=policy, random_erase_prob=0.5)
    module.setup("fit")
    dataset, pipeline = module.datasets["train"], module.device_pipeline

    def device_batch(keys):
        return pipeline(collate_encoded([dataset[key] for key in keys]), torch.device("cpu"), training=True)[0]

    keys = [(index, 0, 0) for index in range(12)]
    first, again, other = device_batch(keys), device_batch(keys), device_batch([(i, 1, 0) for i in range(12)])
    assert first.shape == (12, 3, 24, 24) and first.dtype == torch.uint8 and torch.equal(first, again)
    cpu = SeededSamples(DecodedImages(folder_samples(mixed_root / "train"), decoder="torchvision",
                                      transform=train_preset(**options, normalize=False)), run_seed=0)
    on_cpu = torch.stack([cpu[key][0] for key in keys])
    # The same ops and magnitudes per sample key; only the crop's resize filter differs (a threshold op such as
    # posterize or solarize can turn that into a larger difference for an image now and then: the median).
    assert (first.float() - on_cpu.float()).abs().mean(dim=(1, 2, 3)).median() < 2.5
    assert (first.float() - other.float()).abs().mean(dim=(1, 2, 3)).median() > 20  # another key, other draws


@pytest.mark.parametrize("decoder", DEVICE_DECODERS)
def test_fit_with_device_decode_skips_a_broken_jpeg(tiny_root, tmp_path, caplog, decoder):
    import shutil

    from conftest import cli_main, tiny_args

    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    victim = sorted((root / "train" / "dog").iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:300])
    args = tiny_args(root, tmp_path / "run", f"--data.decoder={decoder}", "--data.on_corrupt=skip",
                     "--trainer.limit_val_batches=1", "--trainer.logger=false")
    with caplog.at_level(logging.WARNING, logger="classifier_engine.data.device_decode"):
        cli = cli_main(["fit", *args])
    assert cli.trainer.state.finished and cli.trainer.global_step == 5  # 40 images - 1 skipped, batches of 8
    fallback, skipped = [r.getMessage() for r in caplog.records if str(victim) in r.getMessage()]
    assert fallback.startswith(f"data.decoder={decoder}: 1 of 8 images of a batch did not decode on cpu")
    assert skipped.startswith(f"skipped unreadable {victim}") and skipped.endswith("[device decode]")


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", DEVICE_DECODERS)
def test_gpu_decode_matches_the_cpu_batches_within_idct_differences(mixed_root, decoder):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dataset, crop = train_set(mixed_root, decoder)
    batch = collate_encoded([dataset[(i, 0, 0)] for i in range(12)])
    pipeline = DevicePipeline(crop, EVAL_PRESET, decoder=decoder)
    on_gpu, targets = pipeline(batch, torch.device("cuda"), training=True)
    on_cpu, _ = pipeline(batch, torch.device("cpu"), training=True)
    assert on_gpu.is_cuda and on_gpu.dtype == torch.uint8 and on_gpu.shape == on_cpu.shape and targets.is_cuda
    # nvJPEG's IDCT and the CUDA kernels round differently from libjpeg-turbo and the CPU ones: small differences.
    assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean() < 2.0
    val = collate_encoded([EncodedImages(folder_samples(mixed_root / "val"), decoder=decoder)[i] for i in range(8)])
    gpu_eval, _ = pipeline(val, torch.device("cuda"), training=False)
    cpu_eval, _ = pipeline(val, torch.device("cpu"), training=False)
    assert (gpu_eval.cpu().float() - cpu_eval.float()).abs().mean() < 2.0


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", DEVICE_DECODERS)
def test_gpu_decode_never_writes_into_memory_the_training_stream_still_reads(decoder):
    # pytorch/vision#9606's reproduction, through the decode the pipeline calls: tensors freed while the kernels that
    # read them are still queued (a training step's temporaries, the host a step ahead) must keep their values.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device, side = torch.device("cuda"), 256
    payloads = []
    for i in range(8):
        buffer = io.BytesIO()
        Image.fromarray(smooth(side, side, i)).save(buffer, format="JPEG", quality=90)
        payloads.append(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
    decode = DeviceDecoder(decoder)
    on_cpu = [image.float() for image in decode.decode_jpegs(payloads, torch.device("cpu"))]
    numel = 3 * side * side // 4  # float32 tensors of one decoded image's bytes: their blocks fit the outputs
    wrong = []
    for iteration in range(20):
        victims = [torch.full((numel,), float(i + 1), device=device) for i in range(len(payloads))]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the reductions below wait behind it
        sums = [victim.sum() for victim in victims]
        del victims  # freed, their reductions still queued
        images = decode.decode_jpegs(payloads, device)
        torch.cuda.synchronize()
        wrong += [(iteration, i, total.item()) for i, total in enumerate(sums) if total.item() != (i + 1) * numel]
        # nvJPEG's IDCT rounds differently from libjpeg-turbo's: small differences, never another image
        assert max((image.cpu().float() - reference).abs().mean().item()
                   for image, reference in zip(images, on_cpu)) < 2.0
    assert wrong == [], f"{len(wrong)} sums overwritten by the decode, e.g. {wrong[:3]}"


@pytest.mark.gpu
def test_gpu_auto_augment_and_random_erasing_match_the_same_draws_on_the_cpu(mixed_root):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    module = ImageFolderDataModule(str(mixed_root), decoder="nvjpeg", batch_size=12, num_workers=0, pin_memory=False,
                                   train_crop_size=24, auto_augment="trivialaugment_wide", random_erase_prob=0.5)
    module.setup("fit")
    batch = collate_encoded([module.datasets["train"][(index, 0, 0)] for index in range(12)])
    on_gpu, _ = module.device_pipeline(batch, torch.device("cuda"), training=True)
    on_cpu, _ = module.device_pipeline(batch, torch.device("cpu"), training=True)
    assert on_gpu.is_cuda and on_gpu.shape == on_cpu.shape == (12, 3, 24, 24)
    # nvJPEG's IDCT and the CUDA kernels round differently: small differences, the same ops and boxes per image
    assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean(dim=(1, 2, 3)).median() < 2.5
