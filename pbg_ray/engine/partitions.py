"""Where an entity partition's values come from, and in disk placement how a task reads
them itself (OnDisk) and where a train task writes them back (SwapFile)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import numpy as np

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.storage import row_adagrad_state, row_adagrad_sums
from pbg_ray.config import ConfigSchema
from pbg_ray.incremental.growth import grow_partition
from pbg_ray.model.params import init_partition

PartitionKey = Tuple[str, int]
# Where a partition's values come from: ("checkpoint", path, version), ("init", path,
# version, count, new rows [count - init's rows, dim] or None: the partition grown to
# count rows, see incremental.growth), ("random", count, seed) or ("swap", file, token):
# a SwapFile's file as the task of that lease wrote it.
Source = Tuple[Any, ...]


def load_partition(config: ConfigSchema, key: PartitionKey, source: Source,
                   empty: Callable[..., np.ndarray] = np.empty) -> Tuple[np.ndarray, np.ndarray]:
    """(embeddings float32 [N, dim], row-Adagrad sums [N]) of `source`; the embeddings
    of a checkpoint or a random start land in `empty(shape, dtype)`."""
    entity, part = key
    if source[0] == "random":
        _, count, seed = source
        rng = np.random.default_rng([seed, part, zlib.crc32(entity.encode())])
        return init_partition(config, entity, count, rng, empty)
    if source[0] == "swap":
        where = source[1]
    else:
        _, path, version = source[:3]
        where = str(CheckpointManager(path).partition_file(version, entity, part))
    embs, state = CheckpointManager.read_partition_file(where, empty)
    sums = row_adagrad_sums(state, len(embs), where)
    sums = np.zeros(len(embs), np.float32) if sums is None else sums
    if source[0] == "init":
        count, new_rows = source[3:]
        return grow_partition(config, key, embs, sums, count, new_rows, where)
    return embs, sums


@dataclasses.dataclass(frozen=True)
class OnDisk:
    """Disk placement: a partition that a task reads itself, from `source`, instead of
    receiving it through Ray's object store (whose shared memory stays resident at its
    high-water mark), so memory holds only the partitions of the tasks in flight."""

    source: Source

    def load(self, config: ConfigSchema, key: PartitionKey,
             empty: Callable[..., np.ndarray] = np.empty) -> Tuple[np.ndarray, np.ndarray]:
        return load_partition(config, key, self.source, empty)


Partition = Union[Tuple[np.ndarray, np.ndarray], OnDisk]  # what a task receives per key


def resolved(config: ConfigSchema, keys: List[PartitionKey], partitions: Sequence[Partition]
             ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The (embeddings, sums) of each partition a read-only task received: as they came
    through the object store, or read here from disk."""
    return [p.load(config, key) if isinstance(p, OnDisk) else p
            for key, p in zip(keys, partitions)]


@dataclasses.dataclass(frozen=True)
class SwapFile(OnDisk):
    """A partition that its bucket's train task reads itself and writes to `staged`, a
    swap file that holds no partition's newest values. The partition store takes
    `staged` as the partition's newest values only once the task succeeded: a task that
    dies changed nothing. `token` is unique to the lease, so `written` names what this
    task writes."""

    staged: str
    token: str

    @property
    def written(self) -> Source:
        """Where the values this task writes are, once written."""
        return ("swap", self.staged, self.token)

    def write(self, config: ConfigSchema, embs: np.ndarray, sums: np.ndarray,
              metadata: Dict[str, Any]) -> None:
        """embs [N, dim], sums [N], with the checkpoint's `metadata` (the file may become
        the partition's file of the next version as it is); over the swap file's own
        bytes, not fsync'ed (the store does that at the checkpoint)."""
        CheckpointManager.write_partition_file(
            self.staged, embs, row_adagrad_state(sums, config.lr), metadata, in_place=True)
