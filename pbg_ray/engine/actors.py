"""The Ray actors: partition stores, the parameter server, the bucket scheduler.

All three only hold state, so they ask for no CPU (`num_cpus=0`) and never
keep a train task from being placed.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import ray

from pbg_ray.config import ConfigSchema
from pbg_ray.engine.scheduler import BucketScheduler
from pbg_ray.incremental.growth import grow_partition
from pbg_ray.io.checkpoint import CheckpointStorage, row_adagrad_state, row_adagrad_sums
from pbg_ray.model import ModelParams, init_params, init_partition, params_from_checkpoint, params_to_checkpoint
from pbg_ray.types import Bucket

PartitionKey = Tuple[str, int]
# Where a partition's first values come from: ("checkpoint", path, version),
# ("init", path, version, count, new rows [count - init's rows, dim] or None: the
# partition grown to count rows, see incremental.growth) or ("random", count, seed).
Source = Tuple[Any, ...]


def _load_or_init(config: ConfigSchema, key: PartitionKey, source: Source) -> Tuple[np.ndarray, np.ndarray]:
    entity, part = key
    if source[0] == "random":
        _, count, seed = source
        return init_partition(config, entity, count, np.random.default_rng([seed, part, zlib.crc32(entity.encode())]))
    _, path, version = source[:3]
    embs, state = CheckpointStorage(path).load_entity_partition(version, entity, part)
    where = str(CheckpointStorage(path).partition_file(version, entity, part))
    sums = row_adagrad_sums(state, len(embs), where)
    sums = np.zeros(len(embs), np.float32) if sums is None else sums
    if source[0] == "init":
        count, new_rows = source[3:]
        return grow_partition(config, key, embs, sums, count, new_rows, where)
    return embs, sums


@ray.remote(num_cpus=0)
class PartitionStore:
    """Owns some entity partitions: embeddings float32 [N, dim] + row-Adagrad sums [N].

    The store keeps an ObjectRef to each partition's newest (embeddings, sums)
    pair in Ray's object store and hands it out, with no copy through this
    process. A bucket's trained copy simply replaces it: partitions of
    partitioned types are trained by one bucket at a time (the scheduler's
    locks), and so is everything when only one trainer runs. Unpartitioned
    types trained by concurrent buckets send deltas instead, added here to a
    writable copy that is put in the object store again when next asked for.

    placement="disk": a partitioned type's partition stays in memory only
    while buckets in flight use it; `swap_out` then writes it to checkpoint
    storage as the next version's file (as PBG does), so the tables can be
    larger than RAM. A partition the next bucket uses again is not swapped,
    and one it will use is read ahead while the current bucket trains.
    """

    def __init__(self, config: ConfigSchema, next_version: int) -> None:
        self.config = config
        self.disk = config.ray.placement == "disk"
        self.storage = CheckpointStorage(config.checkpoint_path)
        self.next_version = next_version
        self.refs: Dict[PartitionKey, ray.ObjectRef] = {}
        # Writable copies that deltas are added to; a ref is put when next asked for.
        self.summed: Dict[PartitionKey, List[np.ndarray]] = {}
        self.sources: Dict[PartitionKey, Source] = {}
        self.trained: set = set()  # disk placement: in memory and changed since loaded
        self.swapped: set = set()  # written as next_version, not in memory

    def swaps(self, key: PartitionKey) -> bool:
        return self.disk and self.config.entities[key[0]].num_partitions > 1

    def add(self, key: PartitionKey, source: Source) -> None:
        self.sources[key] = source
        if not self.swaps(key):
            self.refs[key] = ray.put(_load_or_init(self.config, key, source))

    def get(self, key: PartitionKey) -> List[ray.ObjectRef]:
        """[ref to (embeddings, sums)] (wrapped in a list so Ray passes the ref, not the value)."""
        if key in self.summed and key not in self.refs:
            self.refs[key] = ray.put(tuple(self.summed[key]))
        if key not in self.refs:  # disk placement: swap in
            source: Source = (("checkpoint", str(self.storage.path), self.next_version)
                              if key in self.swapped else self.sources[key])
            self.refs[key] = ray.put(_load_or_init(self.config, key, source))
        return [self.refs[key]]

    def read_ahead(self, key: PartitionKey) -> None:
        """Disk placement: swap `key` in now, for the next bucket that uses it. (Returns
        nothing: a ref to the partition held by the caller would keep it alive.)"""
        self.get(key)

    def update(self, key: PartitionKey, value: List[ray.ObjectRef], is_delta: bool) -> None:
        """Take back a bucket's result: the new (embeddings, sums), or their deltas."""
        if not is_delta:
            self.refs[key] = value[0]
            self.summed.pop(key, None)
            if self.swaps(key):
                self.trained.add(key)
            return
        if key not in self.summed:
            self.summed[key] = [np.array(a) for a in ray.get(self.refs[key])]
        for total, delta in zip(self.summed[key], ray.get(value[0])):
            total += delta
        self.refs.pop(key, None)

    def swap_out(self, in_use: List[PartitionKey]) -> None:
        """Disk placement: write and drop the partitions no bucket in flight uses."""
        for key in [k for k in self.refs if self.swaps(k) and k not in in_use]:
            if key in self.trained:
                self._write(key, ray.get(self.refs[key]), self.next_version)
                self.swapped.add(key)
                self.trained.discard(key)
            del self.refs[key]

    def _write(self, key: PartitionKey, value: Tuple[np.ndarray, np.ndarray], version: int,
               metadata: Dict[str, Any] = {}) -> None:
        embs, sums = value
        self.storage.save_entity_partition(version, key[0], key[1], embs,
                                           row_adagrad_state(sums, self.config.lr), metadata)

    def save(self, version: int, metadata: Dict[str, Any]) -> None:
        """Write every partition of this store as checkpoint version `version`."""
        assert version == self.next_version
        for key in self.sources:
            if key in self.summed:
                self._write(key, tuple(self.summed[key]), version, metadata)
            elif key in self.refs:
                self._write(key, ray.get(self.refs[key]), version, metadata)
            elif key not in self.swapped:  # not trained since its last checkpoint
                self._write(key, _load_or_init(self.config, key, self.sources[key]), version, metadata)
        # From now on the partitions load from this version.
        for key in self.sources:
            self.sources[key] = ("checkpoint", str(self.storage.path), version)
        self.trained.clear()
        self.swapped.clear()
        self.next_version = version + 1

    def keys(self) -> List[PartitionKey]:
        return sorted(self.sources)


