"""Which buckets get PBG's Hogwild warm-up (hogwild_delay): decided by the driver, from the
partitions trained since the run's actors loaded them."""

from __future__ import annotations

from typing import Collection, Set

from pbg_ray.config import ConfigSchema
from pbg_ray.model.params import PartitionKey


class HogwildWarmUp:
    """Which buckets get PBG's Hogwild warm-up (hogwild_delay: the task's first thread
    trains alone up to that long before its other threads join, see model.kernel.BatchQueue).

    The rule: a bucket of the first epoch is warmed up when it trains a partition that no
    bucket has trained yet since the run's actors loaded the partitions; every other
    bucket trains on all its threads at once.

    Why: PBG's docs give the warm-up's purpose: "Optimization is further stabilized by
    performing a short period of training with a single thread before beginning Hogwild!
    training". It burns in the Adagrad state: each element of a sum only grows, so while
    the sums are still zero the first updates are the largest, and once they are not,
    asynchronous updates are stable. A bucket whose partitions have all been trained has
    sums burnt in, and so have the shared parameters (relation operators, global
    embeddings), which every bucket trains. PBG itself warms up every bucket of epoch 0,
    so a one-epoch run of n partitions of one entity type waits at its n * n buckets, where
    this waits at n of them at most.

    A partition counts as trained once the update of a bucket holding it has been sent to
    the actors (`trained`), and for a task submitted behind its trainer's bucket in flight
    (disk placement, see PassRun.launch) once that bucket is trained (`before`). Buckets
    trained at the same time share no partitioned entity type's partition (the
    scheduler's locks), so a bucket that brings no new partition starts after those that
    trained its partitions; a bucket whose trainer died brought nothing in, and is warmed
    up when it goes out again.

    Resumed and incremental runs: the set of trained partitions starts empty whenever the
    actors load the partitions (the run's start, and the restart after an actor died), so
    a run resumed within its first epoch warms up each partition's first bucket once more
    (its partitions come from a checkpoint with their sums burnt in: the wait is all it
    costs), one resumed after its first epoch warms up nothing, and an init_path run
    warms up each partition's first bucket (a grown partition's new rows start with zero
    sums)."""

    def __init__(self, config: ConfigSchema, num_chunks: int) -> None:
        self.hogwild_delay = config.hogwild_delay
        self.first_epoch_passes = len(config.edge_paths) * num_chunks
        self.trained_partitions: Set[PartitionKey] = set()

    def seconds(self, iteration: int, keys: Collection[PartitionKey],
                before: Collection[PartitionKey] = ()) -> float:
        """The warm-up of a bucket of partitions `keys` in pass `iteration`; `before`: the
        partitions of the bucket in flight whose task this one's starts behind."""
        if iteration < self.first_epoch_passes and not self.trained_partitions.union(
                before).issuperset(keys):
            return self.hogwild_delay
        return 0.0

    def trained(self, keys: Collection[PartitionKey]) -> None:
        """The update of a bucket of partitions `keys` was sent to the actors."""
        self.trained_partitions.update(keys)
