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


def training_sampler(dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> DistributedSampler:
    """Shuffle from (seed, epoch) alone, also on one process, so a run resumed at an epoch boundary sees the same order.

    Lightning calls set_epoch on it each epoch; its shards are reshuffled each epoch across ranks.
    """
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)


def shard_sizes(length: int, num_replicas: int) -> list[int]:
    """How many samples each rank evaluates (they differ by at most one)."""
    return [len(range(r, length, num_replicas)) for r in range(num_replicas)]


