"""A train task's worker's partitions between its tasks: writable copies in reused buffers,
and in disk placement the partitions kept for the trainer's next buckets, read ahead of
them and written behind their tasks (PartitionBuffer)."""

from __future__ import annotations

import functools
import math
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pbg_ray.checkpoints.sources import PartitionSource
from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import read_edges
from pbg_ray.model.params import PartitionKey
from pbg_ray.runtime.faults import fault_point
from pbg_ray.training.hand_over import HandOver
from pbg_ray.training.bucket_sources import SwapFile, SwapSource, writes_behind
from pbg_ray.types import EdgeList


def writable(partition: Tuple[np.ndarray, np.ndarray], empty: Callable[..., np.ndarray]
             ) -> Tuple[np.ndarray, np.ndarray]:
    """A writable copy of (embeddings, sums), in arrays from `empty(shape, dtype)`."""
    copies = tuple(empty(a.shape, a.dtype) for a in partition)
    for copy, a in zip(copies, partition):
        np.copyto(copy, a)
    return copies


class PartitionBuffer:
    """Writable copies of the partitions a train task receives (read-only views of the
    object store, or read from swap files), in buffers its worker process keeps for the
    next bucket: copied into fresh memory, every bucket's partitions page-fault again,
    which costs several times the copy itself. A task's results may be these buffers: Ray
    copies a task's returns into the object store before the worker runs its next task.

    An array of n dimensions is a view of a free buffer kept for arrays of n dimensions,
    the smallest large enough, or else one grown: partitions differ in size by a few
    rows, and a buffer per shape would keep a copy of nearly every partition.

    Disk placement, the worker's partition buffer: what a task wrote to a swap file stays
    in its buffers, held under the source it was written as (SwapFile.written), for the
    partitions its next buckets need soonest, ray.partition_buffer at most
    (scheduler.partitions_to_keep); a later task of this worker whose lease names that source
    starts from these arrays instead of reading the file. The files are written behind:
    by a thread of this worker, after the task has returned, so that the kernel of the
    next bucket does not wait for them (a task waits only for the write of a partition it
    trains itself, before changing it). The partitions of the trainer's next bucket that
    this one does not hold, and its edges, are read ahead, by another thread, while this
    bucket trains.

    A partition that the trainer's next bucket trains too, whose task is submitted to
    follow this one, is not written: it is held for that task, which trains it on where
    this one left it (see HandOver). With one trainer, so are the others its buffer keeps
    for its next buckets (write-back): each is written once the buffer drops it, when
    the trainer's pass ends, when a task on another worker asks for it, or
    HAND_OVER_WAIT_S after its task if no task of this worker took it by then."""

    def __init__(self, keep: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep = keep
        self.clock = clock  # what HandOver's wait is measured by (tests move it by hand)
        self.lock = threading.Lock()  # the reading thread takes buffers too
        self.free: Dict[int, List[np.ndarray]] = {}  # ndim -> buffers (bytes) nobody uses
        self.used: List[Tuple[int, np.ndarray]] = []  # (ndim, buffer) of this task or held
        # (key, written or read-ahead source) -> (partition or None, its write or read)
        self.held: Dict[Tuple[PartitionKey, PartitionSource], Tuple[Any, Optional[Future]]] = {}
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="partition-writer")
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="partition-reader")
        # (write, ndim, buffer) of partitions no longer held, whose writes may go on
        self.retiring: List[Tuple[Future, int, np.ndarray]] = []
        self.reads = 0  # partitions read from files, by tasks and ahead of them
        # The next bucket's edges, read while this one trains: (where, read) or None.
        self.edges_ahead: Optional[Tuple[Tuple[Any, ...], Future]] = None
        self.writes = 0  # partitions written to swap files (begun), by tasks and behind them
        self.late_writes = 0  # of those, held for a next task that did not come in time
        self.reported = (0, 0, 0)  # reads, writes and late writes counted in tasks' stats

    def __reduce__(self) -> Tuple[Any, ...]:
        """Ray ships a remote function by value with the globals it names: each worker
        gets an empty PartitionBuffer of its own (threads and locks don't pickle)."""
        return PartitionBuffer, (self.keep,)

    def _reclaim(self, wait: bool) -> None:
        """Free the buffers of retired partitions once written (all of them, waiting for
        their writes, with `wait`)."""
        retiring, self.retiring = self.retiring, []
        for pending, ndim, buf in retiring:
            if wait or pending.done():
                pending.result()
                self.free.setdefault(ndim, []).append(buf)
            else:
                self.retiring.append((pending, ndim, buf))

    def empty(self, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
        """An array to fill, of `shape` and `dtype`."""
        if not self.keep:
            return np.empty(shape, dtype)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        with self.lock:
            pool = self.free.setdefault(len(shape), [])
            if not any(b.nbytes >= nbytes for b in pool):
                self._reclaim(wait=True)
            buf = min((b for b in pool if b.nbytes >= nbytes), key=lambda b: b.nbytes, default=None)
            if buf is None and pool:  # none is: the largest grows
                buf = max(pool, key=lambda b: b.nbytes)
            if buf is not None:
                pool[:] = [b for b in pool if b is not buf]
            if buf is None or buf.nbytes < nbytes:
                buf = None  # a smaller one is freed before the larger one is made
                buf = np.empty(nbytes, np.uint8)
            self.used.append((len(shape), buf))
        return buf[:nbytes].view(dtype).reshape(shape)

    def load(self, config: ConfigSchema, key: PartitionKey, lease: SwapFile
             ) -> Tuple[np.ndarray, np.ndarray]:
        """The partition `lease` reads: held here (once its write is done: the task is about
        to change it), read ahead, or read now."""
        held = self.held.pop((key, lease.source), None) if lease.source.holdable else None
        if held is None:
            self.reads += 1
            return lease.load(config, key, self.empty)
        partition, pending = held
        if pending is not None and not (isinstance(pending, HandOver) and pending.take()):
            result = pending.result()  # a write's error is raised here
            partition = partition if result is None else result
        return partition

    def read_ahead(self, config: ConfigSchema,
                   wanted: Sequence[Tuple[PartitionKey, PartitionSource]],
                   on_read: Optional[Callable[[PartitionKey, Any], None]] = None) -> None:
        """Start reading the partitions of the next bucket that are not held, in the
        background; the next task takes them with `load`. `on_read(key, partition)` runs
        on the reading thread once a partition is read (a device buffer copies it on)."""
        for key, source in wanted:
            if source.holdable and (key, source) not in self.held:
                self.reads += 1
                self.held[key, source] = (None, self.reader.submit(
                    _read_ahead, config, key, source, self.empty, on_read))

    def read_edges_ahead(self, *where: Any) -> None:
        """Start reading the edges of read_edges(*where) in the background (the trainer's
        next bucket's while this one trains, or a task's own while it copies its
        partitions), unless they are being read; the task takes them with `edges`."""
        if self.edges_ahead is None or self.edges_ahead[0] != where:
            self.edges_ahead = (where, self.reader.submit(read_edges, *where))

    def edges(self, *where: Any) -> EdgeList:
        """read_edges(*where): the read read_edges_ahead began, or one now. (A read begun
        for another bucket is dropped there, its error nobody's.)"""
        ahead, self.edges_ahead = self.edges_ahead, None
        if ahead is not None and ahead[0] == where:
            return ahead[1].result()
        return read_edges(*where)

    def write_behind(self, config: ConfigSchema, key: PartitionKey, lease: "SwapFile",
                     partition: Tuple[np.ndarray, np.ndarray], metadata: Dict[str, Any],
                     hand_over: bool = False,
                     before_write: Optional[Callable[[], None]] = None) -> bool:
        """Write `partition` to its swap file: in the background where it is local (the
        file's marker says when it is done), at once on object storage; then hold it.
        With `hand_over` (the trainer's next task trains it too) a local one is held for
        that task instead, unwritten (see HandOver). `before_write` runs as the write
        begins, whenever that is (a device buffer copies its newer values in). Returns
        whether it is written."""
        begin = functools.partial(self._begin_write, config, lease, partition, metadata,
                                  before_write)
        if hand_over and self.keep and writes_behind(lease.staged):
            lease.begin_write()
            self.held[key, lease.written] = (
                partition, HandOver(begin, lease.asked, self.clock, self._count_late))
            return False
        if writes_behind(lease.staged):
            lease.begin_write()
            pending = begin()
        else:
            with self.lock:
                self.writes += 1
            if before_write is not None:
                before_write()
            lease.write(config, *partition, metadata)
            pending = None
        if self.keep:
            self.held[key, lease.written] = (partition, pending)
        elif pending is not None:
            pending.result()
        return True

    def _begin_write(self, config: ConfigSchema, lease: "SwapFile",
                     partition: Tuple[np.ndarray, np.ndarray], metadata: Dict[str, Any],
                     before_write: Optional[Callable[[], None]] = None) -> Future:
        """Begin writing `partition` to its local swap file on the writer thread."""
        with self.lock:  # HandOver's thread begins writes too
            self.writes += 1
        if before_write is not None:
            before_write()
        return self.writer.submit(_write_behind, config, lease, partition, metadata)

    def _count_late(self) -> None:
        with self.lock:
            self.late_writes += 1

    def take_io(self) -> Dict[str, int]:
        """Partition reads and writes begun since the last call (by a task, or behind it),
        and how many of those writes were a hand-over's whose wait ran out."""
        with self.lock:
            now = (self.reads, self.writes, self.late_writes)
        before, self.reported = self.reported, now
        return {name: n - m for name, n, m in zip(("reads", "writes", "late_writes"), now, before)}

    def write_held(self) -> None:
        """Begin the writes of the partitions held unwritten (HandOver): the trainer's pass
        ends, and its checkpoint waits for them."""
        for _, pending in self.held.values():
            if isinstance(pending, HandOver):
                pending.write()

    def next_task(self, keep: bool, parts: Optional[Collection[int]] = None,
                  leases: Optional[Dict[PartitionKey, PartitionSource]] = None,
                  write_back: bool = False) -> None:
        """Start over for the next task. Held partitions stay if their partition index is
        in `parts` (None: all) and, for a key in `leases` (the next task's, key -> the
        source it reads), if they are that source; those dropped free their buffers once
        written. With `keep` False nothing is kept, and the buffers are freed (an
        unpartitioned graph, one bucket a pass, would keep a copy of whole tables in an
        idle worker). Without `write_back` (several trainers) a partition held unwritten
        for a task other than this one is written now: that task runs elsewhere."""
        self.keep = keep
        leases = leases or {}
        writing: Dict[int, Future] = {}  # id of a dropped partition's buffer -> its write
        for (key, source), (partition, pending) in list(self.held.items()):
            dropped = (not keep or (parts is not None and key[1] not in parts)
                       or leases.get(key, source) != source
                       or (not isinstance(source, SwapSource) and key not in leases))  # for another
            if isinstance(pending, HandOver) and (
                    dropped or not (write_back or leases.get(key) == source)):
                pending.write()  # held unwritten no longer
            if dropped:
                del self.held[key, source]
                if partition is None:  # a read ahead that no task takes: its error is nobody's
                    futures.wait([pending])
                elif not keep:  # nothing is kept: wait for the write
                    if pending is not None:
                        pending.result()
                elif pending is not None:
                    writing.update((id(_owner(a)), pending) for a in partition)
        reserved = set()
        for (key, source), (partition, pending) in list(self.held.items()):
            if partition is None:  # being read: the buffers it takes are its own
                if pending.exception() is not None:  # the task that needs it reads it again
                    del self.held[key, source]
                    continue
                partition = pending.result()
            reserved.update(id(_owner(a)) for a in partition)
        with self.lock:
            used, self.used = self.used, []
            for ndim, buf in used:
                if id(buf) in reserved:
                    self.used.append((ndim, buf))
                elif id(buf) in writing:
                    self.retiring.append((writing[id(buf)], ndim, buf))
                elif keep:
                    self.free.setdefault(ndim, []).append(buf)
            self._reclaim(wait=not keep)
            if not keep:
                self.free.clear()


def _read_ahead(config: ConfigSchema, key: PartitionKey, source: PartitionSource,
                empty: Callable[..., np.ndarray],
                on_read: Optional[Callable[[PartitionKey, Any], None]]) -> Any:
    partition = source.load(config, key, empty)
    if on_read is not None:
        on_read(key, partition)
    return partition


def _write_behind(config: ConfigSchema, lease: SwapFile, partition: Tuple[np.ndarray, np.ndarray],
                  metadata: Dict[str, Any]) -> None:
    fault_point("train_task.write_behind")
    lease.write(config, *partition, metadata)


def _owner(array: np.ndarray) -> np.ndarray:
    """The array that owns `array`'s memory."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array
