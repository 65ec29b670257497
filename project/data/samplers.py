"""Samplers that make distributed training reproducible and distributed evaluation exact."""

from torch.utils.data import Dataset, DistributedSampler


class ExactDistributedSampler(DistributedSampler):
    """Shard rank::world_size without padding: every sample is seen exactly once over all ranks.

    Lightning's default sampler pads the last shard with duplicates so ranks get equal batch counts, which makes
    validation accuracy depend on the world size. A subclass of DistributedSampler, so Lightning keeps it as is.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))
        self.total_size = len(dataset)

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class EpochKeyedSampler(DistributedSampler):
    """DistributedSampler that yields (index, epoch), so each sample's augmentation can be seeded from both."""

    def __iter__(self):
        epoch = self.epoch
        return ((index, epoch) for index in super().__iter__())


def training_sampler(dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> DistributedSampler:
    """Shuffle from (seed, epoch) alone, also on one process, so a resumed run sees the same order.

    Lightning calls set_epoch on it each epoch; its shards are reshuffled each epoch across ranks.
    Pair it with seeded.PerSampleSeeded, which takes the (index, epoch) keys it yields.
    """
    return EpochKeyedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
