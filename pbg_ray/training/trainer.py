"""The training driver: decides what runs where; actors hold state, tasks compute.

The loop is PBG's: num_epochs x edge paths x edge chunks passes; in each pass
every bucket is trained once on its chunk, in the configured bucket order,
several buckets at once when their partitions are disjoint. After each pass
a checkpoint version is committed (version N = N passes done, as in PBG), so
a rerun of the same command resumes where the last complete version ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import shutil
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import ray
from ray.exceptions import (
    NodeDiedError, ObjectLostError, OwnerDiedError, RayActorError, RayTaskError,
    WorkerCrashedError)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from pbg_ray.checkpoints.directory import checkpoint_metadata
from pbg_ray.checkpoints.legacy import check_init_path, resolve_init_path
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.sources import CheckpointSource, PartitionSource
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import Evaluator
from pbg_ray.evaluation.metrics import ALL, SampledNegatives, add_stats, stats_mean
from pbg_ray.incremental.growth import known_rows, neighbor_means
from pbg_ray.io.edges import count_edges
from pbg_ray.io.entities import load_entity_counts, num_relation_ids
from pbg_ray.model.params import PartitionKey, partition_keys
from pbg_ray.runtime.connect import check_cpus_per_trainer, check_task_fits, largest_node
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import discard, stop_actors
from pbg_ray.training.bucket_task import (
    BucketRefs, BucketStats, BucketWork, DiskPlan, gpus_per_trainer, start_trainer_worker,
    submit_bucket)
from pbg_ray.training.parameter_server import ParameterServer
from pbg_ray.training.partition_store import PartitionStore
from pbg_ray.training.scheduler import BucketSchedulerActor, parts_by_next_use
from pbg_ray.training.bucket_sources import (
    InitSource, ModelSource, RandomSource, SwapFile, WriterDied)
from pbg_ray.training.tensorboard import TensorBoardLog
from pbg_ray.training.warm_up import HogwildWarmUp
from pbg_ray.types import Bucket

logger = logging.getLogger("pbg_ray")

# A bucket whose trainer dies this often in one pass stops the run.
MAX_BUCKET_ATTEMPTS = 3
# Failures of the machinery, not of the bucket: its trainer process or node died.
TRAINER_DIED = (WorkerCrashedError, NodeDiedError, ObjectLostError)
# A pass whose actors die this often stops the run.
MAX_PASS_ATTEMPTS = 3


def get_all(refs: List[ray.ObjectRef]) -> List[Any]:
    """ray.get(refs) once every one has finished: when one fails, the others' writes
    (checkpoint files, swap files) are not left going on behind the error, where the
    next run on this checkpoint_path could meet them."""
    ray.wait(refs, num_returns=len(refs))
    try:
        return ray.get(refs)
    except BaseException:
        discard(refs)
        raise


@dataclasses.dataclass
class Launched:
    """A bucket's train task in flight."""

    bucket: Bucket
    keys: List[PartitionKey]
    deltas: List[bool]
    refs: BucketRefs
    leases: List[Any]  # per key: the SwapFile it reads and writes, or the ref of its values
    following: Optional[Bucket]  # the trainer's next bucket, taken with this one
    followed: bool  # whether the following bucket's task is submitted behind this one
    t_start: float  # where its bucket_wall_s begins
    # The following bucket's task, submitted to start once this one has succeeded.
    successor: Optional["Launched"] = None

    def lease(self, key: PartitionKey) -> Any:
        return self.leases[self.keys.index(key)]


@dataclasses.dataclass
class TrainResult:
    checkpoint_path: str
    version: int
    bucket_stats: List[Dict[str, Any]]  # this run's, in training_stats.json's layout
    actor_restarts: int = 0  # passes trained again because an actor died


