"""One bucket's work as a Ray task: a thin wrapper around the model's kernel.

The driver imports this module for its remote functions and never runs the kernel, so
the kernel (and torch) load inside the functions that run it, in the task's worker.

The task reads its edge chunk itself, copies the partitions it received from
the object store once (they arrive read-only) or reads them from their swap
files (disk placement), evaluates the held-out edges, trains, evaluates again,
and returns the results as separate return values owned by the caller (or
writes them to new swap files). Nothing is applied inside the task, so the
bucket of a task that dies is simply trained again, with no update lost or
applied twice.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import (
    Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple, Union)

import numpy as np
import ray

from pbg_ray.checkpoints.storage import checkpoint_metadata
from pbg_ray.config import ConfigSchema
from pbg_ray.engine.faults import fault_point
from pbg_ray.engine.partitions import (
    OnDisk, Partition, PartitionKey, Source, SwapFile, resolved, writes_behind)
from pbg_ray.engine.scheduler import partitions_to_keep
from pbg_ray.evaluation.metrics import SampledNegatives, sampled_stats
from pbg_ray.incremental.growth import touches_new
from pbg_ray.io.edges import check_edges, read_edges
from pbg_ray.model.native import KERNEL_ENV, release_free_heap
from pbg_ray.model.params import KnownRows, ModelParams, partition_key
from pbg_ray.types import Bucket, EdgeList


def partition_keys(config: ConfigSchema, bucket: Bucket) -> List[PartitionKey]:
    """The (entity type, partition) pairs a bucket touches, lhs types first."""
    keys: List[PartitionKey] = []
    for side, part in (("lhs", bucket.lhs), ("rhs", bucket.rhs)):
        for rel in config.relations:
            key = partition_key(config, getattr(rel, side), part)
            if key not in keys:
                keys.append(key)
    return keys


def writable(partition: Tuple[np.ndarray, np.ndarray], empty: Callable[..., np.ndarray]
             ) -> Tuple[np.ndarray, np.ndarray]:
    """A writable copy of (embeddings, sums), in arrays from `empty(shape, dtype)`."""
    copies = tuple(empty(a.shape, a.dtype) for a in partition)
    for copy, a in zip(copies, partition):
        np.copyto(copy, a)
    return copies


def partition_counts(keys: List[PartitionKey], partitions: List[Tuple[np.ndarray, np.ndarray]]
                     ) -> Dict[str, Dict[int, int]]:
    """{entity: {part: number of entities}} of the partitions a task received."""
    counts: Dict[str, Dict[int, int]] = {}
    for (entity, part), (embs, _) in zip(keys, partitions):
        counts.setdefault(entity, {})[part] = len(embs)
    return counts


def gpus_per_trainer(config: ConfigSchema) -> float:
    """GPUs each train task asks for: ray.gpus_per_trainer, or one when PBG's
    num_gpus asks for GPU training without saying how to split them."""
    if config.ray.gpus_per_trainer > 0:
        return config.ray.gpus_per_trainer
    return 1.0 if config.num_gpus > 0 else 0.0


def task_threads(config: ConfigSchema) -> int:
    """The torch and BLAS threads of a task that asks for ray.cpus_per_trainer CPUs."""
    return max(1, int(config.ray.cpus_per_trainer))


def on_task_threads(task: Callable[..., Any]) -> Callable[..., Any]:
    """`task(config, ...)` run on task_threads(config) torch and BLAS threads. A worker
    process keeps the thread counts that its last task set, and the rounding of scores
    follows them (which decides a tie between a positive and a negative of the same
    entity): each task sets its own, so that its results depend on its config alone,
    not on what its worker ran before."""

    @functools.wraps(task)
    def run(config: ConfigSchema, *args: Any, **kwargs: Any) -> Any:
        from pbg_ray.model.blas import cpu_threads

        with cpu_threads(task_threads(config)):
            return task(config, *args, **kwargs)
    return run


def task_seed(config: ConfigSchema, iteration: int, bucket: Bucket) -> int:
    """The seed of a bucket's training and held-out evaluation in pass `iteration`, from
    the run's seed: a bucket trained again (its trainer died) draws the same."""
    sequence = np.random.SeedSequence([config.seed, iteration, bucket.lhs, bucket.rhs])
    return int(sequence.generate_state(1, np.uint64)[0])


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
    (disk placement, see Trainer._launch) once that bucket is trained (`before`). Buckets
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


