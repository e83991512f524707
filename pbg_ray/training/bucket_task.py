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

What crosses the process boundary is typed: the driver sends a BucketWork (and in disk
placement a DiskPlan) with the parameters and partitions, and reads the task's returns
by name (BucketRefs: a BucketStats, the parameters' delta, the gradients of the rows drawn
from beyond the bucket, a result per partition).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import numpy as np
import ray

from pbg_ray.checkpoints.directory import checkpoint_metadata
from pbg_ray.checkpoints.position import Position
from pbg_ray.checkpoints.sources import PartitionSource
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.metrics import SampledNegatives, average
from pbg_ray.incremental.growth import touches_new
from pbg_ray.io.edges import check_edges
from pbg_ray.model.native import release_free_heap
from pbg_ray.model.beyond import BeyondBucket, RowGradients
from pbg_ray.model.params import (
    KnownRows, ModelParams, PartitionKey, known_rows, partition_counts)
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import TASK_RUNTIME_ENV, on_task_threads, task_threads
from pbg_ray.training.scheduler import partitions_to_keep
from pbg_ray.training.device_buffer import DeviceBuffer
from pbg_ray.training.partition_buffer import PartitionBuffer, writable
from pbg_ray.training.bucket_sources import SwapFile
from pbg_ray.types import Bucket, EdgeList


def gpus_per_trainer(config: ConfigSchema) -> float:
    """GPUs each train task asks for: ray.gpus_per_trainer, or one when PBG's
    num_gpus asks for GPU training without saying how to split them."""
    if config.ray.gpus_per_trainer > 0:
        return config.ray.gpus_per_trainer
    return 1.0 if config.num_gpus > 0 else 0.0


def task_seed(config: ConfigSchema, iteration: int, bucket: Bucket) -> int:
    """The seed of a bucket's training and held-out evaluation in pass `iteration`, from
    the run's seed: a bucket trained again (its trainer died) draws the same."""
    sequence = np.random.SeedSequence([config.seed, iteration, bucket.lhs, bucket.rhs])
    return int(sequence.generate_state(1, np.uint64)[0])


def split_held_out(edges: EdgeList, fraction: float, seed: List[int]) -> Tuple[EdgeList, EdgeList]:
    """(held-out, train) edges. The held-out set depends only on `seed` (not the
    epoch), so held-out edges are never trained on in any epoch. (The kernel
    shuffles the train edges itself.)"""
    num_eval = int(len(edges) * fraction)
    if num_eval == 0:
        return edges[:0], edges
    perm = np.random.default_rng(seed).permutation(len(edges))
    return edges[perm[:num_eval]], edges[perm[num_eval:]]


@dataclass(frozen=True)
class BucketWork:
    """What a train task trains: one bucket's edge chunk in the pass at `position`, with
    its partitions' `keys` (lhs side first) and per key whether its change comes back
    instead of its values (`deltas`: partitions other buckets train at the same time)."""

    bucket: Bucket
    edge_path: str
    position: Position
    num_relation_ids: int
    keys: Tuple[PartitionKey, ...]
    deltas: Tuple[bool, ...]
    warmup_s: float = 0.0  # the Hogwild warm-up (HogwildWarmUp) the driver decided
    following: Optional[Bucket] = None  # the trainer's next bucket: its edges are read ahead
    # Per key: the version of the values the task receives and of its result once applied
    # (None: unknown, or a delta), by which a device-step worker keeps partitions on its
    # device (training.device_buffer).
    versions: Tuple[Optional[str], ...] = ()
    results: Tuple[Optional[str], ...] = ()

    @property
    def where(self) -> str:
        """The edge file and chunk, for messages."""
        return (f"edge file {self.edge_path}/edges_{self.bucket.lhs}_{self.bucket.rhs}.h5 "
                f"(chunk {self.position.edge_chunk_idx})")

    @property
    def chunk(self) -> Tuple[int, int]:
        """(edge chunk, number of chunks) of the edge file."""
        return self.position.edge_chunk_idx, self.position.num_edge_chunks


@dataclass(frozen=True)
class DiskPlan:
    """Disk placement: what a train task does with partitions besides its own (see
    PartitionBuffer). `read_ahead`: the partitions of the trainer's next bucket that this
    one lacks, read while it trains; `next_use`: the partition indices the trainer's next
    buckets need, in the order they first need them (the buffer keeps
    ray.partition_buffer of them by it, and its partitions are written in that order;
    none: no bucket follows in the pass, and what the worker holds unwritten is written
    now); `hand_over`: the partitions held unwritten for the trainer's next task (see
    HandOver); `write_back`: with one trainer, whose next buckets all run on this worker,
    the partition indices of the next bucket: what the buffer keeps for them is held
    unwritten too, each written once the buffer drops it."""

    read_ahead: Tuple[Tuple[PartitionKey, PartitionSource], ...] = ()
    next_use: Tuple[int, ...] = ()
    hand_over: FrozenSet[PartitionKey] = frozenset()
    write_back: Optional[Tuple[int, ...]] = None
    ahead_versions: Tuple[Optional[str], ...] = ()  # the versions read_ahead's partitions are


