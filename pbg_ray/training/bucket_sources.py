"""Where an entity partition's values come from in training, besides a checkpoint version
(checkpoints/sources.py): a random start, a grown init_path checkpoint, a swap file; the
model's parameters' first values; and in disk placement the lease by which a train task
reads a partition and writes it back (SwapFile), behind the task after it has returned
(write-behind, with a marker file saying when the write is done)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any, ClassVar, Dict, Optional

import numpy as np

from pbg_ray.checkpoints.directory import row_adagrad_state
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.sources import Arrays, Empty, PartitionSource, read_partition_file
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.incremental.growth import grow_partition
from pbg_ray.io.storage import ObjectPath, storage_path
from pbg_ray.model.params import (
    ModelParams, PartitionKey, init_partition, params_from_checkpoint)

# How long a reader waits for a swap file's write-behind to finish.
WRITE_WAIT_S = 600.0


@dataclasses.dataclass(frozen=True)
class RandomSource(PartitionSource):
    """A new partition of `count` rows, drawn from `seed` (and its key)."""

    count: int
    seed: int

    def load(self, config: ConfigSchema, key: PartitionKey, empty: Empty = np.empty) -> Arrays:
        entity, part = key
        rng = np.random.default_rng([self.seed, part, zlib.crc32(entity.encode())])
        return init_partition(config, entity, self.count, rng, empty)


@dataclasses.dataclass(frozen=True)
class InitSource(PartitionSource):
    """Version `version` of init_path's checkpoint in `path`, grown to `count` rows: its
    rows first, then `new_rows` [count - its rows, dim] (None: drawn anew), see
    incremental.growth."""

    holdable: ClassVar[bool] = False  # it names arrays
    path: str
    version: int
    count: int
    new_rows: Optional[np.ndarray] = None

    def load(self, config: ConfigSchema, key: PartitionKey, empty: Empty = np.empty) -> Arrays:
        where = str(CheckpointManager(self.path).partition_file(self.version, *key))
        embs, sums = read_partition_file(where, empty)
        return grow_partition(config, key, embs, sums, self.count, self.new_rows, where)


@dataclasses.dataclass(frozen=True)
class SwapSource(PartitionSource):
    """The swap file `file` as the task of lease `token` wrote it (waited for while its
    write goes on behind that task)."""

    file: str
    token: str

    def load(self, config: ConfigSchema, key: PartitionKey, empty: Empty = np.empty) -> Arrays:
        if writes_behind(self.file):
            wait_written(self.file, self.token)
        return read_partition_file(self.file, empty)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The model file (relation operators, global embeddings) of version `version` of the
    checkpoint in `path`; with `grow`, init_path's, grown to this run's relations."""

    path: str
    version: int
    grow: bool = False

    def load(self, config: ConfigSchema, num_relation_ids: int) -> ModelParams:
        checkpoint = CheckpointManager(self.path)
        arrays, optim_state = checkpoint.read_model(self.version)
        return params_from_checkpoint(config, num_relation_ids, arrays, optim_state,
                                      grow=self.grow,
                                      where=str(checkpoint.model_file(self.version)))


class WriterDied(RuntimeError):
    """A swap file's write never finished: the process writing it behind its task died
    after the task had returned. The partition's newest values are lost, so the pass is
    trained again from the last complete version, as when an actor dies."""


def written_marker(staged: str) -> Path:
    """The marker file of a local swap file: the lease's token, a newline, then 'pending
    <host> <pid>' while the task of that lease writes it, 'done' once written, 'failed'
    and the error if the write failed. (A leftover's name: '.', then '.tmp-'.)"""
    path = Path(staged)
    return path.with_name(f".written-{path.name}")


def asked_marker(staged: str) -> Path:
    """The file by which a reader waiting for a local swap file asks the process that
    holds the values of its lease unwritten (hand_over.HandOver: held for a task that
    Ray ran on another worker) to write them now: the lease's token. (A leftover's
    name: '.', then '.tmp-'.)"""
    path = Path(staged)
    return path.with_name(f".asked-{path.name}")