def split_held_out(edges: EdgeList, fraction: float, seed: List[int]) -> Tuple[EdgeList, EdgeList]:
    """(held-out, train) edges. The held-out set depends only on `seed` (not the
    epoch), so held-out edges are never trained on in any epoch. (The kernel
    shuffles the train edges itself.)"""
    num_eval = int(len(edges) * fraction)
    if num_eval == 0:
        return edges[:0], edges
    perm = np.random.default_rng(seed).permutation(len(edges))
    return edges[perm[:num_eval]], edges[perm[num_eval:]]


class PartitionCopies:
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
        self.held: Dict[Tuple[PartitionKey, Source], Tuple[Any, Optional[Future]]] = {}
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="partition-writer")
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="partition-reader")
        # (write, ndim, buffer) of partitions no longer held, whose writes may go on
        self.retiring: List[Tuple[Future, int, np.ndarray]] = []
        self.reads = 0  # partitions read from files, by tasks and ahead of them
        # The next bucket's edges, read while this one trains: (where, read) or None.
        self.edges_ahead: Optional[Tuple[Tuple[Any, ...], Future]] = None
        self.writes = 0  # partitions written to swap files (begun), by tasks and behind them
        self.reported = (0, 0)  # reads and writes counted in tasks' stats

    def __reduce__(self) -> Tuple[Any, ...]:
        """Ray ships a remote function by value with the globals it names: each worker
        gets an empty PartitionCopies of its own (threads and locks don't pickle)."""
        return PartitionCopies, (self.keep,)

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

    def load(self, config: ConfigSchema, key: PartitionKey, lease: OnDisk
             ) -> Tuple[np.ndarray, np.ndarray]:
        """The partition of `lease`: held here (once its write is done: the task is about
        to change it), read ahead, or read now."""
        held = self.held.pop((key, lease.source), None) if holdable(lease.source) else None
        if held is None:
            self.reads += 1
            return lease.load(config, key, self.empty)
        partition, pending = held
        if pending is not None and not (isinstance(pending, HandOver) and pending.take()):
            result = pending.result()  # a write's error is raised here
            partition = partition if result is None else result
        return partition

    def read_ahead(self, config: ConfigSchema, wanted: Sequence[Tuple[PartitionKey, OnDisk]]
                   ) -> None:
        """Start reading the partitions of the next bucket that are not held, in the
        background; the next task takes them with `load`."""
        for key, lease in wanted:
            if holdable(lease.source) and (key, lease.source) not in self.held:
                self.reads += 1
                self.held[key, lease.source] = (
                    None, self.reader.submit(lease.load, config, key, self.empty))

    def read_edges_ahead(self, *where: Any) -> None:
        """Start reading the edges of read_edges(*where), the trainer's next bucket's, in
        the background; the next task takes them with `edges`."""
        self.edges_ahead = (where, self.reader.submit(read_edges, *where))

    def edges(self, *where: Any) -> EdgeList:
        """read_edges(*where): read ahead, or read now."""
        ahead, self.edges_ahead = self.edges_ahead, None
        if ahead is not None:
            if ahead[0] == where:
                return ahead[1].result()
            futures.wait([ahead[1]])  # another bucket's: its error is nobody's
        return read_edges(*where)

    def write_behind(self, config: ConfigSchema, key: PartitionKey, lease: "SwapFile",
                     partition: Tuple[np.ndarray, np.ndarray], metadata: Dict[str, Any],
                     hand_over: bool = False) -> bool:
        """Write `partition` to its swap file: in the background where it is local (the
        file's marker says when it is done), at once on object storage; then hold it.
        With `hand_over` (the trainer's next task trains it too) a local one is held for
        that task instead, unwritten (see HandOver). Returns whether it is written."""
        begin = functools.partial(self._begin_write, config, lease, partition, metadata)
        if hand_over and self.keep and writes_behind(lease.staged):
            lease.begin_write()
            self.held[key, lease.written] = (partition, HandOver(begin, lease.asked, self.clock))
            return False
        if writes_behind(lease.staged):
            lease.begin_write()
            pending = begin()
        else:
            with self.lock:
                self.writes += 1
            lease.write(config, *partition, metadata)
            pending = None
        if self.keep:
            self.held[key, lease.written] = (partition, pending)
        elif pending is not None:
            pending.result()
        return True

    def _begin_write(self, config: ConfigSchema, lease: "SwapFile",
                     partition: Tuple[np.ndarray, np.ndarray], metadata: Dict[str, Any]
                     ) -> Future:
        """Begin writing `partition` to its local swap file on the writer thread."""
        with self.lock:  # HandOver's thread begins writes too
            self.writes += 1
        return self.writer.submit(_write_behind, config, lease, partition, metadata)

    def take_io(self) -> Dict[str, int]:
        """Partition reads and writes begun since the last call (by a task, or behind it)."""
        (reads, writes), self.reported = self.reported, (self.reads, self.writes)
        return {"reads": self.reads - reads, "writes": self.writes - writes}

    def write_held(self) -> None:
        """Begin the writes of the partitions held unwritten (HandOver): the trainer's pass
        ends, and its checkpoint waits for them."""
        for _, pending in self.held.values():
            if isinstance(pending, HandOver):
                pending.write()

    def next_task(self, keep: bool, parts: Optional[Collection[int]] = None,
                  leases: Optional[Dict[PartitionKey, Source]] = None,
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
                       or (source[0] != "swap" and key not in leases))  # read for another
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


