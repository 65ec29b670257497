"""Auto-augment policies and random erasing in the train preset, built for both pipelines (uint8 workers normalized
on the device, or float workers): the same draws, the same images after normalization.

    python -m pytest tests/test_augmentation.py -q
"""

import pytest
import torch
from torchvision.transforms import v2

from classifier_engine.data.transforms import (
    AUTO_AUGMENT_POLICIES,
    DecodingResize,
    DecodingResizedCrop,
    NormalizeBatch,
    eval_preset,
    train_preset,
)
from classifier_engine.seeds import SeededSamples

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)


def photo(seed: int = 0, height: int = 48, width: int = 40) -> torch.Tensor:
    """A uint8 image with gradients and texture, so geometric and colour ops both show."""
    generator = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    base = torch.stack([ys, xs, (ys + xs) / 2]) * 200
    noise = torch.randint(0, 55, (3, height, width), generator=generator)
    return (base + noise).clamp(0, 255).to(torch.uint8)


def seeded(transform, image: torch.Tensor, seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transform(image)


@pytest.mark.parametrize("policy", AUTO_AUGMENT_POLICIES)
def test_each_auto_augment_policy_changes_uint8_images_and_keeps_shape_and_dtype(policy):
    plain = train_preset(crop_size=32, scale=(0.5, 1.0), normalize=False)
    augmented = train_preset(crop_size=32, scale=(0.5, 1.0), auto_augment=policy, normalize=False)
    image = photo()
    changed = 0
    for seed in range(12):
        # The same seed draws the same crop and flip first: what differs is the policy's op.
        before, after = seeded(plain, image, seed), seeded(augmented, image, seed)
        assert after.shape == before.shape == (3, 32, 32) and after.dtype == torch.uint8
        changed += not torch.equal(before, after)
    assert changed >= 6, f"{policy} changed only {changed} of 12 images"  # some draws are identity ops


def test_randaugment_options_reach_the_policy():
    preset = train_preset(auto_augment="randaugment", randaugment_num_ops=3, randaugment_magnitude=5)
    (policy,) = [t for t in preset.transforms if isinstance(t, v2.RandAugment)]
    assert (policy.num_ops, policy.magnitude) == (3, 5)


def test_unknown_auto_augment_policy_names_the_valid_ones():
    with pytest.raises(ValueError, match="expected one of trivialaugment_wide, randaugment, autoaugment"):
        train_preset(auto_augment="augmix")


@pytest.mark.parametrize("normalize", [False, True], ids=["uint8 workers", "float workers"])
def test_same_sample_key_gives_the_same_augmentation(normalize):
    transform = train_preset(crop_size=32, auto_augment="trivialaugment_wide", random_erase_prob=0.5,
                             normalize=normalize)
    samples = SeededSamples([(photo(i), i) for i in range(2)], run_seed=7, transform_for_epoch=lambda epoch: transform)
    first, again = samples[(1, 3, 0)][0], samples[(1, 3, 0)][0]
    assert torch.equal(first, again)
    others = [samples[key][0] for key in [(1, 4, 0), (1, 3, 1)]]  # another epoch, another repeat
    assert all(not torch.equal(first, other) for other in others)


def erased_box(image: torch.Tensor) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the pixels that are exactly 0 in every channel; asserts they form a rectangle."""
    rows, cols = torch.nonzero((image == 0).all(dim=0), as_tuple=True)
    assert rows.numel() > 0, "nothing was erased"
    top, left = int(rows.min()), int(cols.min())
    height, width = int(rows.max()) - top + 1, int(cols.max()) - left + 1
    assert rows.numel() == height * width, "the erased pixels are not a rectangle"
    return top, left, height, width


def test_random_erasing_fills_a_rectangle_that_normalizes_to_zero_in_both_pipelines():
    preset = train_preset(crop_size=32, random_erase_prob=1.0)
    uint8_preset, normalize = train_preset(crop_size=32, random_erase_prob=1.0, normalize=False), NormalizeBatch()
    for seed in range(5):
        float_out = seeded(preset, photo(seed), seed)  # torchvision's order: erase with 0 after Normalize
        uint8_out = seeded(uint8_preset, photo(seed), seed)  # erase with the mean colour, normalized on the device
        assert uint8_out.dtype == torch.uint8
        device_out = normalize(uint8_out[None])[0]
        top, left, height, width = erased_box(float_out)
        assert 0.02 <= height * width / 32**2 <= 0.33  # RandomErasing's default scale range
        box = (slice(None), slice(top, top + height), slice(left, left + width))
        # Same draws, same rectangle: within half a grey level of 0 (0.5 / 255 / std < 0.009).
        assert device_out[box].abs().max() < 0.009
        assert torch.equal(uint8_out[box], (MEAN * 255).round().to(torch.uint8).expand_as(uint8_out[box]))
        outside = torch.ones_like(float_out, dtype=torch.bool)
        outside[box] = False
        torch.testing.assert_close(device_out[outside], float_out[outside], atol=1e-5, rtol=0)


def test_the_uint8_preset_with_every_ingredient_is_the_float_one_without_its_float_conversion():
    uint8 = train_preset(crop_size=32, auto_augment="autoaugment", random_erase_prob=0.25, normalize=False)
    kinds = [type(t) for t in uint8.transforms]
    assert kinds == [v2.ToImage, DecodingResizedCrop, v2.RandomHorizontalFlip, v2.AutoAugment, v2.RandomErasing]
    assert uint8.transforms[-1].p == 0.25
    assert seeded(uint8, photo(), 0).dtype == torch.uint8
    full = train_preset(crop_size=32, auto_augment="autoaugment", random_erase_prob=0.25)
    assert [type(t) for t in full.transforms] == [*kinds[:-1], v2.ToDtype, v2.Normalize, v2.RandomErasing]


def test_the_defaults_add_no_ingredient():
    kinds = [type(t) for t in train_preset().transforms]
    assert kinds == [v2.ToImage, DecodingResizedCrop, v2.RandomHorizontalFlip, v2.ToDtype, v2.Normalize]
    assert [type(t) for t in train_preset(normalize=False).transforms] == kinds[:3]


@pytest.mark.parametrize("options", [dict(), dict(auto_augment="trivialaugment_wide"), dict(auto_augment="randaugment"),
                                     dict(auto_augment="autoaugment", random_erase_prob=0.5)],
                         ids=["crop+flip", "trivialaugment_wide", "randaugment", "autoaugment+erasing"])
def test_uint8_preset_normalized_on_the_device_equals_the_float_preset(options):
    # What normalize_on_device switches: the same draws, the same images, to within the uint8 erasing colour.
    float_preset = train_preset(crop_size=32, scale=(0.5, 1.0), **options)
    uint8_preset = train_preset(crop_size=32, scale=(0.5, 1.0), normalize=False, **options)
    for seed in range(6):
        expected = seeded(float_preset, photo(seed), seed)
        on_device = NormalizeBatch()(seeded(uint8_preset, photo(seed), seed)[None])[0]
        torch.testing.assert_close(on_device, expected, atol=0.009, rtol=0)  # erased: half a grey level off 0
        erased = (expected == 0).all(dim=0)
        torch.testing.assert_close(on_device[:, ~erased], expected[:, ~erased], atol=1e-5, rtol=0)


def test_eval_preset_in_uint8_normalized_on_the_device_equals_the_float_one():
    uint8 = eval_preset(resize_size=36, crop_size=32, normalize=False)
    assert [type(t) for t in uint8.transforms] == [v2.ToImage, DecodingResize, v2.CenterCrop]
    expected = eval_preset(resize_size=36, crop_size=32)(photo())
    torch.testing.assert_close(NormalizeBatch()(uint8(photo())[None])[0], expected, atol=1e-5, rtol=0)