class Trainer:
    """One run: its actors, its pass loop and its checkpoints."""

    def __init__(self, config: ConfigSchema) -> None:
        self.config = config = config.checked()
        self.checkpoints = CheckpointManager(config.checkpoint_path)
        self.version = self.checkpoints.resume(config)
        if self.version == 0 and config.init_path:
            check_init_path(config.init_path)
        self.entity_counts = load_entity_counts(config)
        self.num_relation_ids = num_relation_ids(config)
        self.nparts_lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
        self.nparts_rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)
        self.edge_counts = {
            path: {Bucket(l, r): count_edges(path, Bucket(l, r))
                   for l in range(self.nparts_lhs) for r in range(self.nparts_rhs)}
            for path in config.edge_paths}
        self.num_chunks = config.num_edge_chunks or max(1, math.ceil(
            max(max(c.values()) for c in self.edge_counts.values()) / config.max_edges_per_chunk))
        self.num_passes = config.num_epochs * len(config.edge_paths) * self.num_chunks
        # What init_path trained, when it trains apart from the new rows (incremental runs).
        self.known = known_rows(config)
        # The conversion of a pre-1.0 or bundle init_path, read until version 1 exists.
        self.init_scratch: Optional[Path] = None
        # The run's actors; started on first use and again after one dies. All of them
        # (`actors`) are stopped when one dies and when this trainer goes (stop_actors).
        self.stores: List[Any] = []
        self.params: Optional[Any] = None
        self.scheduler: Optional[Any] = None
        self.actors: List[Any] = []
        weakref.finalize(self, stop_actors, self.actors)
        # Which buckets are warmed up: by the partitions trained since the actors loaded them.
        self.warm_up = HogwildWarmUp(config, self.num_chunks)
        self.actor_restarts = 0
        # A bar per pass, or a line where there is no terminal; a Tune trial, which reports
        # each epoch on a line of the search's own, turns it off.
        self.progress = True

    # --- where the first values come from --------------------------------

    def _sources(self) -> Tuple[Dict[PartitionKey, PartitionSource], Optional[ModelSource]]:
        config = self.config
        init: Optional[CheckpointManager] = None
        init_version = 0
        if self.version == 0 and config.init_path:
            # A pre-1.0 run or a model bundle is converted into a v1 checkpoint first.
            resolved = resolve_init_path(config.init_path, self.checkpoints.path / ".init")
            if resolved != config.init_path:
                self.init_scratch = Path(resolved)
            init = CheckpointManager(resolved)
            init_version = init.version()
        new_rows = (neighbor_means(config, init, init_version, self.entity_counts)
                    if init is not None and init_version > 0
                    and config.incremental.new_rows_init == "neighbors" else {})
        sources = {}
        for entity, econf in config.entities.items():
            for part in range(econf.num_partitions):
                if self.version > 0:
                    sources[entity, part] = CheckpointSource(str(self.checkpoints.path),
                                                             self.version)
                elif init is not None and init.has_partition(init_version, entity, part):
                    # A grown graph keeps init's rows first; the new rows start fresh.
                    sources[entity, part] = InitSource(str(init.path), init_version,
                                                       self.entity_counts[entity][part],
                                                       new_rows.get((entity, part)))
                else:
                    sources[entity, part] = RandomSource(self.entity_counts[entity][part],
                                                         config.seed)
        if self.version > 0:
            model_source: Optional[ModelSource] = ModelSource(str(self.checkpoints.path),
                                                              self.version)
        elif init is not None and init.has_model(init_version):
            model_source = ModelSource(str(init.path), init_version, grow=True)
        else:
            model_source = None
        return sources, model_source

    def _start_actors(self) -> None:
        if self.scheduler is not None:  # started, and none has died since
            return
        trainers = self.max_trainers()
        check_cpus_per_trainer(self.config.ray)
        check_task_fits("ray.gpus_per_trainer", "GPU", gpus_per_trainer(self.config))
        sources, model_source = self._sources()
        self.warm_up = HogwildWarmUp(self.config, self.num_chunks)  # the partitions load anew
        keys = sorted(sources)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        num_stores = self.config.ray.num_partition_stores or min(len(keys), max(1, len(nodes)))
        # Round-robin over the nodes alive now: Ray's SPREAD strategy, and a soft affinity
        # while nodes are still starting, may put actors that ask for no CPU all on one
        # node, which a node's loss then never reaches. After an actor died the affinity is
        # soft: a node lost a moment ago may still be listed alive.
        soft = self.actor_restarts > 0
        self.stores = [PartitionStore.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            nodes[i % len(nodes)], soft=soft)).remote(self.config, self.version + 1)
            for i in range(num_stores)]
        self.store_of = {key: self.stores[i % num_stores] for i, key in enumerate(keys)}
        self.params = ParameterServer.remote(self.config, self.num_relation_ids)
        partitioned = lambda side: any(  # noqa: E731
            self.config.entities[getattr(r, side)].num_partitions > 1 for r in self.config.relations)
        self.scheduler = BucketSchedulerActor.remote(
            self.nparts_lhs, self.nparts_rhs, self.config.bucket_order,
            partitioned("lhs"), partitioned("rhs"), self.config.seed,
            self.config.ray.partition_buffer)
        self.actors[:] = [*self.stores, self.params, self.scheduler]
        started = [start_trainer_worker.options(num_cpus=self.config.ray.cpus_per_trainer,
                                                num_gpus=gpus_per_trainer(self.config)).remote()
                   for _ in range(trainers)]
        # The processes above start at once (each imports torch for seconds); waiting for
        # them here keeps their start-up out of the first bucket's time, and has the first
        # train tasks find them idle: a train task sent while they still import, to a
        # CPU they leave free, would start a process of its own beside them. (One that
        # failed, its node lost, costs only its head start.)
        ray.get([self.store_of[key].add.remote(key, sources[key]) for key in keys]
                + [self.params.load.remote(model_source)])
        discard(started, timeout=None)

    def max_trainers(self) -> int:
        """Train tasks at once: ray.num_trainers, or as many as the cluster's CPUs (and
        GPUs) and the partitions allow: buckets trained at once share no partition index,
        so no more than the partition count run together (an unpartitioned graph, one
        bucket a pass, one), and a worker started for more would import torch and idle."""
        if self.config.ray.num_trainers:
            return self.config.ray.num_trainers
        resources = ray.cluster_resources()
        limit = int(resources.get("CPU", 1) // self.config.ray.cpus_per_trainer)
        gpus = gpus_per_trainer(self.config)
        if gpus > 0:
            limit = min(limit, int(resources.get("GPU", 0) // gpus))
            if limit == 0:
                raise PbgRayError("GPU training was asked for (num_gpus / ray.gpus_per_trainer) but "
                                  "the Ray cluster has no GPU. Set num_gpus=0 and "
                                  "ray.gpus_per_trainer=0 to train on CPUs.")
        return max(1, min(limit, self.config.num_partitions()))

    def _warn_idle_cpus(self) -> None:
        """Say so when the partitions, not the CPUs, bound the train tasks and CPUs stay
        idle: each task trains on int(ray.cpus_per_trainer) Hogwild threads, and the key
        that gives it the rest is named with the value that would."""
        ray_config = self.config.ray
        if ray_config.num_trainers or gpus_per_trainer(self.config) > 0:
            return
        trainers = self.max_trainers()
        cpus = ray.cluster_resources().get("CPU", 1)
        node_cpus = largest_node("CPU") or cpus
        per_trainer = int(min(node_cpus, cpus // trainers))
        if per_trainer > ray_config.cpus_per_trainer:
            logger.warning(
                "%d partition(s) allow %d train task(s) at once; with ray.cpus_per_trainer=%g "
                "they use %g of the %g CPUs. Set ray.cpus_per_trainer=%d to train each bucket "
                "on that many Hogwild threads.", self.config.num_partitions(), trainers,
                ray_config.cpus_per_trainer, trainers * ray_config.cpus_per_trainer, cpus,
                per_trainer)

    # --- the pass loop ------------------------------------------------------

    def run(self, on_epoch_end: Optional[Callable[[int], None]] = None) -> TrainResult:
        """Train the passes the checkpoint doesn't hold yet. `on_epoch_end(epoch_idx)` is
        called once an epoch's last version is current (Ray Tune reports there)."""
        config = self.config
        passes_per_epoch = len(config.edge_paths) * self.num_chunks
        total = self.num_passes
        if self.version >= total:
            logger.info("checkpoint %s already holds %d passes; nothing to train",
                        self.checkpoints.path, self.version)
            return TrainResult(str(self.checkpoints.path), self.version, [])
        self._warn_idle_cpus()
        # Stats lines of passes that never became current (an interrupted run's) go; the
        # session also removes, whatever ends the run, its unfinished version and swap files.
        completed = lambda s: (s["epoch_idx"] * passes_per_epoch  # noqa: E731
                               + s["edge_path_idx"] * self.num_chunks + s["edge_chunk_idx"]
                               ) < self.version
        with self.checkpoints.session(self.version, completed) as bucket_index, \
                TensorBoardLog(config.tensorboard_dir) as tensorboard:
            all_stats: List[Dict[str, Any]] = []
            self.actor_restarts = 0
            for iteration in range(self.version, total):
                epoch_idx, rest = divmod(iteration, passes_per_epoch)
                path_idx, chunk_idx = divmod(rest, self.num_chunks)
                pass_stats = self._train_pass(
                    iteration, epoch_idx, path_idx, chunk_idx, bucket_index,
                    last_of_epoch=(rest == passes_per_epoch - 1))
                bucket_index += len(pass_stats)
                all_stats += pass_stats
                tensorboard.log_buckets(pass_stats)
                if rest == passes_per_epoch - 1:
                    # From the file: an epoch resumed midway has lines of the earlier run.
                    tensorboard.log_epoch(epoch_idx, [s for s in self.checkpoints.read_stats()
                                                      if s["epoch_idx"] == epoch_idx])
                    if on_epoch_end is not None:
                        on_epoch_end(epoch_idx)
        return TrainResult(str(self.checkpoints.path), self.version, all_stats,
                           self.actor_restarts)

    def _train_pass(self, iteration: int, epoch_idx: int, path_idx: int, chunk_idx: int,
                    bucket_index: int, last_of_epoch: bool) -> List[Dict[str, Any]]:
        """Train one pass and commit it as the next version.

        An actor that dies (its process killed, its node lost) takes the pass with it:
        every actor is replaced by a fresh one loaded from the newest complete version
        and the pass is trained again. The surviving actors hold some of the pass's
        bucket updates, so keeping them would apply those twice. In disk placement the
        pass's swap files are dropped for the same reason: a swap file holds its
        partition after some of the pass's buckets, whose share of the unpartitioned
        types and relation parameters died in memory. At most one pass is lost. The same
        happens when a process that wrote a swap file behind its task died before the
        write was done (WriterDied): that partition's newest values are lost.
        """
        for attempt in itertools.count(1):
            try:
                self._start_actors()  # inside the try: an actor may die while starting too
                pass_stats = self._run_pass(iteration, epoch_idx, path_idx, chunk_idx, bucket_index)
                self._commit(iteration, epoch_idx, pass_stats, last_of_epoch)
                return pass_stats
            except (RayActorError, OwnerDiedError, RayTaskError) as err:
                # An actor died: itself, or seen through a task's partition that died with
                # its store (OwnerDiedError), or a swap file's writer died behind its task
                # (see WriterDied): the pass is trained again. Any other failure of a
                # method (e.g. a checkpoint write) or of a task stops the run.
                if (not isinstance(err, (RayActorError, OwnerDiedError))
                        and not isinstance(err.cause, WriterDied)):
                    if isinstance(err.cause, PbgRayError):
                        raise err.cause from None
                    raise
                if attempt == MAX_PASS_ATTEMPTS:
                    raise RuntimeError(f"actors of the run died {attempt} times in epoch "
                                       f"{epoch_idx + 1}; giving up") from err
                what = (f"an actor died ({type(err).__name__})"
                        if isinstance(err, (RayActorError, OwnerDiedError))
                        else f"a swap file's writer died ({err.cause})")
                logger.warning("%s in epoch %d; restarting the actors from checkpoint version "
                               "%d and training the pass again", what, epoch_idx + 1, self.version)
                self.actor_restarts += 1
                stop_actors(self.actors)
                self.stores, self.params, self.scheduler = [], None, None
                self.checkpoints.rollback()

    def _run_pass(self, iteration: int, epoch_idx: int, path_idx: int, chunk_idx: int,
                  bucket_index: int) -> List[Dict[str, Any]]:
        config = self.config
        edge_path = config.edge_paths[path_idx]
        plan = ray.get(self.scheduler.new_pass.remote(iteration))
        # Disk placement: a trainer takes its next bucket when it starts one, and reads
        # the partitions it lacks while the current one trains (see PartitionBuffer); the
        # next bucket's task is submitted then too, to start on the same worker the moment
        # the current one ends (see follow).
        read_ahead = config.ray.placement == "disk" and config.num_partitions() > 1
        launched: set = set()
        following_ones: List[Bucket] = []  # taken next buckets whose trainer is free
        running: Dict[ray.ObjectRef, Launched] = {}  # by stats ref; successors not listed
        # The newest task in flight training each partition, until its update is sent.
        self.in_flight: Dict[PartitionKey, Launched] = {}
        pass_stats: List[Dict[str, Any]] = []
        max_trainers = self.max_trainers()
        num_buckets = self.nparts_lhs * self.nparts_rhs
        # Unpartitioned types send deltas when other buckets train them at the same time.
        concurrent = max_trainers > 1 and num_buckets > 1
        desc = (f"epoch {epoch_idx + 1}/{config.num_epochs} path {path_idx + 1}/"
                f"{len(config.edge_paths)} chunk {chunk_idx + 1}/{self.num_chunks}")
        bar = tqdm(total=num_buckets, desc=desc, unit="bucket", dynamic_ncols=True,
                   disable=None if self.progress else True)
        t_pass = time.perf_counter()
        pass_sums = None  # the pass's training stats so far, summed
        attempts: Dict[Bucket, int] = {}
        applying: List[ray.ObjectRef] = []  # updates sent to the actors
        io: Dict[str, int] = {}  # disk placement: partition reads and writes of the pass

        def launch(bucket: Bucket, previous: Optional[Launched] = None) -> Launched:
            launched.add(bucket)
            keys = partition_keys(config, bucket)
            deltas = [concurrent and config.entities[e].num_partitions == 1 for e, _ in keys]
            return self._launch(bucket, keys, deltas, edge_path, chunk_idx, iteration, plan,
                                launched, read_ahead, max_trainers == 1, previous)

        def follow(task: Launched) -> None:
            """Submit the task of `task`'s following bucket now, behind it (see _launch)."""
            if task.followed:
                task.successor = launch(task.following, previous=task)

        def sent(task: Launched) -> None:
            for key in task.keys:
                if self.in_flight.get(key) is task:
                    del self.in_flight[key]

        try:
            while True:
                if applying:
                    done, applying = ray.wait(applying, num_returns=len(applying), timeout=0)
                    ray.get(done)
                while len(running) < max_trainers:
                    bucket = (following_ones.pop(0) if following_ones
                              else ray.get(self.scheduler.acquire.remote()))
                    if bucket is None:
                        break
                    if self.edge_counts[edge_path][bucket] == 0:  # nothing to train
                        ray.get(self.scheduler.release.remote(bucket))
                        bar.update(1)
                        continue
                    task = launch(bucket)
                    running[task.refs.stats] = task
                    follow(task)
                if not running:
                    if ray.get(self.scheduler.pass_done.remote()):
                        get_all(applying)
                        break
                    raise RuntimeError("bucket scheduler handed out nothing while no bucket is held")
                (ready,), _ = ray.wait(list(running), num_returns=1)
                task = running.pop(ready)
                successor = task.successor
                if successor is not None:  # it runs now, or fails with this one
                    running[successor.refs.stats] = successor
                bucket, keys, deltas = task.bucket, task.keys, task.deltas
                try:
                    stats: BucketStats = ray.get(ready)
                except RayTaskError as err:
                    discard(task.refs.all())
                    if isinstance(err.cause, PbgRayError):
                        raise err.cause from None
                    raise
                except TRAINER_DIED as err:
                    discard(task.refs.all())  # the same error, once per return
                    attempts[bucket] = attempts.get(bucket, 0) + 1
                    if attempts[bucket] >= MAX_BUCKET_ATTEMPTS:
                        raise RuntimeError(f"the trainer of bucket {bucket} died {attempts[bucket]} "
                                           f"times in epoch {epoch_idx}; giving up") from err
                    logger.warning("trainer of bucket %s died (%s); handing it out again",
                                   bucket, type(err).__name__)
                    # Its successor, whose task fails with it, and the buckets taken after
                    # it go back too, in order.
                    chain = [task]
                    if successor is not None:
                        del running[successor.refs.stats]
                        ray.cancel(successor.refs.stats)
                        discard(successor.refs.all())
                        chain.append(successor)
                    for failed in reversed([t.bucket for t in chain] + [
                            b for b in [chain[-1].following] if b is not None]):
                        ray.get(self.scheduler.fail.remote(failed))
                    for failed_task in chain:
                        sent(failed_task)
                        launched.discard(failed_task.bucket)
                    continue
                loss = stats.train["metrics"].get("loss", 0.0)
                if not np.isfinite(loss):  # stop before the update is applied anywhere
                    raise PbgRayError(
                        f"training diverged: loss is {loss} in epoch {epoch_idx + 1}/{config.num_epochs}, "
                        f"bucket ({bucket.lhs}, {bucket.rhs}); checkpoint version {self.version} stays "
                        "current. Lower lr or init_scale, or set max_norm.")
                fault_point("driver.before_apply")
                # Not waited for: an actor runs one caller's calls in the order sent, so the
                # next lease of these partitions (and pull of the parameters) comes after
                # their update. Their errors are raised once they are done, at the latest
                # before the pass is committed.
                applying += [self.store_of[k].update.remote(k, [task.refs.results[k]], d)
                             for k, d in zip(keys, deltas)]
                applying += [self.params.apply_delta.remote(task.refs.delta),
                             self.scheduler.release.remote(bucket)]
                sent(task)
                self.warm_up.trained(keys)
                if successor is None and task.following is not None:
                    following_ones.append(task.following)
                fault_point("driver.after_apply")
                t_done = time.perf_counter()
                stats.timing.bucket_wall_s = t_done - task.t_start
                if successor is not None:
                    # The trainer's time from here on is its successor's.
                    successor.t_start = max(successor.t_start, t_done)
                    follow(successor)
                pass_sums = add_stats(pass_sums, stats.train)
                pass_stats.append({
                    "epoch_idx": epoch_idx, "edge_path_idx": path_idx, "edge_chunk_idx": chunk_idx,
                    "lhs_partition": bucket.lhs, "rhs_partition": bucket.rhs,
                    "index": bucket_index + len(pass_stats), **stats.line()})
                rate = pass_sums["count"] / (time.perf_counter() - t_pass)
                mean_loss = stats_mean([pass_sums]).get("loss", float("nan"))
                bar.set_postfix(edges_per_s=f"{rate:.3g}", loss=f"{mean_loss:.4g}")
                for name, count in stats.partition_io.items():
                    io[name] = io.get(name, 0) + count
                bar.update(1)
        except KeyboardInterrupt:
            # Ctrl-C: the driver leaves at once, and Ray ends the tasks it started (cancelling
            # them here as well can crash Ray's core worker); what one still writes is a
            # leftover that the next run on this checkpoint removes before it starts.
            raise
        except BaseException:
            # Nothing of this pass may go on behind the error: a task in flight could
            # still write its swap files after the caller removed the pass's leftovers.
            in_flight = [t for task in running.values() for t in (task, task.successor)
                         if t is not None]
            for task in in_flight:
                ray.cancel(task.refs.stats, force=True)
            discard([ref for task in in_flight for ref in task.refs.all()])
            raise
        bar.close()
        io_text = (f", {io['reads']} partition reads, {io['writes']} writes" if io else "")
        if self.progress and bar.disable and pass_stats:  # no terminal: a line per pass
            print(f"{desc}: {len(pass_stats)} buckets, {rate:.3g} edges/s, loss {mean_loss:.4g}"
                  f"{io_text}", file=sys.stderr, flush=True)
        elif io:
            logger.info("%s:%s", desc, io_text[1:])
        return pass_stats

    def _launch(self, bucket: Bucket, keys: List[PartitionKey], deltas: List[bool],
                edge_path: str, chunk_idx: int, iteration: int, plan: List[Bucket],
                launched: set, read_ahead: bool, one_trainer: bool,
                previous: Optional[Launched] = None) -> Launched:
        """Start the train task of `bucket`. With `read_ahead` (disk placement) the trainer
        takes its next bucket now, the task reads its partitions that it lacks, and its
        worker keeps its buffer by the partitions the buckets after it need (written
        back once dropped from it when `one_trainer` trains the pass). `previous`:
        the trainer's bucket in flight that this one follows (its task is submitted to
        start once that one has succeeded, on the same worker as Ray reuses it): the
        partitions and parameters are then what the tasks in flight leave behind them, and
        the partitions both train pass from one to the other in the worker's buffer
        (hand_over.HandOver)."""
        config = self.config
        t_start = time.perf_counter()
        # What each task in flight before this one leaves a partition as (in_flight):
        # the SwapFile it writes, or the ref of its result.
        behind = {k: self.in_flight[k] for k in keys if previous is not None and k in self.in_flight}
        before = {k: task.lease(k) for k, task in behind.items()}
        # An object-store ref each, or in disk placement the SwapFile the task reads and
        # writes; asked for while the scheduler picks the next bucket.
        lease_refs = {k: self.store_of[k].lease.remote(k, before.get(k)) for k in keys
                      if k not in before or isinstance(before[k], SwapFile)}
        held = [previous.bucket, bucket] if previous is not None else [bucket]
        following = ray.get(self.scheduler.acquire.remote(held)) if read_ahead else None
        # The following bucket's task is submitted behind this one when no partition of
        # this one comes back as a delta (it takes this one's results as they are) and it
        # has edges to train; this task then holds the partitions they share for it.
        followed = (following is not None and not any(deltas)
                    and self.edge_counts[edge_path][following] > 0)
        next_use = self._next_use(plan, launched, following) if read_ahead else []
        # Held for a later task of the trainer on its worker instead of written (see
        # hand_over.HandOver): what the following bucket trains, when its task follows
        # this one; with one trainer, whose next buckets all run on that worker, also what
        # else the worker's buffer keeps for them (written once the buffer drops it).
        following_keys = partition_keys(config, following) if following is not None else []
        hand_over = [k for k in following_keys if k in keys] if followed else []
        write_back = ([k[1] for k in following_keys]
                      if one_trainer and following is not None else None)
        # The following bucket's edges are read while this one trains, if it has any.
        edges_ahead = (following if following is not None
                       and self.edge_counts[edge_path][following] > 0 else None)
        ahead = [k for k in following_keys if k not in keys]
        # Where the partitions to read ahead are (None: not on disk).
        written = {k: self.in_flight[k].lease(k).written
                   for k in ahead if k in self.in_flight}
        source_refs = {k: self.store_of[k].source.remote(k) for k in ahead if k not in written}
        replies = dict(zip([*lease_refs, *source_refs],
                           ray.get([*lease_refs.values(), *source_refs.values()])))
        leases = [behind[k].refs.results[k] if k not in lease_refs
                  else replies[k][0] if isinstance(replies[k], list) else replies[k]
                  for k in keys]
        read_ahead_parts = [(k, written[k] if k in written else replies[k]) for k in ahead
                            if k in written or replies[k] is not None]
        work = BucketWork(
            bucket, edge_path, chunk_idx, self.num_chunks, iteration, self.num_relation_ids,
            tuple(keys), tuple(deltas), following=edges_ahead, warmup_s=self.warm_up.seconds(
                iteration, keys, before=previous.keys if previous is not None else ()))
        disk = DiskPlan(tuple(read_ahead_parts), tuple(next_use), frozenset(hand_over),
                        tuple(write_back) if write_back is not None else None)
        refs = submit_bucket(config, work, self.params.get.remote(), leases, self.known, disk,
                             previous.refs.delta if previous is not None else None)
        task = Launched(bucket, keys, deltas, refs, leases, following, followed, t_start)
        self.in_flight.update((k, task) for k in keys)
        return task

    @staticmethod
    def _next_use(plan: List[Bucket], launched: set, following: Optional[Bucket]) -> List[int]:
        """The partitions a trainer's next buckets need, in the order they first need
        them, `following` first."""
        upcoming = ([following] if following is not None else []) + [
            b for b in plan if b not in launched and b != following]
        return parts_by_next_use(upcoming)

    def _commit(self, iteration: int, epoch_idx: int, pass_stats: List[Dict[str, Any]],
                last_of_epoch: bool) -> None:
        """Write version N+1 completely, then make it current, then drop N."""
        config = self.config
        version = self.version + 1
        metadata = checkpoint_metadata(config, iteration, self.num_chunks)
        fault_point("driver.before_commit")
        get_all([s.save.remote(version, metadata) for s in self.stores]
                + [self.params.save.remote(version, metadata)])
        fault_point("driver.version_written")
        interval = config.checkpoint_preservation_interval
        preserve = last_of_epoch and interval and (epoch_idx + 1) % interval == 0
        self.checkpoints.commit(
            version, pass_stats, config, preserve_as_epoch=epoch_idx + 1 if preserve else None,
            release=lambda superseded: get_all([s.recycle.remote(superseded) for s in self.stores]))
        if self.init_scratch is not None:  # the stores load from this version now
            shutil.rmtree(self.init_scratch, ignore_errors=True)
            self.init_scratch = None
        self.version = version
        fault_point("driver.after_commit")


    def evaluate(self, edge_path: str) -> Dict[str, float]:
        """PBG's sampled metrics (mrr, r1, r10, r50, auc, pos_rank) over all the
        edges of `edge_path`, with the current embeddings, against the negatives of
        held-out edges (SampledNegatives.of_held_out); one task per bucket."""
        self._start_actors()
        keys = sorted(self.store_of)
        refs = ray.get([self.store_of[k].get.remote(k) for k in keys])
        evaluator = Evaluator(self.config, {k: r[0] for k, r in zip(keys, refs)},
                              self.params.get.remote(), self.num_relation_ids)
        stats = evaluator.sampled(edge_path, SampledNegatives.of_held_out(self.config),
                                  per_relation=False).get(ALL)
        return {"count": stats["count"], **stats_mean([stats])} if stats else {"count": 0}