def _write_behind(config: ConfigSchema, lease: SwapFile, partition: Tuple[np.ndarray, np.ndarray],
                  metadata: Dict[str, Any]) -> None:
    fault_point("train_task.write_behind")
    lease.write(config, *partition, metadata)


# How long a partition held for a later task of the trainer (HandOver) waits for a task
# of this worker to take it before it is written anyway, and how often it looks whether
# a reader elsewhere asks for it (each look takes the GIL from the kernel's threads: see
# docs/benchmarks-log.md, disk placement).
HAND_OVER_WAIT_S = 2.0
HAND_OVER_POLL_S = 0.05


class HandOver:
    """The write of a partition held for a later task of the trainer, which trains it on
    from this worker's buffer: that task's lease names this one's swap file as its
    source, and its own result replaces it, so the file is written only if no task takes
    the partition here: when a reader elsewhere asks for it (Ray ran that task on another
    worker, see partitions.asked_marker), when the buffer drops it, when the trainer's
    pass ends, or after HAND_OVER_WAIT_S (no task came). Until then the file's marker
    says "pending" (see SwapFile.begin_write): a reader elsewhere asks and waits, and
    learns of this worker's death (WriterDied: the pass is trained again).

    Stands where PartitionCopies keeps a write's Future: `done` and `result` (which
    begins the write if it has not begun). `begin` begins the write, returning its
    Future; `asked` says whether a reader asks for it; `clock` measures the wait."""

    def __init__(self, begin: Callable[[], Future], asked: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.Lock()
        self.begin = begin
        self.pending: Optional[Future] = None  # the write, once begun
        self.taken = False
        self.settled = threading.Event()  # taken, or the write begun
        deadline = clock() + HAND_OVER_WAIT_S
        threading.Thread(target=self._watch, args=(asked, clock, deadline), daemon=True,
                         name="hand-over").start()

    def _watch(self, asked: Callable[[], bool], clock: Callable[[], float],
               deadline: float) -> None:
        while not self.settled.wait(HAND_OVER_POLL_S):
            if clock() > deadline or asked():
                self.write()

    def take(self) -> bool:
        """The next task takes the partition: True unless its write has begun (then wait
        for it with `result`)."""
        with self.lock:
            if self.pending is None:
                self.taken = True
                self.settled.set()
            return self.taken

    def write(self) -> None:
        """Begin the write, unless it has begun or the partition was taken."""
        with self.lock:
            if not self.taken and self.pending is None:
                self.settled.set()
                self.pending = self.begin()

    def done(self) -> bool:
        return self.taken or (self.pending is not None and self.pending.done())

    def result(self) -> None:
        self.write()
        if self.pending is not None:
            self.pending.result()


def holdable(source: Source) -> bool:
    """Whether a worker may hold a partition under `source`: a swap file's lease (unique),
    a checkpoint version's file or a seeded start, but no source that names arrays."""
    return source[0] in ("swap", "checkpoint", "random")


def _owner(array: np.ndarray) -> np.ndarray:
    """The array that owns `array`'s memory."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


# This worker process's buffers (train tasks of one worker run one at a time).
_COPIES = PartitionCopies()


def run_bucket(config: ConfigSchema, bucket: Bucket, edge_path: str, chunk_idx: int,
               num_chunks: int, iteration: int, num_relation_ids: int, keys: List[PartitionKey],
               params: ModelParams,
               partitions: List[Union[Tuple[np.ndarray, np.ndarray], SwapFile]],
               deltas: List[bool], num_threads: int, device: str,
               known: Optional[KnownRows] = None, warmup_s: float = 0.0,
               copies: Optional[PartitionCopies] = None,
               read_ahead: Sequence[Tuple[PartitionKey, OnDisk]] = (),
               write_order: Sequence[int] = (),
               hand_over: Collection[PartitionKey] = (),
               following: Optional[Bucket] = None) -> Tuple[Any, ...]:
    """The pure part of the task. `partitions`: per key its (embeddings, sums), or the
    SwapFile to read them from and write them to (disk placement). Returns (stats,
    params delta, one result per key): the new (embeddings, sums), their change where
    `deltas` says so (partitions other buckets train at the same time), or the SwapFile,
    whose write may still go on (see PartitionCopies). `known`: what init_path trained
    (incremental runs), trained at its own learning rate. `warmup_s`: the Hogwild
    warm-up (HogwildWarmUp) the driver decided for the bucket. `copies` gives the arrays the
    partitions are trained in (and holds those written to swap files, see
    PartitionCopies); `read_ahead` the partitions of the trainer's next bucket that it
    reads while this one trains; `write_order` the partition indices to write first (the
    next bucket's: its task waits for them; none: no bucket follows in the trainer's
    pass, and what the worker holds unwritten is written now); `hand_over` those held
    unwritten for a later task of the trainer, which trains them too (see HandOver);
    `following` the trainer's next bucket, whose edges are read while this one trains."""
    from pbg_ray.model.kernel import evaluate_bucket, train_bucket

    t_start = time.perf_counter()
    copies = copies if copies is not None else PartitionCopies(keep=False)
    edges = copies.edges(edge_path, bucket, chunk_idx, num_chunks)

    def load(key: PartitionKey, p: Union[Tuple[np.ndarray, np.ndarray], SwapFile]
             ) -> Tuple[np.ndarray, np.ndarray]:
        if not isinstance(p, SwapFile):
            return writable(p, copies.empty)
        return copies.load(config, key, p)

    arrays = {key: load(key, p) for key, p in zip(keys, partitions)}
    fault_point("train_task.after_read")
    copies.read_ahead(config, read_ahead)
    if following is not None:
        copies.read_edges_ahead(edge_path, following, chunk_idx, num_chunks)
    counts = partition_counts(keys, [arrays[key] for key in keys])
    check_edges(edges, bucket, config, counts, num_relation_ids,
                f"edge file {edge_path}/edges_{bucket.lhs}_{bucket.rhs}.h5 (chunk {chunk_idx})")
    if known is not None and config.incremental.new_entity_edges_only:
        edges = edges[np.flatnonzero(touches_new(config, bucket, edges, known))]
    held_out, train_edges = split_held_out(
        edges, config.eval_fraction, [config.seed, bucket.lhs, bucket.rhs, chunk_idx])
    local = ModelParams({k: v.copy() for k, v in params.arrays.items()},
                        {k: v.copy() for k, v in params.sums.items()})
    t_ready = time.perf_counter()

    stats: Dict[str, Any] = {}
    seed = task_seed(config, iteration, bucket)
    negatives = SampledNegatives.of_held_out(config)
    held_out_negs = {"num_batch_negs": negatives.batch, "num_uniform_negs": negatives.uniform}
    if len(held_out):
        stats["eval_stats_before"] = evaluate_bucket(config, bucket, held_out, arrays, local,
                                                     seed=seed, **held_out_negs)
    train_stats = train_bucket(config, bucket, train_edges, arrays, local,
                               num_threads=num_threads, device=device, seed=seed,
                               warmup_s=warmup_s,
                               known=known)
    if len(held_out):
        stats["eval_stats_after"] = evaluate_bucket(config, bucket, held_out, arrays, local,
                                                    seed=seed, **held_out_negs)
    t_trained = time.perf_counter()

    results: List[Any] = []
    swapped = [(key, p) for key, p in zip(keys, partitions) if isinstance(p, SwapFile)]
    metadata = checkpoint_metadata(config, iteration, num_chunks) if swapped else {}
    first = {part: i for i, part in enumerate(write_order)}
    for key, p in sorted(swapped, key=lambda kp: first.get(kp[0][1], len(first))):
        copies.write_behind(config, key, p, arrays[key], metadata, key in hand_over)
    if not write_order:  # no bucket follows in the trainer's pass to take what is held
        copies.write_held()
    for key, is_delta, p in zip(keys, deltas, partitions):
        new_embs, new_sums = arrays[key]
        if isinstance(p, SwapFile):
            results.append(p)
        else:
            results.append((new_embs - p[0], new_sums - p[1]) if is_delta else (new_embs, new_sums))
    delta = ModelParams({k: local.arrays[k] - params.arrays[k] for k in params.arrays},
                        {k: local.sums[k] - params.sums[k] for k in params.sums})
    t_end = time.perf_counter()
    stats["stats"] = {"count": train_stats["count"], "metrics": train_stats["metrics"]}
    stats["timing"] = {"total_s": t_end - t_start, "kernel_s": t_trained - t_ready,
                       "outside_kernel_s": (t_ready - t_start) + (t_end - t_trained),
                       "warmup_s": warmup_s}
    if swapped:
        stats["partition_io"] = copies.take_io()
    fault_point("train_task.before_return")
    return (stats, delta, *results)


# Every task that reads partitions or runs the kernel (train, eval, export, predict) starts
# in one kind of worker, with the kernel's malloc settings (glibc reads them at start). Ray
# keeps an idle pool per runtime_env, at most a worker per CPU in all: tasks of a second
# kind would push these workers out, and each new worker imports torch again.
TASK_RUNTIME_ENV = {"env_vars": KERNEL_ENV}


@ray.remote(runtime_env=TASK_RUNTIME_ENV)
def start_trainer_worker() -> None:
    """Import the kernel in a train task's kind of worker: launched while the actors
    initialise, so that the first bucket does not wait seconds for a worker process to
    start and import torch. (Ray ships remote functions by value: a worker imports a
    module only when a function it runs imports it or names one of its globals, so an
    empty body would start the process and import nothing.)"""
    import pbg_ray.model.kernel  # noqa: F401


# No automatic retries: the driver hands a dead trainer's bucket out again
# through the scheduler, with the partitions' current refs.
@ray.remote(max_retries=0, runtime_env=TASK_RUNTIME_ENV)
@release_free_heap
@on_task_threads
def train_bucket_task(config: ConfigSchema, bucket: Bucket, edge_path: str, chunk_idx: int,
                      num_chunks: int, iteration: int, num_relation_ids: int,
                      keys: List[PartitionKey], deltas: List[bool], params: ModelParams,
                      *partitions: Union[Tuple[np.ndarray, np.ndarray], SwapFile],
                      known: Optional[KnownRows] = None, warmup_s: float = 0.0,
                      read_ahead: Sequence[Tuple[PartitionKey, OnDisk]] = (),
                      next_use: Sequence[int] = (),
                      previous_delta: Optional[ModelParams] = None,
                      hand_over: Collection[PartitionKey] = (),
                      write_back: Optional[Collection[int]] = None,
                      following: Optional[Bucket] = None) -> Tuple[Any, ...]:
    """Ray resolves `params` and `partitions` from ObjectRefs (zero-copy numpy); a
    SwapFile (disk placement) comes as itself. `warmup_s`: the bucket's Hogwild warm-up
    (HogwildWarmUp). Disk placement: `read_ahead` the next
    bucket's partitions this one lacks; `next_use` the partition indices the trainer's
    next buckets need, in the order they first need them (the worker keeps
    ray.partition_buffer partitions by it, see PartitionCopies). `previous_delta`: the
    params delta of the trainer's previous bucket, submitted before it (this task then
    starts once that one has succeeded): `params` lack it, as that update was not sent yet.
    `hand_over`: the partitions held for the trainer's next task instead of written.
    `write_back`: the partition indices of the trainer's next bucket, when all its next
    buckets run on this worker (one trainer): the partitions the buffer keeps for them
    are held unwritten too, each written once the buffer drops it (see PartitionCopies).
    `following`: the trainer's next bucket, whose edges this task reads ahead."""
    num_threads = task_threads(config)
    device = "cuda" if gpus_per_trainer(config) > 0 else "cpu"
    start = time.time()
    if previous_delta is not None:
        params = ModelParams(
            {k: v + previous_delta.arrays[k] for k, v in params.arrays.items()},
            {k: v + previous_delta.sums[k] for k, v in params.sums.items()})
    leases = {key: p.source for key, p in zip(keys, partitions) if isinstance(p, SwapFile)}
    held = {key[1] for key, _ in _COPIES.held}
    _COPIES.next_task(keep=config.num_partitions() > 1, leases=leases, parts=partitions_to_keep(
        held, {key[1] for key in leases}, next_use, config.ray.partition_buffer),
        write_back=write_back is not None)
    if write_back is not None:  # what the next task's next_task above will keep
        after = {key[1] for key, _ in _COPIES.held} | {key[1] for key in leases} | {
            key[1] for key, _ in read_ahead}
        kept = partitions_to_keep(after, write_back, next_use, config.ray.partition_buffer)
        hand_over = {*hand_over, *(key for key in leases if key[1] in kept)}
    stats, *results = run_bucket(config, bucket, edge_path, chunk_idx, num_chunks, iteration,
                                 num_relation_ids, keys, params, list(partitions), deltas,
                                 num_threads, device, known, warmup_s, copies=_COPIES,
                                 read_ahead=read_ahead, write_order=next_use,
                                 hand_over=hand_over, following=following)
    stats["worker"] = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                       "start": start, "end": time.time()}
    return (stats, *results)


@ray.remote(runtime_env=TASK_RUNTIME_ENV)
@release_free_heap
@on_task_threads
def evaluate_bucket_task(config: ConfigSchema, bucket: Bucket, edge_path: str,
                         num_relation_ids: int, keys: List[PartitionKey], params: ModelParams,
                         *partitions: Partition, negatives: SampledNegatives,
                         per_relation: bool = False, seed: int = 0
                         ) -> Dict[Any, Dict[str, Any]]:
    """PBG's sampled metrics of every edge of one bucket of `edge_path` against
    `negatives` (no update): {ALL: stats} and, with per_relation, {relation id: stats}
    (evaluation.metrics)."""
    edges = read_edges(edge_path, bucket)
    partitions = resolved(config, keys, partitions)
    counts = partition_counts(keys, partitions)
    check_edges(edges, bucket, config, counts, num_relation_ids,
                f"edge file {edge_path}/edges_{bucket.lhs}_{bucket.rhs}.h5")
    return sampled_stats(config, bucket, edges, dict(zip(keys, partitions)), params,
                         negatives=negatives, per_relation=per_relation, seed=seed)
