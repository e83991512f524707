"""Where an entity partition's values come from, as typed sources that a task reads itself
(`load`): here a checkpoint version's file; training adds its own (training/bucket_sources.py).
A task receives, per partition, its arrays through Ray's object store or a source to read
them from, so that memory holds only the partitions of the tasks in flight."""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, List, Sequence, Tuple, Union

import numpy as np

from pbg_ray.checkpoints.directory import row_adagrad_sums
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.model.params import PartitionKey

Arrays = Tuple[np.ndarray, np.ndarray]  # (embeddings float32 [N, dim], row-Adagrad sums [N])
Empty = Callable[..., np.ndarray]  # empty(shape, dtype): the array to read into


def read_partition_file(where: str, empty: Empty = np.empty) -> Arrays:
    """(embeddings, sums) of an embeddings file (a checkpoint's or a swap file); sums zero
    where it has no optimizer state."""
    embs, state = CheckpointManager.read_partition_file(where, empty)
    sums = row_adagrad_sums(state, len(embs), where)
    return embs, np.zeros(len(embs), np.float32) if sums is None else sums


@dataclasses.dataclass(frozen=True)
class PartitionSource:
    """Where a partition's values are. `holdable`: a worker may keep the partition between
    its tasks under this source (it names a file or a seeded start, no arrays)."""

    holdable: ClassVar[bool] = True

    def load(self, config: ConfigSchema, key: PartitionKey, empty: Empty = np.empty) -> Arrays:
        """The partition's (embeddings, sums); the embeddings land in `empty(shape, dtype)`."""
        raise NotImplementedError

    def load_rows(self, config: ConfigSchema, key: PartitionKey, offsets: np.ndarray) -> np.ndarray:
        """The embeddings at `offsets` (sorted, unique) of the partition."""
        return self.load(config, key)[0][offsets]


@dataclasses.dataclass(frozen=True)
class CheckpointSource(PartitionSource):
    """Version `version` of the checkpoint in `path`."""

    path: str
    version: int

    def load(self, config: ConfigSchema, key: PartitionKey, empty: Empty = np.empty) -> Arrays:
        return read_partition_file(
            str(CheckpointManager(self.path).partition_file(self.version, *key)), empty)

    def load_rows(self, config: ConfigSchema, key: PartitionKey, offsets: np.ndarray) -> np.ndarray:
        """Read alone, not with the rest of the partition."""
        return CheckpointManager(self.path).read_partition_rows(self.version, *key, offsets)

    def size(self, key: PartitionKey) -> int:
        """The partition's number of entities, from its file's metadata."""
        return CheckpointManager(self.path).partition_size(self.version, *key)


Partition = Union[Arrays, PartitionSource]  # what a task receives per partition


def resolved_rows(config: ConfigSchema, key: PartitionKey, partition: Partition,
                  offsets: np.ndarray) -> np.ndarray:
    """The embeddings at `offsets` (sorted, unique) of a partition a read-only task
    received: sliced from its arrays, or read from its source without the other rows."""
    if isinstance(partition, PartitionSource):
        return partition.load_rows(config, key, offsets)
    return partition[0][offsets]


def resolved(config: ConfigSchema, keys: Sequence[PartitionKey],
             partitions: Sequence[Partition]) -> List[Arrays]:
    """The (embeddings, sums) of each partition a read-only task received: as they came
    through the object store, or read here from their source."""
    return [p.load(config, key) if isinstance(p, PartitionSource) else p
            for key, p in zip(keys, partitions)]
