"""One pass of a training run as an object: its state is fields, its events are methods.

The driver hands buckets out through the scheduler actor to up to max_trainers train
tasks at once; as each task ends its results go to the actors that own its partitions and
parameters (`finished`), a task whose process or node died has its bucket handed out
again (`trainer_died`), and anything else stops the pass with nothing of it going on
behind the error (`abort`). In disk placement a trainer takes its next bucket when it
starts one: the task reads the partitions it lacks while the current one trains, and the
next bucket's task is submitted behind it, to start on the same worker the moment the
current one ends (`follow`; see PartitionBuffer and HandOver). With beyond_bucket_negs
the gradients of the rows a task drew from beyond its bucket wait here (`pending`) for the
next task that trains their partition, and go to the stores at the pass's end.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Set, Tuple

import numpy as np
import ray
from ray.exceptions import RayTaskError
from tqdm import tqdm

from pbg_ray.checkpoints.position import Position
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.metrics import add_stats, stats_mean
from pbg_ray.model.beyond import BeyondBucket, RowGradients, draw_beyond
from pbg_ray.model.params import PartitionKey, partition_keys
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import discard, get_results
from pbg_ray.training.bucket_sources import SwapFile
from pbg_ray.training.bucket_task import (
    BucketRefs, BucketStats, BucketWork, DiskPlan, submit_bucket, task_seed)
from pbg_ray.training.failures import TRAINER_DIED, FailurePolicy
from pbg_ray.training.scheduler import parts_by_next_use
from pbg_ray.types import Bucket

if TYPE_CHECKING:
    from pbg_ray.training.trainer import Trainer

logger = logging.getLogger("pbg_ray")


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
    results: Dict[PartitionKey, Optional[str]]  # the versions of its results (BucketWork)
    given: Dict[PartitionKey, int]  # how many of each key's pending gradients it applies
    # The partitions it takes over from the task before it on its trainer (disk placement:
    # passed on in the worker's buffer, their newest values on no file until it ends).
    taken_over: FrozenSet[PartitionKey] = frozenset()
    # The following bucket's task, submitted to start once this one has succeeded.
    successor: Optional["Launched"] = None

    def lease(self, key: PartitionKey) -> Any:
        return self.leases[self.keys.index(key)]


class PassRun:
    """The pass at `position` of `trainer`'s run, its buckets numbered from
    `bucket_index` in training_stats.json."""

    def __init__(self, trainer: "Trainer", position: Position, bucket_index: int) -> None:
        self.trainer = trainer
        self.config = config = trainer.config
        self.position = position
        self.bucket_index = bucket_index
        self.edge_path = config.edge_paths[position.edge_path_idx]
        self.edge_counts = trainer.edge_counts[self.edge_path]
        self.plan: List[Bucket] = ray.get(trainer.scheduler.new_pass.remote(position.iteration))
        self.read_ahead = config.ray.placement == "disk" and config.num_partitions() > 1
        self.max_trainers = trainer.max_trainers()
        num_buckets = trainer.nparts_lhs * trainer.nparts_rhs
        # Unpartitioned types send deltas when other buckets train them at the same time.
        self.concurrent = self.max_trainers > 1 and num_buckets > 1
        self.launched: Set[Bucket] = set()
        self.following_ones: List[Bucket] = []  # taken next buckets whose trainer is free
        self.running: Dict[ray.ObjectRef, Launched] = {}  # by stats ref; successors not listed
        # The newest task in flight training each partition, until its update is sent.
        self.in_flight: Dict[PartitionKey, Launched] = {}
        self.applying: List[ray.ObjectRef] = []  # updates sent to the actors
        self.failures = FailurePolicy()  # per bucket: its trainer died
        self.stats: List[Dict[str, Any]] = []  # training_stats.json's lines of the pass
        self.sums: Optional[Dict[str, Any]] = None  # the pass's training stats so far
        self.io: Dict[str, int] = {}  # disk placement: partition reads and writes
        # Gradients of rows drawn from beyond the bucket, by partition, in the order the
        # tasks that drew them ended: the next task that trains the partition applies them.
        self.pending: Dict[PartitionKey, List[RowGradients]] = {}
        self.t_start = time.perf_counter()
        self.bar = tqdm(total=num_buckets, desc=str(position), unit="bucket",
                        dynamic_ncols=True, disable=None if trainer.progress else True)

    # --- the loop -----------------------------------------------------------

    def run(self) -> List[Dict[str, Any]]:
        """Train every bucket of the pass once; its training_stats.json lines."""
        try:
            while self.fill():
                (ready,), _ = ray.wait(list(self.running), num_returns=1)
                self.ended(self.running.pop(ready))
        except KeyboardInterrupt:
            # Ctrl-C: the driver leaves at once, and Ray ends the tasks it started
            # (cancelling them here as well can crash Ray's core worker); what one still
            # writes is a leftover that the next run on this checkpoint removes first.
            raise
        except BaseException:
            self.abort()
            raise
        self.apply_pending()
        self.report()
        return self.stats

    def fill(self) -> bool:
        """Launch buckets while trainers are free; False once the pass is done."""
        if self.applying:
            done, self.applying = ray.wait(self.applying, num_returns=len(self.applying),
                                           timeout=0)
            ray.get(done)
        scheduler = self.trainer.scheduler
        while len(self.running) < self.max_trainers:
            bucket = (self.following_ones.pop(0) if self.following_ones
                      else ray.get(scheduler.acquire.remote()))
            if bucket is None:
                break
            if self.edge_counts[bucket] == 0:  # nothing to train
                ray.get(scheduler.release.remote(bucket))
                self.bar.update(1)
                continue
            task = self.launch(bucket)
            self.running[task.refs.stats] = task
            self.follow(task)
        if self.running:
            return True
        if not ray.get(scheduler.pass_done.remote()):
            raise RuntimeError("bucket scheduler handed out nothing while no bucket is held")
        get_results(self.applying, wait_all=True)
        return False

    # --- events -------------------------------------------------------------

    def ended(self, task: Launched) -> None:
        """A task ended: its results are sent on, or its bucket handed out again."""
        successor = task.successor
        if successor is not None:  # it runs now, or fails with this one
            self.running[successor.refs.stats] = successor
        try:
            stats: BucketStats = ray.get(task.refs.stats)
        except RayTaskError as err:
            discard(task.refs.all())
            if isinstance(err.cause, PbgRayError):
                raise err.cause from None
            raise
        except TRAINER_DIED as err:
            discard(task.refs.all())  # the same error, once per return
            self.trainer_died(task, err)
            return
        self.finished(task, stats)

    def finished(self, task: Launched, stats: BucketStats) -> None:
        """Send a task's results to the actors (not waited for: an actor runs one caller's
        calls in the order sent, so the next lease of these partitions, and pull of the
        parameters, comes after their update; their errors are raised once they are
        done, at the latest before the pass is committed) and record its stats."""
        bucket, trainer = task.bucket, self.trainer
        loss = stats.train["metrics"].get("loss", 0.0)
        if not np.isfinite(loss):  # stop before the update is applied anywhere
            raise PbgRayError(
                f"training diverged: loss is {loss} in epoch {self.position.epoch_idx + 1}/"
                f"{self.config.num_epochs}, bucket ({bucket.lhs}, {bucket.rhs}); checkpoint "
                f"version {trainer.version} stays current. Lower lr or init_scale, or set "
                "max_norm.")
        fault_point("driver.before_apply")
        self.applying += [trainer.store_of[k].update.remote(k, [task.refs.results[k]], d)
                          for k, d in zip(task.keys, task.deltas)]
        for key, count in task.given.items():
            del self.pending[key][:count]
        if self.config.beyond_bucket_negs:
            for key, gradients in ray.get(task.refs.drawn).items():
                self.pending.setdefault(key, []).append(gradients)
        trainer.versions.update(task.results)
        self.applying += [trainer.params.apply_delta.remote(task.refs.delta),
                          trainer.scheduler.release.remote(bucket)]
        self.sent(task)
        trainer.warm_up.trained(task.keys)
        if task.successor is None and task.following is not None:
            self.following_ones.append(task.following)
        fault_point("driver.after_apply")
        t_done = time.perf_counter()
        stats.timing.bucket_wall_s = t_done - task.t_start
        if task.successor is not None:
            # The trainer's time from here on is its successor's.
            task.successor.t_start = max(task.successor.t_start, t_done)
            self.follow(task.successor)
        self.record(bucket, stats)

    def trainer_died(self, task: Launched, err: BaseException) -> None:
        """Hand the bucket of a task whose process or node died out again, with its
        successor (whose task fails with it) and the buckets taken after it, in order."""
        self.failures.retry(task.bucket, f"the trainer of bucket {task.bucket} in "
                                         f"{self.position}", err)
        logger.warning("trainer of bucket %s died (%s); handing it out again",
                       task.bucket, type(err).__name__)
        chain = [task]
        if task.successor is not None:
            successor = task.successor
            del self.running[successor.refs.stats]
            ray.cancel(successor.refs.stats)
            discard(successor.refs.all())
            chain.append(successor)
        for failed in reversed([t.bucket for t in chain] + [
                b for b in [chain[-1].following] if b is not None]):
            ray.get(self.trainer.scheduler.fail.remote(failed))
        for failed_task in chain:
            self.sent(failed_task)
            self.launched.discard(failed_task.bucket)

    def abort(self) -> None:
        """Nothing of this pass may go on behind an error: a task in flight could still
        write its swap files after the caller removed the pass's leftovers."""
        in_flight = [t for task in self.running.values() for t in (task, task.successor)
                     if t is not None]
        for task in in_flight:
            ray.cancel(task.refs.stats, force=True)
        discard([ref for task in in_flight for ref in task.refs.all()])

    # --- launching ----------------------------------------------------------

    def launch(self, bucket: Bucket, previous: Optional[Launched] = None) -> Launched:
        """Start the train task of `bucket`. With read_ahead (disk placement) the trainer
        takes its next bucket now, the task reads its partitions that it lacks, and its
        worker keeps its buffer by the partitions the buckets after it need (written back
        once dropped from it when one trainer trains the pass). `previous`: the trainer's
        bucket in flight that this one follows (its task is submitted to start once that
        one has succeeded, on the same worker as Ray reuses it): the partitions and
        parameters are then what the tasks in flight leave behind them, and the
        partitions both train pass from one to the other in the worker's buffer
        (hand_over.HandOver)."""
        config, trainer = self.config, self.trainer
        self.launched.add(bucket)
        keys = partition_keys(config, bucket)
        deltas = [self.concurrent and config.entities[e].num_partitions == 1 for e, _ in keys]
        t_start = time.perf_counter()
        # What each task in flight before this one leaves a partition as: the SwapFile it
        # writes, or the ref of its result.
        behind = {k: self.in_flight[k] for k in keys
                  if previous is not None and k in self.in_flight}
        before = {k: task.lease(k) for k, task in behind.items()}
        # An object-store ref each, or in disk placement the SwapFile the task reads and
        # writes; asked for while the scheduler picks the next bucket.
        lease_refs = {k: trainer.store_of[k].lease.remote(k, before.get(k)) for k in keys
                      if k not in before or isinstance(before[k], SwapFile)}
        held = [previous.bucket, bucket] if previous is not None else [bucket]
        following = (ray.get(trainer.scheduler.acquire.remote(held)) if self.read_ahead
                     else None)
        # The following bucket's task is submitted behind this one when no partition of
        # this one comes back as a delta (it takes this one's results as they are) and it
        # has edges to train; this task then holds the partitions they share for it.
        followed = (following is not None and not any(deltas)
                    and self.edge_counts[following] > 0)
        # The following bucket's partitions this one lacks, read while it trains: where
        # the tasks in flight write them, or where their stores say (None: not on disk).
        following_keys = partition_keys(config, following) if following is not None else []
        ahead = [k for k in following_keys if k not in keys]
        written = {k: self.in_flight[k].lease(k).written for k in ahead if k in self.in_flight}
        source_refs = {k: trainer.store_of[k].source.remote(k) for k in ahead
                       if k not in written}
        replies = dict(zip([*lease_refs, *source_refs],
                           ray.get([*lease_refs.values(), *source_refs.values()])))
        leases = [behind[k].refs.results[k] if k not in lease_refs
                  else replies[k][0] if isinstance(replies[k], list) else replies[k]
                  for k in keys]
        read_ahead = tuple((k, written[k] if k in written else replies[k]) for k in ahead
                           if k in written or replies[k] is not None)
        # The version of each value the task receives, and a new one for each it returns
        # (none for a delta): device-step workers keep partitions by them.
        versions = tuple(behind[k].results[k] if k in behind else trainer.versions.get(k)
                         for k in keys)
        results = {k: None if d else uuid.uuid4().hex for k, d in zip(keys, deltas)}
        # A partition's pending gradients go to the first task that trains it next (one
        # that follows a task in flight on it gets none: that one applies them).
        pending = {k: tuple(self.pending[k]) for k in keys
                   if self.pending.get(k) and k not in self.in_flight}
        work = BucketWork(
            bucket, self.edge_path, self.position, trainer.num_relation_ids, tuple(keys),
            tuple(deltas), warmup_s=trainer.warm_up.seconds(
                self.position.iteration, keys,
                before=previous.keys if previous is not None else ()),
            # The following bucket's edges are read while this one trains, if it has any.
            following=following if following is not None
            and self.edge_counts[following] > 0 else None,
            versions=versions, results=tuple(results.values()))
        ahead_versions = tuple(self.in_flight[k].results[k] if k in written
                               else trainer.versions.get(k) for k, _ in read_ahead)
        refs = submit_bucket(config, work, trainer.params.get.remote(), leases, trainer.known,
                             self.disk_plan(keys, following, following_keys, followed,
                                            read_ahead, ahead_versions),
                             previous.refs.delta if previous is not None else None,
                             self.beyond(bucket, keys), pending)
        task = Launched(bucket, keys, deltas, refs, leases, following, followed, t_start,
                        results, {k: len(g) for k, g in pending.items()},
                        taken_over=frozenset(behind))
        self.in_flight.update((k, task) for k in keys)
        return task

    def beyond(self, bucket: Bucket, keys: List[PartitionKey]) -> Dict[str, BeyondBucket]:
        """Per partitioned entity type of the bucket, beyond_bucket_negs rows drawn
        uniformly over its partitions (draw_beyond, from the bucket's seed) from what their
        stores hold now: read-only copies, whose gradients come back from the task
        (BucketRefs.drawn) to be applied later (`pending`). Left out: the partitions a
        task in flight took over from the one before it (disk placement): their newest
        values are in that task's worker alone, and its store would wait for a file that
        is not written until the task ends."""
        config, trainer = self.config, self.trainer
        if not config.beyond_bucket_negs:
            return {}
        rng = np.random.default_rng(task_seed(config, self.position.iteration, bucket))
        taken_over = {k for k, task in self.in_flight.items() if k in task.taken_over}
        drawn = {}
        for entity in dict.fromkeys(e for e, _ in keys if config.entities[e].num_partitions > 1):
            sizes = {p: n for p, n in enumerate(trainer.entity_counts[entity])
                     if (entity, p) not in taken_over}
            offsets = draw_beyond(sizes, config.beyond_bucket_negs, rng)
            if not offsets:
                continue
            refs = [trainer.store_of[entity, p].rows.remote((entity, p), o)
                    for p, o in offsets.items()]
            drawn[entity] = BeyondBucket(
                np.concatenate(ray.get(refs)),
                np.concatenate([np.full(len(o), p) for p, o in offsets.items()]),
                np.concatenate(list(offsets.values())), sizes)
        return drawn

    def apply_pending(self) -> None:
        """The pass has ended: the gradients no task applied go to the partitions' stores
        (before the checkpoint), in the order they came."""
        trainer = self.trainer
        applied = [trainer.store_of[k].apply_row_gradients.remote(k, g, self.position,
                                                                     trainer.known)
                   for k, g in self.pending.items() if g]
        if applied:
            get_results(applied, wait_all=True)
        self.pending.clear()

    def disk_plan(self, keys: List[PartitionKey], following: Optional[Bucket],
                  following_keys: List[PartitionKey], followed: bool,
                  read_ahead: Tuple[Tuple[PartitionKey, Any], ...],
                  ahead_versions: Tuple[Optional[str], ...]) -> DiskPlan:
        """What the task does besides its bucket (see DiskPlan): what the following bucket
        trains is held for it on the worker instead of written (see hand_over.HandOver)
        when its task follows this one; with one trainer, whose next buckets all run on
        that worker, also what else the worker's buffer keeps for them (written once the
        buffer drops it)."""
        return DiskPlan(
            read_ahead, tuple(self.next_use(following)),
            frozenset(k for k in following_keys if k in keys) if followed else frozenset(),
            tuple(k[1] for k in following_keys)
            if self.max_trainers == 1 and following is not None else None, ahead_versions)

    def next_use(self, following: Optional[Bucket]) -> List[int]:
        """The partitions a trainer's next buckets need, in the order they first need
        them, `following` first (disk placement only)."""
        if not self.read_ahead:
            return []
        upcoming = ([following] if following is not None else []) + [
            b for b in self.plan if b not in self.launched and b != following]
        return parts_by_next_use(upcoming)

    def follow(self, task: Launched) -> None:
        """Submit the task of `task`'s following bucket now, behind it (see launch)."""
        if task.followed:
            task.successor = self.launch(task.following, previous=task)

    def sent(self, task: Launched) -> None:
        """The task's partitions are no longer in flight with it."""
        for key in task.keys:
            if self.in_flight.get(key) is task:
                del self.in_flight[key]

    # --- what the pass reports ------------------------------------------------

    def record(self, bucket: Bucket, stats: BucketStats) -> None:
        """The bucket's training_stats.json line, and the progress bar's figures."""
        self.sums = add_stats(self.sums, stats.train)
        self.stats.append({**self.position.stats_keys(), "lhs_partition": bucket.lhs,
                           "rhs_partition": bucket.rhs,
                           "index": self.bucket_index + len(self.stats), **stats.line()})
        rate = self.sums["count"] / (time.perf_counter() - self.t_start)
        self.bar.set_postfix(edges_per_s=f"{rate:.3g}", loss=f"{self.mean_loss():.4g}")
        for name, count in stats.partition_io.items():
            self.io[name] = self.io.get(name, 0) + count
        self.bar.update(1)

    def mean_loss(self) -> float:
        return stats_mean([self.sums]).get("loss", float("nan")) if self.sums else float("nan")

    def report(self) -> None:
        """Close the bar; without a terminal a line per pass."""
        self.bar.close()
        io_text = (f", {self.io['reads']} partition reads, {self.io['writes']} writes"
                   if self.io else "")
        if self.trainer.progress and self.bar.disable and self.stats:
            rate = self.sums["count"] / (time.perf_counter() - self.t_start)
            print(f"{self.position}: {len(self.stats)} buckets, {rate:.3g} edges/s, loss "
                  f"{self.mean_loss():.4g}{io_text}", file=sys.stderr, flush=True)
        elif self.io:
            logger.info("%s:%s", self.position, io_text[1:])