@dataclass
class TaskTiming:
    """Where a train task's time went (seconds); the driver adds the bucket's wall time."""

    total_s: float
    kernel_s: float
    outside_kernel_s: float
    warmup_s: float
    bucket_wall_s: Optional[float] = None
    # Within kernel_s: copying partitions, parameters and edges to the device and back
    # (the device step; 0 for the CPU kernel).
    device_copy_s: float = 0.0


@dataclass(frozen=True)
class TaskWorker:
    """The process that ran a train task, and when."""

    node_id: str
    pid: int
    start: float
    end: float


@dataclass
class BucketStats:
    """A train task's report: its training stats (PBG's count and metric sums) and those of
    its held-out edges before and after training (eval_fraction), its timing, and in disk
    placement its partition reads and writes."""

    train: Dict[str, Any]
    timing: TaskTiming
    eval_before: Optional[Dict[str, Any]] = None
    eval_after: Optional[Dict[str, Any]] = None
    partition_io: Dict[str, int] = field(default_factory=dict)
    worker: Optional[TaskWorker] = None
    # The device step: partitions' copies and bytes to and from the device (DeviceBuffer).
    device_io: Dict[str, int] = field(default_factory=dict)

    def line(self) -> Dict[str, Any]:
        """Its part of the bucket's training_stats.json line (PBG's keys; stats as per-edge
        means, as PBG writes them)."""
        line: Dict[str, Any] = {"stats": average(self.train)}
        for key, value in (("eval_stats_before", self.eval_before),
                           ("eval_stats_after", self.eval_after)):
            if value is not None:
                line[key] = average(value)
        line["timing"] = dataclasses.asdict(self.timing)
        if self.partition_io:
            line["partition_io"] = dict(self.partition_io)
        if self.device_io:
            line["device_io"] = dict(self.device_io)
        if self.worker is not None:
            line["worker"] = dataclasses.asdict(self.worker)
        return line


# What a train task receives for a partition (memory placement: its values; disk: the
# SwapFile to read them from and write them to), and returns for it (the new values or
# their change, or the SwapFile, whose write may still go on).
PartitionArg = Union[Tuple[np.ndarray, np.ndarray], SwapFile]

# This worker process's buffers (train tasks of one worker run one at a time).
_BUFFER = PartitionBuffer()
_DEVICE_BUFFER = DeviceBuffer()


def uses_device_step(config: ConfigSchema) -> bool:
    """Whether train tasks run the device step (model.device_step): on GPUs, or with
    ray.device_step."""
    return gpus_per_trainer(config) > 0 or config.ray.device_step


