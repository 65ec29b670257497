"""MixUp/CutMix per batch (seeded from run seed, epoch and batch index) and the losses on soft targets.

    python -m pytest tests/test_mixing.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from classifier_engine.seeds import batch_seed

from project.mixing import BatchMixer, soft_target_loss

CLASSES = 10


def batch(size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized-looking float images and distinct labels (so each soft target row shows its weights)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 16, 16, generator=generator), torch.arange(size) % CLASSES


def own_weight(soft: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the weight of its own label: lambda (MixUp) or the kept area's share (CutMix)."""
    return soft.gather(1, targets[:, None])[:, 0]


def pasted(mixed: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """(H, W) mask of the pixels CutMix took from the neighbour, the same for every image of the batch."""
    return (mixed != images).any(dim=1).any(dim=0)


@pytest.mark.parametrize("alphas", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)], ids=["mixup", "cutmix", "both"])
def test_soft_targets_sum_to_one_and_images_keep_their_shape(alphas):
    mixer = BatchMixer(CLASSES, *alphas)
    images, targets = batch()
    for index in range(6):
        mixed, soft = mixer(images, targets, batch_seed(0, 0, index))
        assert mixed.shape == images.shape and mixed.dtype == images.dtype
        assert soft.shape == (8, CLASSES) and soft.dtype == torch.float32
        torch.testing.assert_close(soft.sum(dim=1), torch.ones(8))
        assert (soft >= 0).all() and not torch.equal(mixed, images)


def test_same_run_epoch_and_batch_draw_the_same_and_other_batches_differ():
    mixer = BatchMixer(CLASSES, mixup_alpha=0.2, cutmix_alpha=1.0)
    images, targets = batch()
    first = mixer(images, targets, batch_seed(42, 3, 17))
    again = mixer(images, targets, batch_seed(42, 3, 17))  # e.g. the same batch after a resume
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    for seed in (batch_seed(42, 3, 18), batch_seed(42, 4, 17), batch_seed(43, 3, 17)):
        assert not torch.equal(mixer(images, targets, seed)[1], first[1])


def test_the_run_random_stream_is_left_where_it_was():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    BatchMixer(CLASSES, 0.2, 1.0)(*batch(), seed=batch_seed(0, 0, 0))
    assert torch.equal(torch.rand(3), expected)


def test_two_ranks_with_halves_of_a_batch_draw_the_same_lambda():
    images, targets = batch(16)
    mixer = BatchMixer(CLASSES, mixup_alpha=0.2)
    seed = batch_seed(0, 2, 5)
    _, soft_0 = mixer(images[:8], targets[:8], seed)
    _, soft_1 = mixer(images[8:], targets[8:], seed)
    lam = own_weight(soft_0, targets[:8])
    assert torch.allclose(lam, lam[0]) and 0 < lam[0] < 1
    torch.testing.assert_close(own_weight(soft_1, targets[8:]), lam)


def test_two_ranks_with_halves_of_a_batch_paste_the_same_box():
    images, targets = batch(16)
    mixer = BatchMixer(CLASSES, cutmix_alpha=1.0)
    boxes = set()
    for index in range(4):
        seed = batch_seed(0, 2, index)
        mixed_0, soft_0 = mixer(images[:8], targets[:8], seed)
        mixed_1, soft_1 = mixer(images[8:], targets[8:], seed)
        box = pasted(mixed_0, images[:8])
        assert torch.equal(box, pasted(mixed_1, images[8:]))
        # The targets weigh the neighbour by the pasted area (v2's lam_adjusted).
        torch.testing.assert_close(own_weight(soft_0, targets[:8]), torch.full((8,), 1 - box.float().mean().item()))
        torch.testing.assert_close(own_weight(soft_1, targets[8:]), own_weight(soft_0, targets[:8]))
        boxes.add(tuple(box.flatten().tolist()))
    assert len(boxes) == 4  # each batch its own box


def test_with_both_alphas_each_batch_gets_mixup_or_cutmix():
    mixer = BatchMixer(CLASSES, mixup_alpha=0.2, cutmix_alpha=1.0)
    images, targets = batch()
    kinds = []
    for index in range(16):
        mixed, _ = mixer(images, targets, batch_seed(0, 0, index))
        unchanged = (mixed == images).all(dim=1).all(dim=0)  # CutMix keeps the pixels outside its box exactly
        kinds.append("cutmix" if unchanged.any() else "mixup")
    assert set(kinds) == {"mixup", "cutmix"}


def test_disabled_mixer_passes_the_batch_through():
    images, targets = batch()
    mixed, same = BatchMixer(CLASSES)(images, targets, seed=1)
    assert mixed is images and same is targets


def test_negative_alpha_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        BatchMixer(CLASSES, mixup_alpha=-0.1)


def test_cross_entropy_smooths_hard_and_soft_targets_alike():
    logits = torch.randn(6, CLASSES, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 3, 9, 3, 1, 2])
    hard = soft_target_loss(logits, targets, label_smoothing=0.1)
    soft = soft_target_loss(logits, F.one_hot(targets, CLASSES).float(), label_smoothing=0.1)
    smoothed = F.one_hot(targets, CLASSES) * 0.9 + 0.1 / CLASSES
    by_hand = -(smoothed * logits.log_softmax(dim=1)).sum(dim=1).mean()
    torch.testing.assert_close(hard, by_hand)
    torch.testing.assert_close(soft, by_hand)
    torch.testing.assert_close(soft_target_loss(logits, targets), F.cross_entropy(logits, targets))


def test_bce_matches_a_hand_computation_with_timm_off_and_on_values():
    logits = torch.randn(4, CLASSES, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([2, 0, 7, 7])
    off, on = 0.1 / CLASSES, 1 - 0.1 + 0.1 / CLASSES  # timm BinaryCrossEntropy(smoothing=0.1)
    expected = torch.full((4, CLASSES), off)
    expected[torch.arange(4), targets] = on
    p = logits.sigmoid()
    by_hand = -(expected * p.log() + (1 - expected) * (1 - p).log()).mean()
    torch.testing.assert_close(soft_target_loss(logits, targets, loss="bce", label_smoothing=0.1), by_hand)
    # Mixed targets: smoothing the mix equals mixing the smoothed one-hots (timm smooths before mixing).
    mixed = 0.7 * F.one_hot(targets, CLASSES).float() + 0.3 * F.one_hot(targets.roll(1), CLASSES).float()
    smoothed_mix = 0.7 * expected + 0.3 * expected.roll(1, 0)
    by_hand = -(smoothed_mix * p.log() + (1 - smoothed_mix) * (1 - p).log()).mean()
    torch.testing.assert_close(soft_target_loss(logits, mixed, loss="bce", label_smoothing=0.1), by_hand)
    # RSB A1's target threshold: targets above 0.2 become 1, the rest 0.
    binary = (mixed > 0.2).float()
    torch.testing.assert_close(soft_target_loss(logits, mixed, loss="bce", bce_target_threshold=0.2),
                               F.binary_cross_entropy_with_logits(logits, binary))


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="'cross_entropy' or 'bce'"):
        soft_target_loss(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), loss="focal")
