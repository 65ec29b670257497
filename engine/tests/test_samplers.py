"""The training order: a shuffle of (seed, epoch) shared by all ranks, repeated augmentation spread over ranks, and
resuming at any position on every rank; evaluation shards that count every image once.

    python -m pytest tests/test_samplers.py
"""

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset

from classifier_engine.errors import ConfigError
from classifier_engine.samplers import ExactDistributedSampler, ResumableDataLoader, ResumableSampler


class Indices(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, key):
        return torch.tensor(key)


def keys(sampler: ResumableSampler, epoch: int) -> list[tuple[int, int, int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_every_rank_shares_one_shuffle_per_epoch_and_the_epochs_differ():
    data = Indices(10)
    ranks = [ResumableSampler(data, num_replicas=2, rank=r, seed=7) for r in (0, 1)]
    epoch0 = [keys(s, 0) for s in ranks]
    assert sorted(index for shard in epoch0 for index, _, _ in shard) == list(range(10))  # disjoint, complete
    assert all(epoch == 0 and repeat == 0 for shard in epoch0 for _, epoch, repeat in shard)
    assert [i for i, _, _ in keys(ranks[0], 1)] != [i for i, _, _ in epoch0[0]]
    assert keys(ResumableSampler(data, num_replicas=2, rank=0, seed=7), 0) == epoch0[0]  # a function of (seed, epoch)


def test_repeated_augmentation_gives_each_drawn_image_ra_reps_copies_on_different_ranks():
    data, reps = Indices(12), 3
    shards = [keys(ResumableSampler(data, num_replicas=3, rank=r, seed=0, repeats=reps), 5) for r in range(3)]
    assert [len(shard) for shard in shards] == [4, 4, 4]  # the epoch keeps the data set's length
    every = [key for shard in shards for key in shard]
    counts = Counter(index for index, _, _ in every)
    assert set(counts.values()) == {reps} and len(counts) == 12 // reps  # len/reps images, each reps times
    assert len({(index, repeat) for index, _, repeat in every}) == len(every)  # each copy once: its own augmentation
    for index in counts:  # the copies of an image land on different ranks
        assert len({rank for rank, shard in enumerate(shards) for i, _, _ in shard if i == index}) == reps


def test_resuming_at_a_position_continues_the_epoch_on_every_rank():
    data = Indices(21)
    full = [keys(ResumableSampler(data, num_replicas=2, rank=r, seed=3), 2) for r in (0, 1)]
    for rank in (0, 1):
        sampler = ResumableSampler(data, num_replicas=2, rank=rank, seed=3)
        sampler.resume(2, position=8)  # 4 batches of 2 per rank were trained
        assert keys(sampler, 2) == full[rank][4:]
        assert keys(sampler, 2) == full[rank]  # the next iteration of the epoch is whole again
    stale = ResumableSampler(data, num_replicas=2, rank=0, seed=3)
    stale.resume(1, position=8)
    assert keys(stale, 2) == full[0]  # a position of another epoch does not apply


@pytest.mark.parametrize("batch, share, padding", [(4, 26, 2), (5, 27, 5)])
def test_a_resume_on_another_world_size_and_batch_gives_each_rank_an_equal_share_of_the_rest_each_sample_once(
        batch, share, padding):
    saved = ResumableSampler(Indices(100), num_replicas=2, rank=0, seed=7, keys=False, batch_size=6)
    state = {**saved.loader_state(6), "position": 24}  # 2 steps of 2 x 6 trained: 76 samples left
    rest = [index for index, _ in saved.epoch_order(0)[24:]]
    shares = []
    for rank in range(3):
        sampler = ResumableSampler(Indices(100), num_replicas=3, rank=rank, seed=7, keys=False, batch_size=batch)
        with pytest.warns(UserWarning, match="world_size 2 -> 3, batch_size 6 -> 4|batch_size 6 -> 5"):
            sampler.restore_loader_state(batch, state)
        assert sampler.resumed_share(0) == share
        shares.append(keys(sampler, 0))
    # Equal shares (every rank ends the epoch at the same batch), padded as DistributedSampler pads an epoch (3 x 34
    # for 100 samples: the 2 first again, then the rest's first); 26 % 5 would leave a last batch of one sample
    # (BatchNorm raises): one more each. Every sample of the rest once; the padding, and only it, twice.
    assert [len(s) for s in shares] == [share] * 3
    seen = Counter(index for s in shares for index in s)
    assert set(rest) <= set(seen) and sum(seen.values()) - len(rest) == padding


def test_the_loader_counts_the_batches_it_hands_out_not_what_workers_prefetch():
    data = Indices(20)
    sampler = ResumableSampler(data, num_replicas=1, rank=0, seed=0)
    loader = ResumableDataLoader(data, batch_size=4, sampler=sampler, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(2)]
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["position"] == 8 and state["seed"] == 0
    rest = list(iterator)
    resumed_sampler = ResumableSampler(data, num_replicas=1, rank=0, seed=0)
    resumed = ResumableDataLoader(data, batch_size=4, sampler=resumed_sampler)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in rest]
    assert len(first) == 2 and len(resumed) == 5  # the epoch's length stays whole for Lightning's counters


def test_ra_reps_below_one_is_refused():
    with pytest.raises(ConfigError, match="data.ra_reps must be >= 1, got 0"):
        ResumableSampler(Indices(4), num_replicas=1, rank=0, seed=0, repeats=0)


def test_exact_evaluation_shards_count_every_image_once_and_an_empty_shard_is_refused():
    data = Indices(5)
    shards = [list(ExactDistributedSampler(data, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(i for shard in shards for i in shard) == list(range(5))
    with pytest.raises(ConfigError, match="2 images for 3 processes: rank 2 would evaluate none"):
        ExactDistributedSampler(Indices(2), num_replicas=3, rank=2)


@pytest.mark.parametrize("size", [5, 7, 10, 17])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exact_shards_are_lightnings_unpadded_predict_shards_in_every_epoch(size, world_size):
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    for rank in range(world_size):
        ours = ExactDistributedSampler(Indices(size), num_replicas=world_size, rank=rank)
        lightnings = UnrepeatedDistributedSampler(Indices(size), num_replicas=world_size, rank=rank, shuffle=False)
        for epoch in (0, 3):  # set_epoch changes nothing: evaluation is never shuffled
            ours.set_epoch(epoch)
            lightnings.set_epoch(epoch)
            assert list(ours) == list(lightnings) == list(range(rank, size, world_size))
            assert len(ours) == len(lightnings) and ours.total_size == lightnings.total_size == size
    # Shuffled (never for evaluation), Lightning's permutation follows the epoch alone: the seed changes nothing.
    one, other = (UnrepeatedDistributedSampler(Indices(10), num_replicas=2, rank=0, shuffle=True, seed=s)
                  for s in (1, 2))
    assert list(one) == list(other)


def test_lightnings_unpadded_sampler_fails_only_on_the_empty_rank_with_a_bare_assertion():
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    assert list(UnrepeatedDistributedSampler(Indices(2), num_replicas=3, rank=0)) == [0]  # rank 0 would go on
    with pytest.raises(AssertionError):
        UnrepeatedDistributedSampler(Indices(2), num_replicas=3, rank=2)
    for rank in range(3):  # ours refuses on every rank, with the fix
        with pytest.raises(ConfigError, match="evaluate with fewer processes"):
            ExactDistributedSampler(Indices(2), num_replicas=3, rank=rank)