def run_bucket(config: ConfigSchema, work: BucketWork, params: ModelParams,
               partitions: Sequence[PartitionArg], num_threads: int, device: str,
               known: Optional[KnownRows] = None, copies: Optional[PartitionBuffer] = None,
               disk: DiskPlan = DiskPlan(), on_device: Optional[DeviceBuffer] = None,
               beyond: Optional[Dict[str, BeyondBucket]] = None,
               pending: Optional[Dict[PartitionKey, Tuple[RowGradients, ...]]] = None
               ) -> Tuple[Any, ...]:
    """The pure part of the task: (BucketStats, params delta, the gradients of the rows
    drawn by `beyond` per partition, one result per key of `work`, see PartitionArg).
    `known`: what init_path trained (incremental runs), trained at its own learning rate.
    `copies` gives the arrays the partitions are trained in (and holds those written to
    swap files, see PartitionBuffer). With `on_device` the bucket trains by the device
    step on `device`, from and into that buffer's partitions. `beyond`: per entity type,
    its rows drawn as negatives from beyond the bucket; `pending`: per key, gradients of
    its rows drawn by earlier buckets, applied before this one trains it."""
    t_start = time.perf_counter()
    copies = copies if copies is not None else PartitionBuffer(keep=False)
    arrays, edges = _read(config, work, partitions, copies, disk, known, on_device)
    for key, drawn in (pending or {}).items():
        for gradients in drawn:
            gradients.apply(*arrays[key], config.lr, *known_rows(known, key))
    held_out, train_edges = split_held_out(
        edges, config.eval_fraction,
        [config.seed, work.bucket.lhs, work.bucket.rhs, work.position.edge_chunk_idx])
    local = ModelParams({k: v.copy() for k, v in params.arrays.items()},
                        {k: v.copy() for k, v in params.sums.items()})
    t_ready = time.perf_counter()
    if on_device is None:
        trained, copy_s, before, after, drawn = _train(
            config, work, held_out, train_edges, arrays, local, num_threads, known, beyond)
    else:
        drawn = {}
        trained, copy_s, before, after = _train_on_device(
            config, work, held_out, train_edges, arrays, partitions, local, device, known,
            on_device, disk)
    t_trained = time.perf_counter()
    results = _results(config, work, partitions, arrays, copies, disk, on_device)
    delta = ModelParams({k: local.arrays[k] - params.arrays[k] for k in params.arrays},
                        {k: local.sums[k] - params.sums[k] for k in params.sums})
    t_end = time.perf_counter()
    timing = TaskTiming(total_s=t_end - t_start, kernel_s=t_trained - t_ready,
                        outside_kernel_s=(t_ready - t_start) + (t_end - t_trained),
                        warmup_s=work.warmup_s, device_copy_s=copy_s)
    swapped = any(isinstance(p, SwapFile) for p in partitions)
    stats = BucketStats(trained, timing, before, after,
                        partition_io=copies.take_io() if swapped else {},
                        device_io=on_device.take_io() if on_device is not None else {})
    fault_point("train_task.before_return")
    return (stats, delta, drawn, *results)


def _read(config: ConfigSchema, work: BucketWork, partitions: Sequence[PartitionArg],
          copies: PartitionBuffer, disk: DiskPlan, known: Optional[KnownRows],
          on_device: Optional[DeviceBuffer] = None
          ) -> Tuple[Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]], EdgeList]:
    """The bucket's partitions, writable, and its edges, checked (only those touching new
    entities where the incremental config says so); what the next bucket needs is read
    ahead meanwhile (and copied on to the device, with `on_device`)."""
    # The edges are read (unless read ahead already) while the partitions are copied.
    copies.read_edges_ahead(work.edge_path, work.bucket, *work.chunk)
    arrays = {key: copies.load(config, key, p) if isinstance(p, SwapFile)
              else writable(p, copies.empty) for key, p in zip(work.keys, partitions)}
    edges = copies.edges(work.edge_path, work.bucket, *work.chunk)
    fault_point("train_task.after_read")
    on_read = None
    if on_device is not None and disk.ahead_versions:
        versions = dict(zip([k for k, _ in disk.read_ahead], disk.ahead_versions))
        on_read = lambda key, partition: on_device.ahead(key, versions[key], partition)  # noqa: E731
    copies.read_ahead(config, disk.read_ahead, on_read)
    if work.following is not None:
        copies.read_edges_ahead(work.edge_path, work.following, *work.chunk)
    counts = partition_counts(list(work.keys), [arrays[key] for key in work.keys])
    check_edges(edges, work.bucket, config, counts, work.num_relation_ids, work.where)
    if known is not None and config.incremental.new_entity_edges_only:
        edges = edges[np.flatnonzero(touches_new(config, work.bucket, edges, known))]
    return arrays, edges


def _held_out_stats(config: ConfigSchema, work: BucketWork, held_out: EdgeList,
                    arrays: Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]],
                    local: ModelParams) -> Optional[Dict[str, Any]]:
    """PBG's sampled ranking of the bucket's held-out edges on `arrays` (None without
    any), against eval_fraction's negatives, from the bucket's seed."""
    from pbg_ray.model.kernel import evaluate_bucket

    if not len(held_out):
        return None
    negatives = SampledNegatives.of_held_out(config)
    return evaluate_bucket(config, work.bucket, held_out, arrays, local,
                           seed=task_seed(config, work.position.iteration, work.bucket),
                           num_batch_negs=negatives.batch, num_uniform_negs=negatives.uniform)


def _train(config: ConfigSchema, work: BucketWork, held_out: EdgeList, train_edges: EdgeList,
           arrays: Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]], local: ModelParams,
           num_threads: int, known: Optional[KnownRows],
           beyond: Optional[Dict[str, BeyondBucket]]) -> Tuple[Any, ...]:
    """Train the bucket's edges in place by the CPU kernel: (training stats, 0 seconds of
    device copies, the held-out edges' before and after, None without held-out edges,
    the gradients of the rows drawn by `beyond`, see train_bucket)."""
    from pbg_ray.model.kernel import train_bucket

    before = _held_out_stats(config, work, held_out, arrays, local)
    trained = train_bucket(config, work.bucket, train_edges, arrays, local,
                           num_threads=num_threads,
                           seed=task_seed(config, work.position.iteration, work.bucket),
                           warmup_s=work.warmup_s, known=known, beyond=beyond)
    return ({"count": trained["count"], "metrics": trained["metrics"]}, 0.0, before,
            _held_out_stats(config, work, held_out, arrays, local), trained["drawn"])


