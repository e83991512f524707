"""The training driver: decides what runs where; actors hold state, tasks compute.

The loop is PBG's: num_epochs x edge paths x edge chunks passes (checkpoints/position.py);
in each pass every bucket is trained once on its chunk, in the configured bucket order,
several buckets at once when their partitions are disjoint (pass_run.py). After each pass
a checkpoint version is committed (version N = N passes done, as in PBG), so a rerun of
the same command resumes where the last complete version ends; a pass whose actors died
is trained again (failures.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
from ray.exceptions import OwnerDiedError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pbg_ray.checkpoints.directory import checkpoint_metadata
from pbg_ray.checkpoints.legacy import check_init_path, resolve_init_path
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.position import Position
from pbg_ray.checkpoints.sources import CheckpointSource, PartitionSource
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import Evaluator
from pbg_ray.evaluation.metrics import ALL, SampledNegatives, stats_mean
from pbg_ray.incremental.growth import known_rows, neighbor_means
from pbg_ray.io.edges import count_edges
from pbg_ray.io.entities import load_entity_counts, num_relation_ids
from pbg_ray.model.params import PartitionKey
from pbg_ray.runtime.connect import check_cpus_per_trainer, check_task_fits, largest_node
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import discard, get_results, stop_actors
from pbg_ray.training.bucket_sources import InitSource, ModelSource, RandomSource, WriterDied
from pbg_ray.training.bucket_task import gpus_per_trainer, start_trainer_worker, uses_device_step
from pbg_ray.training.failures import FailurePolicy
from pbg_ray.training.memory_plan import fit_local_run
from pbg_ray.training.model_selection import (
    ModelSelection, Validation, choose_ranking, validate)
from pbg_ray.training.parameter_server import ParameterServer
from pbg_ray.training.partition_store import PartitionStore
from pbg_ray.training.pass_run import PassRun
from pbg_ray.training.scheduler import BucketSchedulerActor
from pbg_ray.training.tensorboard import TensorBoardLog
from pbg_ray.training.warm_up import HogwildWarmUp
from pbg_ray.types import Bucket

logger = logging.getLogger("pbg_ray")

@dataclasses.dataclass
class TrainResult:
    checkpoint_path: str
    version: int
    bucket_stats: List[Dict[str, Any]]  # this run's, in training_stats.json's layout
    actor_restarts: int = 0  # passes trained again because an actor died
    best: Optional[Validation] = None  # the best validation, its version kept in best/


class Trainer:
    """One run: its actors, its pass loop and its checkpoints."""

    def __init__(self, config: ConfigSchema) -> None:
        self.config = config = config.checked()
        self.checkpoints = CheckpointManager(config.checkpoint_path)
        self.version = self.checkpoints.resume(config)
        if self.version == 0 and config.init_path:
            check_init_path(config.init_path)
        self.entity_counts = load_entity_counts(config)
        self.config = config = fit_local_run(config, self.entity_counts)
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
        # The validations so far (read again when the run starts) and how they rank.
        self.selection = ModelSelection(config.validation)
        self.ranking = (choose_ranking(config, [Bucket(l, r) for l in range(self.nparts_lhs)
                                                for r in range(self.nparts_rhs)],
                                       self.entity_counts)
                        if config.validation.edge_paths else None)
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
        # Each partition's version (BucketWork.versions): unknown until a task trains it.
        self.versions: Dict[PartitionKey, Optional[str]] = {}
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
        limit = int(resources.get("CPU", 1) // self.config.ray.task_cpus())
        gpus = gpus_per_trainer(self.config)
        if gpus > 0:
            limit = min(limit, int(resources.get("GPU", 0) // gpus))
            if limit == 0:
                raise PbgRayError("GPU training was asked for (num_gpus / ray.gpus_per_trainer) but "
                                  "the Ray cluster has no GPU. Set num_gpus=0 and "
                                  "ray.gpus_per_trainer=0 to train on CPUs.")
        return max(1, min(limit, self.config.num_partitions()))

    def cpus_each(self) -> int:
        """The CPUs each train task can have: the cluster's shared by the tasks that run at
        once (max_trainers), at most a node's, at least 1."""
        cpus = ray.cluster_resources().get("CPU", 1)
        node_cpus = largest_node("CPU") or cpus
        return max(1, int(min(node_cpus, cpus // self.max_trainers())))

    def take_cpus(self) -> None:
        """ray.cpus_per_trainer where the config leaves it null: the CPUs each train task
        can have (cpus_each; 1 where the device step trains, on one thread), said in a line
        where that is more than one; where the config sets it, a warning when the partitions
        leave CPUs idle."""
        ray_config = self.config.ray
        if ray_config.cpus_per_trainer is not None:
            self._warn_idle_cpus()
            return
        cpus = 1 if uses_device_step(self.config) else self.cpus_each()
        self.config = dataclasses.replace(self.config, ray=dataclasses.replace(
            ray_config, cpus_per_trainer=float(cpus)))
        if cpus > 1:
            trainers = self.max_trainers()
            bound = (f"ray.num_trainers={trainers}" if ray_config.num_trainers else
                     f"{self.config.num_partitions()} partition(s)")
            self._say(f"training {trainers} bucket(s) at a time ({bound}), each on {cpus} CPUs "
                      f"({cpus} Hogwild threads): ray.cpus_per_trainer=null shares out the "
                      f"{ray.cluster_resources().get('CPU', 1):g} CPUs there are")

    def _warn_idle_cpus(self) -> None:
        """Say so when the partitions, not the CPUs, bound the train tasks and CPUs stay
        idle: each task trains on int(ray.cpus_per_trainer) Hogwild threads, and the key
        that gives it the rest is named with the value that would."""
        ray_config = self.config.ray
        if ray_config.num_trainers or gpus_per_trainer(self.config) > 0:
            return
        trainers, per_trainer = self.max_trainers(), self.cpus_each()
        if per_trainer > ray_config.cpus_per_trainer:
            logger.warning(
                "%d partition(s) allow %d train task(s) at once; with ray.cpus_per_trainer=%g "
                "they use %g of the %g CPUs. Set ray.cpus_per_trainer=%d (or null) to train "
                "each bucket on that many Hogwild threads.", self.config.num_partitions(),
                trainers, ray_config.cpus_per_trainer, trainers * ray_config.cpus_per_trainer,
                ray.cluster_resources().get("CPU", 1), per_trainer)

    # --- the pass loop ------------------------------------------------------

    def run(self, on_epoch_end: Optional[Callable[[int], None]] = None) -> TrainResult:
        """Train the passes the checkpoint doesn't hold yet. `on_epoch_end(epoch_idx)` is
        called once an epoch's last version is current (Ray Tune reports there)."""
        config = self.config
        start = Position.of(self.version, config.num_epochs, len(config.edge_paths),
                            self.num_chunks)
        self.selection = ModelSelection.of_stats(config.validation, self.checkpoints.read_stats(),
                                                 self.version)
        if self.version >= start.num_passes:
            logger.info("checkpoint %s already holds %d passes; nothing to train",
                        self.checkpoints.path, self.version)
            return TrainResult(str(self.checkpoints.path), self.version, [],
                               best=self.selection.best)
        self.take_cpus()
        # Stats lines of passes that never became current (an interrupted run's) go; the
        # session also removes, whatever ends the run, its unfinished version and swap files.
        completed = lambda line: start.of_stats_line(line).iteration < self.version  # noqa: E731
        with self.checkpoints.session(self.version, completed) as bucket_index, \
                TensorBoardLog(config.tensorboard_dir) as tensorboard:
            all_stats: List[Dict[str, Any]] = []
            self.actor_restarts = 0
            for position in start.passes():
                if self.selection.stopped():
                    self._say(f"stopped early: the last {config.validation.patience} "
                              f"validations did not beat the best, "
                              f"{self.selection.best.describe()}, kept in "
                              f"{self.checkpoints.path / 'best'}")
                    break
                pass_stats = self._train_pass(position, bucket_index)
                bucket_index += len(pass_stats)
                all_stats += pass_stats
                tensorboard.log_buckets(pass_stats)
                if position.last_of_epoch:
                    # From the file: an epoch resumed midway has lines of the earlier run.
                    epoch_idx = position.epoch_idx
                    tensorboard.log_epoch(epoch_idx, [s for s in self.checkpoints.read_stats()
                                                      if s["epoch_idx"] == epoch_idx])
                    if on_epoch_end is not None:
                        on_epoch_end(epoch_idx)
        return TrainResult(str(self.checkpoints.path), self.version, all_stats,
                           self.actor_restarts, self.selection.best)

    def _train_pass(self, position: Position, bucket_index: int) -> List[Dict[str, Any]]:
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
        failures = FailurePolicy()
        while True:
            try:
                self._start_actors()  # inside the try: an actor may die while starting too
                pass_stats = PassRun(self, position, bucket_index).run()
                validation = (validate(self.config, self._evaluator(), self.ranking,
                                       position.epoch_idx + 1, self.version + 1)
                              if self.selection.due(position) else None)
                self._commit(position, pass_stats, validation)
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
                failures.retry(position.iteration, f"the actors of the run in {position}", err)
                what = (f"an actor died ({type(err).__name__})"
                        if isinstance(err, (RayActorError, OwnerDiedError))
                        else f"a swap file's writer died ({err.cause})")
                logger.warning("%s in epoch %d; restarting the actors from checkpoint version "
                               "%d and training the pass again", what, position.epoch_idx + 1,
                               self.version)
                self.actor_restarts += 1
                stop_actors(self.actors)
                self.stores, self.params, self.scheduler = [], None, None
                self.checkpoints.rollback()

    def _commit(self, position: Position, pass_stats: List[Dict[str, Any]],
                validation: Optional[Validation]) -> None:
        """Write version N+1 completely, then make it current (with its validation, if
        one ranked it, and in best/ when it is the best so far), then drop N."""
        config = self.config
        version = self.version + 1
        metadata = checkpoint_metadata(config, position)
        selection = self.selection
        if validation is not None:
            metadata.update(validation.metadata())
            selection = selection.after(validation)
            pass_stats = pass_stats + [validation.stats_line(position)]
        fault_point("driver.before_commit")
        get_results([s.save.remote(version, metadata) for s in self.stores]
                    + [self.params.save.remote(version, metadata)], wait_all=True)
        fault_point("driver.version_written")
        interval = config.checkpoint_preservation_interval
        epoch = position.epoch_idx + 1
        preserve = position.last_of_epoch and interval and epoch % interval == 0
        self.checkpoints.commit(
            version, pass_stats, config, preserve_as_epoch=epoch if preserve else None,
            best=validation is not None and selection.best is validation,
            release=lambda superseded: get_results(
                [s.recycle.remote(superseded) for s in self.stores], wait_all=True))
        if self.init_scratch is not None:  # the stores load from this version now
            shutil.rmtree(self.init_scratch, ignore_errors=True)
            self.init_scratch = None
        self.version = version
        self.selection = selection
        if validation is not None:
            self._say(f"validation after epoch {epoch}: {validation.ranking} "
                      f"{validation.metric} {validation.value:.4f}; best: "
                      f"{selection.best.describe()}")
        fault_point("driver.after_commit")

    def _say(self, line: str) -> None:
        """A line on stderr, beside the passes' lines (not in a Tune trial, which reports
        its own)."""
        if self.progress:
            print(line, file=sys.stderr, flush=True)

    def _evaluator(self) -> Evaluator:
        """An Evaluator of the embeddings the run's actors hold now. In disk placement its
        tasks get where a swapped partition's newest values are and read them themselves,
        so that memory holds those of the tasks in flight, not the table."""
        self._start_actors()
        keys = sorted(self.store_of)
        sources = dict(zip(keys, ray.get([self.store_of[k].source.remote(k) for k in keys])))
        held = [k for k in keys if sources[k] is None]
        refs = ray.get([self.store_of[k].get.remote(k) for k in held])
        partitions = {**sources, **{k: r[0] for k, r in zip(held, refs)}}
        return Evaluator(self.config, partitions, self.params.get.remote(),
                         self.num_relation_ids)

    def evaluate(self, edge_path: str) -> Dict[str, float]:
        """PBG's sampled metrics (mrr, r1, r10, r50, auc, pos_rank) over all the
        edges of `edge_path`, with the current embeddings, against the negatives of
        held-out edges (SampledNegatives.of_held_out); one task per bucket."""
        stats = self._evaluator().sampled(edge_path, SampledNegatives.of_held_out(self.config),
                                          per_relation=False).get(ALL)
        return {"count": stats["count"], **stats_mean([stats])} if stats else {"count": 0}
