"""Progressive resizing: FFCV's size schedule, and a real DataLoader switching size with the epoch in the sample keys.

    python -m pytest tests/test_progressive_resizing.py -q
"""

import io

import pytest
import torch
from torch.utils.data import DataLoader

from classifier_engine.data.image_folders import DecodedImages
from classifier_engine.data.layout import folder_samples
from classifier_engine.data.training_samples import ProgressiveResizing, TrainPresetPerEpoch
from classifier_engine.seeds import SeededSamples

# FFCV's ResNet-50 88-epoch config (rn50_configs/rn50_88_epochs.yaml): 160 px, ramp from epoch 65 to 76, then 192.
FFCV_88 = ProgressiveResizing(start_size=160, end_size=192, start_epoch=65, end_epoch=76)


def test_schedule_holds_before_the_ramp_rounds_to_multiples_inside_it_and_holds_after():
    assert [FFCV_88.size_at(e) for e in (0, 30, 64, 65)] == [160] * 4
    # interp 160 -> 192 over 11 epochs, nearest multiple of 32: the switch is where the interpolation passes 176
    assert [FFCV_88.size_at(e) for e in range(66, 76)] == [160] * 5 + [192] * 5
    assert [FFCV_88.size_at(e) for e in (76, 87, 500)] == [192] * 3
    wide = ProgressiveResizing(start_size=128, end_size=256, start_epoch=10, end_epoch=20, multiple=32)
    assert [wide.size_at(e) for e in range(10, 21)] == [128, 128, 160, 160, 192, 192, 192, 224, 224, 256, 256]


def test_size_is_a_pure_function_of_the_epoch_so_a_resume_in_the_ramp_continues_at_the_right_size():
    uninterrupted = [FFCV_88.size_at(e) for e in range(88)]
    # A resumed run rebuilds the schedule from its config and asks only for the epochs it still trains.
    resumed = ProgressiveResizing(**{f: getattr(FFCV_88, f) for f in FFCV_88.__dataclass_fields__})
    assert [resumed.size_at(e) for e in range(70, 88)] == uninterrupted[70:]
    per_epoch = TrainPresetPerEpoch(resumed, normalize=False, scale=(0.5, 1.0))
    image = torch.randint(0, 256, (3, 300, 260), dtype=torch.uint8)
    assert [per_epoch(e)(image).shape[-1] for e in (70, 71, 80)] == [uninterrupted[e] for e in (70, 71, 80)]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(start_size=150, end_size=192, start_epoch=1, end_epoch=2), "start_size=150 is not a positive multiple"),
        (dict(start_size=160, end_size=0, start_epoch=1, end_epoch=2), "end_size=0 is not a positive multiple"),
        (dict(start_size=160, end_size=192, start_epoch=5, end_epoch=2), "expected 0 <= start_epoch <= end_epoch"),
        (dict(start_size=160, end_size=192, start_epoch=0, end_epoch=2, multiple=0), "multiple must be >= 1"),
    ],
)
def test_invalid_schedules_fail_with_one_line_naming_the_flag(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ProgressiveResizing(**fields)
    assert str(error.value).startswith("--data.progressive_resizing: ") and "\n" not in str(error.value)


def test_schedule_is_a_typed_init_argument_of_the_cli_and_loads_from_a_weights_only_checkpoint():
    from jsonargparse import ArgumentParser

    def data_module(progressive_resizing: ProgressiveResizing | None = None):
        """
        Args:
            progressive_resizing: the train crop size schedule.
        """

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(data_module, "data")
    config = parser.parse_args(["--data.progressive_resizing",
                                "{start_size: 160, end_size: 192, start_epoch: 65, end_epoch: 76}"])
    schedule = parser.instantiate_classes(config).data.progressive_resizing
    assert schedule == FFCV_88
    buffer = io.BytesIO()
    torch.save({"datamodule_hyper_parameters": {"progressive_resizing": schedule}}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["datamodule_hyper_parameters"]["progressive_resizing"] == FFCV_88


class EpochKeys:
    """The keys ResumableSampler yields, for one epoch at a time: (index, epoch, repeat)."""

    def __init__(self, count: int):
        self.count, self.epoch = count, 0

    def __iter__(self):
        return iter([(index, self.epoch, 0) for index in range(self.count)])

    def __len__(self) -> int:
        return self.count


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_batches_take_the_size_of_the_epoch_in_their_keys(tiny_root, workers):
    schedule = ProgressiveResizing(start_size=16, end_size=32, start_epoch=1, end_epoch=3, multiple=8)
    folder = DecodedImages(folder_samples(tiny_root / "train"))  # no transform of its own: uint8 images of 32 px
    samples = SeededSamples(folder, run_seed=0, transform_for_epoch=TrainPresetPerEpoch(schedule, normalize=False))
    keys = EpochKeys(len(samples))
    loader = DataLoader(samples, batch_size=8, sampler=keys, num_workers=workers, persistent_workers=workers > 0,
                        multiprocessing_context="fork" if workers else None)
    iterators = []
    for epoch, size in [(0, 16), (2, 24), (3, 32)]:
        keys.epoch = epoch
        iterator = iter(loader)
        iterators.append(iterator)
        batches = [images for images, _ in iterator]
        assert {tuple(images.shape[1:]) for images in batches} == {(3, size, size)}, f"epoch {epoch}"
        assert {images.dtype for images in batches} == {torch.uint8}  # built uint8: the device normalizes
    if workers:  # the same worker processes served every epoch: nothing but the keys told them the epoch
        assert iterators[0] is iterators[1] is iterators[2]