@ray.remote(num_cpus=0)
class ParameterServer:
    """The shared, non-entity parameters (relation operators, global embeddings)
    with their Adagrad sums. Concurrent train tasks pull a copy and push the
    change they made, which is added here."""

    def __init__(self, config: ConfigSchema, num_relation_ids: int) -> None:
        self.config = config
        self.num_relation_ids = num_relation_ids
        self.params: Optional[ModelParams] = None

    def load(self, source: Optional[Source]) -> None:
        """The first values: PBG's initial ones (source None) or those of a ("checkpoint"
        or "init", path, version) model file. (A method, not the constructor, so that a
        bad file's error reaches the driver as this call's, like PartitionStore.add's.)"""
        if source is None:
            self.params = init_params(self.config, self.num_relation_ids)
            return
        _, path, version = source
        storage = CheckpointStorage(path)
        arrays, optim_state = storage.load_model(version)
        self.params = params_from_checkpoint(self.config, self.num_relation_ids, arrays,
                                             optim_state, grow=source[0] == "init",
                                             where=str(storage.model_file(version)))

    def get(self) -> ModelParams:
        return self.params

    def apply_delta(self, delta: ModelParams) -> None:
        for name, value in delta.arrays.items():
            self.params.arrays[name] += value
        for name, value in delta.sums.items():
            self.params.sums[name] += value

    def save(self, version: int, metadata: Dict[str, Any]) -> None:
        arrays, optim_state = params_to_checkpoint(self.config, self.params)
        CheckpointStorage(self.config.checkpoint_path).save_model(version, arrays, optim_state, metadata)


@ray.remote(num_cpus=0)
class BucketSchedulerActor:
    """Hands out buckets (see engine.scheduler.BucketScheduler) to the driver's trainers."""

    def __init__(self, nparts_lhs: int, nparts_rhs: int, order: str, lock_lhs: bool,
                 lock_rhs: bool, seed: int) -> None:
        self.scheduler = BucketScheduler(nparts_lhs, nparts_rhs, order,
                                         lock_lhs=lock_lhs, lock_rhs=lock_rhs, seed=seed)

    def new_pass(self) -> List[Bucket]:
        return self.scheduler.new_pass()

    def acquire(self) -> Optional[Bucket]:
        return self.scheduler.acquire()

    def peek(self) -> Optional[Bucket]:
        return self.scheduler.peek()

    def release(self, bucket: Bucket) -> None:
        self.scheduler.release(bucket)

    def fail(self, bucket: Bucket) -> None:
        self.scheduler.fail(bucket)

    def pass_done(self) -> bool:
        return self.scheduler.pass_done()