def _results(config: ConfigSchema, work: BucketWork, partitions: Sequence[PartitionArg],
             arrays: Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]],
             copies: PartitionBuffer, disk: DiskPlan,
             on_device: Optional[DeviceBuffer] = None) -> List[PartitionArg]:
    """Per key what the task returns (see PartitionArg); the swap files are written
    behind the task, the next bucket's partitions first (each once the device's newer
    values, if any, are copied into it)."""
    swapped = [(key, p) for key, p in zip(work.keys, partitions) if isinstance(p, SwapFile)]
    metadata = checkpoint_metadata(config, work.position) if swapped else {}
    first = {part: i for i, part in enumerate(disk.next_use)}
    for key, p in sorted(swapped, key=lambda kp: first.get(kp[0][1], len(first))):
        before_write = None if on_device is None else functools.partial(
            on_device.copy_back, arrays[key])
        copies.write_behind(config, key, p, arrays[key], metadata, key in disk.hand_over,
                            before_write)
    if not disk.next_use:  # no bucket follows in the trainer's pass to take what is held
        copies.write_held()
    results: List[PartitionArg] = []
    for key, is_delta, p in zip(work.keys, work.deltas, partitions):
        new_embs, new_sums = arrays[key]
        if isinstance(p, SwapFile):
            results.append(p)
        else:
            results.append((new_embs - p[0], new_sums - p[1]) if is_delta else (new_embs, new_sums))
    return results


def _train_on_device(config: ConfigSchema, work: BucketWork, held_out: EdgeList,
                     train_edges: EdgeList,
                     arrays: Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]],
                     partitions: Sequence[PartitionArg], local: ModelParams, device: str,
                     known: Optional[KnownRows], on_device: DeviceBuffer, disk: DiskPlan
                     ) -> Tuple[Any, ...]:
    """_train by the device step: the partitions from the device buffer (copied there
    where it lacks them), the bucket trained there, each copied back to its arrays at
    once where the task returns them or evaluates held-out edges, else when its swap file
    is written (the buffer's copy_back)."""
    import torch

    from pbg_ray.model.device_step import BucketTrainer, DeviceParams, DeviceTables, read_back
    from pbg_ray.training.device_buffer import capacity, keys_by_next_use

    dev = torch.device(device)
    on_device.start(dev)
    seed = task_seed(config, work.position.iteration, work.bucket)
    if len(held_out):  # evaluated from the host arrays: the device's newer values first
        for key in work.keys:
            on_device.copy_back(arrays[key])
    before = _held_out_stats(config, work, held_out, arrays, local)
    start = _synchronized(dev)
    tables_of = on_device.partitions(work.keys, work.versions or (None,) * len(work.keys),
                                     arrays)
    tables = DeviceTables.join(tables_of)
    shared = DeviceParams(config, local, dev)
    copy_s = _synchronized(dev) - start
    stats = BucketTrainer(config, work.bucket, tables, shared, known,
                          config.ray.cuda_graphs and dev.type == "cuda").train(train_edges, seed)
    copy_start = _synchronized(dev)
    metrics = read_back(stats, shared, local)
    tables.split(tables_of)
    now = [is_delta or not isinstance(p, SwapFile) or len(held_out) > 0
           for is_delta, p in zip(work.deltas, partitions)]
    on_device.trained(work.keys, work.results or (None,) * len(work.keys), arrays, now)
    room = capacity(config, dev, max(e.nbytes + s.nbytes for e, s in arrays.values()))
    on_device.keep(None if room is None else max(len(work.keys), room),
                   keys_by_next_use(config, disk.next_use, work.keys))
    copy_s += _synchronized(dev) - copy_start
    return ({"count": len(train_edges), "metrics": metrics}, copy_s, before,
            _held_out_stats(config, work, held_out, arrays, local))


