"""The actors that own the entity partitions: each a share of the (entity type, partition)
pairs, their newest values in Ray's object store or, in disk placement, on disk.

It only holds state, so it asks for no CPU (`num_cpus=0`) and never keeps a train task
from being placed.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import ray

from pbg_ray.checkpoints.directory import checkpoint_metadata, row_adagrad_state
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.position import Position
from pbg_ray.checkpoints.sources import CheckpointSource, PartitionSource
from pbg_ray.config import ConfigSchema
from pbg_ray.io.files import sync_file
from pbg_ray.io.storage import ObjectPath, replace, storage_path
from pbg_ray.model.beyond import RowGradients
from pbg_ray.model.params import KnownRows, PartitionKey, known_rows
from pbg_ray.runtime.faults import fault_point
from pbg_ray.training.bucket_sources import SwapFile, asked_marker, writes_behind, written_marker


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

    placement="disk": a partitioned type's partitions stay on disk, as PBG swaps
    them on one machine, so the tables can be larger than RAM. A bucket's train
    task reads its partitions from checkpoint storage and writes each to a swap
    file (see SwapFile) that holds no partition's newest values, overwritten in
    place, so files' blocks and cached pages are neither allocated nor freed for
    every bucket: the store keeps one swap file per partition trained since the
    last checkpoint plus those written over next. `save` renames each partition's
    newest to its file of the new version, and `recycle` takes the files of the
    version it superseded as swap files.
    """

    def __init__(self, config: ConfigSchema, next_version: int) -> None:
        self.config = config
        self.disk = config.ray.placement == "disk"
        self.checkpoints = CheckpointManager(config.checkpoint_path)
        self.next_version = next_version
        self.refs: Dict[PartitionKey, ray.ObjectRef] = {}
        # Writable copies that deltas are added to; a ref is put when next asked for.
        self.summed: Dict[PartitionKey, List[np.ndarray]] = {}
        self.sources: Dict[PartitionKey, PartitionSource] = {}
        # Disk placement: the swap file holding a partition trained since its last
        # checkpoint, and those holding nothing needed. Swap files are named after this
        # store (a task of a replaced one may still be writing its own).
        self.newest: Dict[PartitionKey, SwapFile] = {}
        self.spare: List[str] = []
        self.owner = uuid.uuid4().hex[:12]
        self.num_swap_files = 0

    def swaps(self, key: PartitionKey) -> bool:
        return self.disk and self.config.entities[key[0]].num_partitions > 1

    def add(self, key: PartitionKey, source: PartitionSource) -> None:
        self.sources[key] = source
        if not self.swaps(key):
            self.refs[key] = ray.put(source.load(self.config, key))

    def _source(self, key: PartitionKey) -> PartitionSource:
        """Where a swapped partition's newest values are."""
        return self.newest[key].written if key in self.newest else self.sources[key]

    def source(self, key: PartitionKey) -> Optional[PartitionSource]:
        """Where a swapped partition's newest values are (None if it is not swapped): a
        trainer reads them ahead of its next bucket, whose lease will name this source."""
        return self._source(key) if self.swaps(key) else None

    def get(self, key: PartitionKey) -> List[ray.ObjectRef]:
        """[ref to (embeddings, sums)] (wrapped in a list so Ray passes the ref, not the
        value). Disk placement reads a swapped partition for this caller only."""
        if self.swaps(key):
            return [ray.put(self._source(key).load(self.config, key))]
        if key in self.summed and key not in self.refs:
            self.refs[key] = ray.put(tuple(self.summed[key]))
        return [self.refs[key]]

    def rows(self, key: PartitionKey, offsets: np.ndarray) -> np.ndarray:
        """A copy of the partition's newest embeddings at `offsets` (sorted, unique): in
        disk placement, of the newest ones written (negatives from beyond the bucket)."""
        if self.swaps(key):
            return self._source(key).load_rows(self.config, key, offsets)
        embs = self.summed[key][0] if key in self.summed else ray.get(self.refs[key])[0]
        return embs[offsets]

    def lease(self, key: PartitionKey, after: Optional[SwapFile] = None
              ) -> Union[List[ray.ObjectRef], SwapFile]:
        """What the train task of a bucket gets for `key`: `get`'s, or in disk placement
        the SwapFile it reads and writes (its result goes back to `update`). `after`: the
        lease of a task in flight, whose result has not come back yet, that the task of
        this lease follows on its trainer: it reads what that one writes."""
        if self.swaps(key):
            if not self.spare:
                self.spare.append(str(self.checkpoints.swap_file(self.owner, self.num_swap_files)))
                self.num_swap_files += 1
            source = after.written if after is not None else self._source(key)
            return SwapFile(source, self.spare.pop(), uuid.uuid4().hex)
        return self.get(key)

    def update(self, key: PartitionKey, value: List[ray.ObjectRef], is_delta: bool) -> None:
        """Take back a bucket's result: the new (embeddings, sums), their deltas, or the
        SwapFile the task wrote, from now on the partition's newest values."""
        fault_point("partition_store.update")
        if self.swaps(key):
            self._take_newest(key, ray.get(value[0]))
            return
        if not is_delta:
            self.refs[key] = value[0]
            self.summed.pop(key, None)
            return
        if key not in self.summed:
            self.summed[key] = [np.array(a) for a in ray.get(self.refs[key])]
        for total, delta in zip(self.summed[key], ray.get(value[0])):
            total += delta
        self.refs.pop(key, None)

    def apply_row_gradients(self, key: PartitionKey, gradients: List[RowGradients],
                            position: Position, known: Optional[KnownRows]) -> None:
        """Apply, in order, the gradients of the partition's rows that buckets drew from
        beyond them and no later task of the pass at `position` applied (model.beyond;
        `known`: what init_path trained steps at its own rate), to a copy put in the
        object store in its place, or in disk placement to a swap file written with them:
        from now on the partition's newest values. The partition is of a partitioned
        type (never a delta's) and no task trains it meanwhile (the pass has ended)."""
        lease = self.lease(key) if self.swaps(key) else None
        embs, sums = lease.load(self.config, key) if lease is not None else (
            np.array(a) for a in ray.get(self.refs[key]))
        for drawn in gradients:
            drawn.apply(embs, sums, self.config.lr, *known_rows(known, key))
        if lease is None:
            self.refs[key] = ray.put((embs, sums))
            return
        lease.write(self.config, embs, sums, checkpoint_metadata(self.config, position))
        self._take_newest(key, lease)

    def _take_newest(self, key: PartitionKey, written: SwapFile) -> None:
        """A swapped partition's newest values are those `written` wrote."""
        if key in self.newest:
            self.spare.append(self.newest[key].staged)
        self.newest[key] = written

    def _write(self, key: PartitionKey, value: Tuple[np.ndarray, np.ndarray], version: int,
               metadata: Dict[str, Any] = {}) -> None:
        embs, sums = value
        self.checkpoints.write_partition(version, key[0], key[1], embs,
                                         row_adagrad_state(sums, self.config.lr), metadata)

    def save(self, version: int, metadata: Dict[str, Any]) -> None:
        """Write every partition of this store as checkpoint version `version`."""
        assert version == self.next_version
        for key in self.sources:
            if key in self.newest:  # written (behind its task): made durable and renamed
                newest = self.newest[key]
                newest.wait_written()
                sync_file(newest.staged)
                replace(storage_path(newest.staged), self.checkpoints.partition_file(version, *key))
                if writes_behind(newest.staged):
                    written_marker(newest.staged).unlink(missing_ok=True)
                    asked_marker(newest.staged).unlink(missing_ok=True)
            elif key in self.summed:
                self._write(key, tuple(self.summed[key]), version, metadata)
            elif key in self.refs:
                self._write(key, ray.get(self.refs[key]), version, metadata)
            else:  # disk placement: not trained since its last checkpoint
                self._write(key, self.sources[key].load(self.config, key), version, metadata)
            fault_point("partition_store.save")
        # The rest are written over in the next pass (a dead task's too); the trainer
        # removes them at the end of the run.
        self.spare = [str(path) for path in self.checkpoints.swap_files(self.owner)]
        # From now on the partitions load from this version.
        for key in self.sources:
            self.sources[key] = CheckpointSource(str(self.checkpoints.path), version)
        self.newest.clear()
        self.next_version = version + 1

    def recycle(self, version: int) -> None:
        """Disk placement: take this store's partition files of `version`, superseded by
        the version just made current, as spare swap files instead of letting the trainer
        delete them. Writing over a file's cached pages costs far less than writing a new
        file, whose page-cache pages must be allocated first (and, on VMs whose host backs
        fresh pages lazily, backed by the host too). A file another name links to (an epoch
        snapshot) is left alone, as writing over it would change that one too."""
        for key in self.sources:
            path = self.checkpoints.partition_file(version, *key)
            if not self.swaps(key) or isinstance(path, ObjectPath):
                continue
            try:
                if os.stat(path).st_nlink != 1:
                    continue
            except FileNotFoundError:
                continue
            spare = self.checkpoints.swap_file(self.owner, self.num_swap_files)
            self.num_swap_files += 1
            os.replace(path, spare)
            self.spare.append(str(spare))

    def keys(self) -> List[PartitionKey]:
        return sorted(self.sources)
