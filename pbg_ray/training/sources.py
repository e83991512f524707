"""Where an entity partition's values come from, and in disk placement how a task reads
them itself (OnDisk) and where a train task writes them back (SwapFile), in the
background after the task has returned (write-behind, with a marker file saying when
the write is done)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import numpy as np

from pbg_ray.checkpoints.directory import row_adagrad_state, row_adagrad_sums
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.incremental.growth import grow_partition
from pbg_ray.io.storage import ObjectPath, storage_path
from pbg_ray.model.params import init_partition

PartitionKey = Tuple[str, int]
# Where a partition's values come from: ("checkpoint", path, version), ("init", path,
# version, count, new rows [count - init's rows, dim] or None: the partition grown to
# count rows, see incremental.growth), ("random", count, seed) or ("swap", file, token):
# a SwapFile's file as the task of that lease wrote it.
Source = Tuple[Any, ...]
# How long a reader waits for a swap file's write-behind to finish.
WRITE_WAIT_S = 600.0


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
    holds the values of its lease unwritten (bucket_task.HandOver: held for a task that
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
        if writes_behind(where):
            wait_written(where, source[2])
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