def _synchronized(device: Any) -> float:
    """time.perf_counter() once the device's queued work is done (a GPU runs behind)."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
def train_bucket_task(config: ConfigSchema, work: BucketWork, params: ModelParams,
                      *partitions: PartitionArg, known: Optional[KnownRows] = None,
                      disk: DiskPlan = DiskPlan(),
                      previous_delta: Optional[ModelParams] = None,
                      beyond: Optional[Dict[str, BeyondBucket]] = None,
                      pending: Optional[Dict[PartitionKey, Tuple[RowGradients, ...]]] = None
                      ) -> Tuple[Any, ...]:
    """run_bucket in a worker: its returns, each a return of the task (BucketRefs). Ray
    resolves `params` and `partitions` from ObjectRefs (zero-copy numpy); a SwapFile (disk
    placement) comes as itself. `previous_delta`: the params delta of the trainer's
    previous bucket, submitted before it (this task then starts once that one has
    succeeded): `params` lack it, as that update was not sent yet. `beyond`, `pending`:
    see run_bucket."""
    start = time.time()
    if previous_delta is not None:
        params = ModelParams(
            {k: v + previous_delta.arrays[k] for k, v in params.arrays.items()},
            {k: v + previous_delta.sums[k] for k, v in params.sums.items()})
    disk = _plan_buffer(config, work, partitions, disk, _BUFFER)
    device = "cuda" if gpus_per_trainer(config) > 0 else "cpu"
    stats, *results = run_bucket(config, work, params, partitions, task_threads(config),
                                 device, known, copies=_BUFFER, disk=disk,
                                 on_device=_DEVICE_BUFFER if uses_device_step(config) else None,
                                 beyond=beyond, pending=pending)
    stats.worker = TaskWorker(ray.get_runtime_context().get_node_id(), os.getpid(), start,
                              time.time())
    return (stats, *results)


def _plan_buffer(config: ConfigSchema, work: BucketWork, partitions: Sequence[PartitionArg],
                 disk: DiskPlan, buffer: PartitionBuffer) -> DiskPlan:
    """Start the worker's `buffer` on the task (what it keeps of what it holds, by
    disk.next_use); with disk.write_back, the plan also holds unwritten what the next
    task's buffer will keep. (The buffer is passed in: Ray ships train_bucket_task by
    value with the globals it names, so its _BUFFER is not this module's.)"""
    leases = {key: p.source for key, p in zip(work.keys, partitions) if isinstance(p, SwapFile)}
    held = {key[1] for key, _ in buffer.held}
    buffer.next_task(keep=config.num_partitions() > 1, leases=leases, parts=partitions_to_keep(
        held, {key[1] for key in leases}, disk.next_use, config.ray.partition_buffer),
        write_back=disk.write_back is not None)
    if disk.write_back is None:
        return disk
    after = {key[1] for key, _ in buffer.held} | {key[1] for key in leases} | {
        key[1] for key, _ in disk.read_ahead}
    kept = partitions_to_keep(after, disk.write_back, disk.next_use, config.ray.partition_buffer)
    return dataclasses.replace(
        disk, hand_over=disk.hand_over | {key for key in leases if key[1] in kept})


@dataclass
class BucketRefs:
    """A train task's returns by name: its BucketStats, its params delta, the gradients of
    the rows it drew from beyond the bucket (per partition its RowGradients), and per key
    its result (see PartitionArg), each a return of its own, so that a partition's result
    goes to its store without passing through the driver."""

    stats: ray.ObjectRef
    delta: ray.ObjectRef
    drawn: ray.ObjectRef
    results: Dict[PartitionKey, ray.ObjectRef]

    def all(self) -> List[ray.ObjectRef]:
        return [self.stats, self.delta, self.drawn, *self.results.values()]


def submit_bucket(config: ConfigSchema, work: BucketWork, params: ray.ObjectRef,
                  partitions: Sequence[Any], known: Optional[KnownRows], disk: DiskPlan,
                  previous_delta: Optional[ray.ObjectRef],
                  beyond: Optional[Dict[str, BeyondBucket]] = None,
                  pending: Optional[Dict[PartitionKey, Tuple[RowGradients, ...]]] = None
                  ) -> BucketRefs:
    """Start `work`'s train task on `partitions` (per key an ObjectRef of its values or a
    SwapFile) with the parameters `params` (and the rows drawn for negatives from beyond
    the bucket, `beyond`, and the gradients of its partitions' rows drawn before,
    `pending`)."""
    refs = train_bucket_task.options(
        num_returns=3 + len(work.keys), num_cpus=config.ray.cpus_per_trainer,
        num_gpus=gpus_per_trainer(config),
    ).remote(config, work, params, *partitions, known=known, disk=disk,
             previous_delta=previous_delta, beyond=beyond, pending=pending)
    return BucketRefs(refs[0], refs[1], refs[2], dict(zip(work.keys, refs[3:])))