def _replace_text(path: Path, text: str) -> None:
    """Write `path` so that its readers see the whole text or what it held before (and
    two writers at once each the whole of one of theirs)."""
    scratch = path.with_name(f"{path.name}.tmp-mark-{os.getpid()}-{threading.get_ident()}")
    scratch.write_text(text)
    os.replace(scratch, path)


def writes_behind(staged: str) -> bool:
    """Whether a swap file is written behind its task: local files are; an upload to
    object storage is written before the task returns (readers elsewhere could not
    see a marker's writer)."""
    return not isinstance(storage_path(staged), ObjectPath)


def wait_written(staged: str, token: str, timeout: float = WRITE_WAIT_S) -> None:
    """Return once the write of lease `token` to the local swap file `staged` is done;
    raise its error if it failed, WriterDied if its writer died first. A write not begun
    yet (held for a task that runs elsewhere) is asked for (asked_marker)."""
    marker = written_marker(staged)
    deadline = time.monotonic() + timeout
    asked = False
    while True:
        try:
            text = marker.read_text()
        except FileNotFoundError:
            text = ""
        written, _, state = text.partition("\n")
        if written != token:  # no marker, or another lease's: this write never began
            raise WriterDied(f"swap file {staged} does not hold the values of lease {token}")
        if state == "done":
            return
        if state.startswith("failed "):
            raise PbgRayError(state[len("failed "):])
        _, host, pid = state.split()  # pending
        if host == socket.gethostname() and not _alive(int(pid)):
            raise WriterDied(f"the process writing swap file {staged} died before the "
                             "write was done")
        if time.monotonic() > deadline:
            raise WriterDied(f"the write of swap file {staged} did not finish in {timeout:.0f} s")
        if not asked:
            _replace_text(asked_marker(staged), token)
            asked = True
        time.sleep(0.002)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclasses.dataclass(frozen=True)
class SwapFile:
    """The lease by which a bucket's train task reads a partition from `source` and writes
    it to `staged`, a swap file that holds no partition's newest values. The partition
    store takes `staged` as the partition's newest values only once the task succeeded: a
    task that dies changed nothing. `token` is unique to the lease, so `written` names
    what this task writes."""

    source: PartitionSource
    staged: str
    token: str

    @property
    def written(self) -> SwapSource:
        """Where the values this task writes are, once written."""
        return SwapSource(self.staged, self.token)

    def load(self, config: ConfigSchema, key: PartitionKey, empty: Empty = np.empty) -> Arrays:
        return self.source.load(config, key, empty)

    def begin_write(self) -> None:
        """Mark the swap file as being written by this process, before its task returns
        and anyone may read it (see wait_written)."""
        self._mark(f"pending {socket.gethostname()} {os.getpid()}")

    def write(self, config: ConfigSchema, embs: np.ndarray, sums: np.ndarray,
              metadata: Dict[str, Any]) -> None:
        """embs [N, dim], sums [N], with the checkpoint's `metadata` (the file may become
        the partition's file of the next version as it is); over the swap file's own
        bytes, not fsync'ed (the store does that at the checkpoint). A local file's
        marker says when it is done (or failed)."""
        try:
            CheckpointManager.write_partition_file(
                self.staged, embs, row_adagrad_state(sums, config.lr), metadata, in_place=True)
        except Exception as err:
            if writes_behind(self.staged):
                self._mark(f"failed {err}")
            raise
        if writes_behind(self.staged):
            self._mark("done")

    def wait_written(self) -> None:
        """Return once this lease's write is done (see wait_written)."""
        if writes_behind(self.staged):
            wait_written(self.staged, self.token)

    def asked(self) -> bool:
        """Whether a reader waits for this lease's write (see asked_marker)."""
        try:
            return asked_marker(self.staged).read_text() == self.token
        except FileNotFoundError:
            return False

    def _mark(self, state: str) -> None:
        _replace_text(written_marker(self.staged), f"{self.token}\n{state}")
