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

import os
import time
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import ray

from pbg_ray.checkpoints.directory import checkpoint_metadata
from pbg_ray.checkpoints.sources import PartitionSource
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.metrics import SampledNegatives
from pbg_ray.incremental.growth import touches_new
from pbg_ray.io.edges import check_edges
from pbg_ray.model.native import release_free_heap
from pbg_ray.model.params import KnownRows, ModelParams, PartitionKey, partition_counts
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import TASK_RUNTIME_ENV, on_task_threads, task_threads
from pbg_ray.training.scheduler import partitions_to_keep
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


# This worker process's buffers (train tasks of one worker run one at a time).
_BUFFER = PartitionBuffer()


def run_bucket(config: ConfigSchema, bucket: Bucket, edge_path: str, chunk_idx: int,
               num_chunks: int, iteration: int, num_relation_ids: int, keys: List[PartitionKey],
               params: ModelParams,
               partitions: List[Union[Tuple[np.ndarray, np.ndarray], SwapFile]],
               deltas: List[bool], num_threads: int, device: str,
               known: Optional[KnownRows] = None, warmup_s: float = 0.0,
               copies: Optional[PartitionBuffer] = None,
               read_ahead: Sequence[Tuple[PartitionKey, PartitionSource]] = (),
               write_order: Sequence[int] = (),
               hand_over: Collection[PartitionKey] = (),
               following: Optional[Bucket] = None) -> Tuple[Any, ...]:
    """The pure part of the task. `partitions`: per key its (embeddings, sums), or the
    SwapFile to read them from and write them to (disk placement). Returns (stats,
    params delta, one result per key): the new (embeddings, sums), their change where
    `deltas` says so (partitions other buckets train at the same time), or the SwapFile,
    whose write may still go on (see PartitionBuffer). `known`: what init_path trained
    (incremental runs), trained at its own learning rate. `warmup_s`: the Hogwild
    warm-up (HogwildWarmUp) the driver decided for the bucket. `copies` gives the arrays the
    partitions are trained in (and holds those written to swap files, see
    PartitionBuffer); `read_ahead` the partitions of the trainer's next bucket that it
    reads while this one trains; `write_order` the partition indices to write first (the
    next bucket's: its task waits for them; none: no bucket follows in the trainer's
    pass, and what the worker holds unwritten is written now); `hand_over` those held
    unwritten for a later task of the trainer, which trains them too (see HandOver);
    `following` the trainer's next bucket, whose edges are read while this one trains."""
    from pbg_ray.model.kernel import evaluate_bucket, train_bucket

    t_start = time.perf_counter()
    copies = copies if copies is not None else PartitionBuffer(keep=False)
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
                      read_ahead: Sequence[Tuple[PartitionKey, PartitionSource]] = (),
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
    ray.partition_buffer partitions by it, see PartitionBuffer). `previous_delta`: the
    params delta of the trainer's previous bucket, submitted before it (this task then
    starts once that one has succeeded): `params` lack it, as that update was not sent yet.
    `hand_over`: the partitions held for the trainer's next task instead of written.
    `write_back`: the partition indices of the trainer's next bucket, when all its next
    buckets run on this worker (one trainer): the partitions the buffer keeps for them
    are held unwritten too, each written once the buffer drops it (see PartitionBuffer).
    `following`: the trainer's next bucket, whose edges this task reads ahead."""
    num_threads = task_threads(config)
    device = "cuda" if gpus_per_trainer(config) > 0 else "cpu"
    start = time.time()
    if previous_delta is not None:
        params = ModelParams(
            {k: v + previous_delta.arrays[k] for k, v in params.arrays.items()},
            {k: v + previous_delta.sums[k] for k, v in params.sums.items()})
    leases = {key: p.source for key, p in zip(keys, partitions) if isinstance(p, SwapFile)}
    held = {key[1] for key, _ in _BUFFER.held}
    _BUFFER.next_task(keep=config.num_partitions() > 1, leases=leases, parts=partitions_to_keep(
        held, {key[1] for key in leases}, next_use, config.ray.partition_buffer),
        write_back=write_back is not None)
    if write_back is not None:  # what the next task's next_task above will keep
        after = {key[1] for key, _ in _BUFFER.held} | {key[1] for key in leases} | {
            key[1] for key, _ in read_ahead}
        kept = partitions_to_keep(after, write_back, next_use, config.ray.partition_buffer)
        hand_over = {*hand_over, *(key for key in leases if key[1] in kept)}
    stats, *results = run_bucket(config, bucket, edge_path, chunk_idx, num_chunks, iteration,
                                 num_relation_ids, keys, params, list(partitions), deltas,
                                 num_threads, device, known, warmup_s, copies=_BUFFER,
                                 read_ahead=read_ahead, write_order=next_use,
                                 hand_over=hand_over, following=following)
    stats["worker"] = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                       "start": start, "end": time.time()}
    return (stats, *results)
