"""Evaluation on Ray: PBG's sampled metrics with one task per bucket; filtered full ranking
with one task per partition gathering the rows the edges name, then one task per candidate
partition (or a few, for the CPUs) ranking every bucket's edges against it; the driver adds
them up.

Partitions reach the tasks as ObjectRefs (zero-copy numpy): the trainer's partition
stores during training, or load tasks reading any checkpoint version
(`checkpoint_partitions`) for `python -m pbg_ray.eval`. In disk placement each task reads
the partitions it needs from the checkpoint itself, so that no table is ever whole in memory.
The driver imports no torch: the tasks import the scoring code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import ray

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.sources import CheckpointSource, Partition, resolved, resolved_rows
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.filtered import (
    QUERY_BLOCK, GatheredRows, KnownEdges, buckets_rank_counts, check_rankable, filter_buckets,
    read_known, relation_groups)
from pbg_ray.evaluation.metrics import (
    ALL, SampledNegatives, add_stats, format_table, rank_stats, sampled_stats, stats_mean)
from pbg_ray.io.edges import check_edges, count_edges, edges_file, read_edges
from pbg_ray.io.entities import load_entity_counts, load_relation_names, num_relation_ids
from pbg_ray.model.native import release_free_heap
from pbg_ray.model.params import (
    ModelParams, params_from_checkpoint, partition_key, partition_keys)
from pbg_ray.runtime.budget import (
    DRIVER, MIB, RAY_PROCESSES, TASK_WORKER, MemoryBudget, MemoryPlan)
from pbg_ray.runtime.connect import (
    check_cpus_per_trainer, check_plan_fits, connect_ray, local_task_slots)
from pbg_ray.runtime.tasks import TASK_RUNTIME_ENV, get_results, on_task_threads
from pbg_ray.types import SIDES, Bucket

PartitionKey = Tuple[str, int]
logger = logging.getLogger("pbg_ray")

# What an evaluation task holds besides partitions and known edges: its query chunk's
# edges, score blocks and ranks.
TASK_SCRATCH = 64 * MIB
# Bytes per known edge of a filtered-ranking task: the edges (3 int64) and, for the side
# it ranks, their sorted keys and ids (2 int64).
KNOWN_EDGE_BYTES = 40


@dataclass(frozen=True)
class RankJob:
    """A share of a filtered-ranking task: query chunk `chunk_idx` of `num_chunks` of a
    bucket's edges, ranked against candidate partition `cand_part`, the edges of
    `filter_paths` left out of the ranks."""

    bucket: Bucket
    edge_path: str
    chunk_idx: int
    num_chunks: int
    cand_part: int
    filter_paths: Tuple[str, ...]


@ray.remote(runtime_env=TASK_RUNTIME_ENV)
def gather_rows_task(config: ConfigSchema, key: PartitionKey, offsets: np.ndarray,
                     partition: Partition) -> GatheredRows:
    """The rows at `offsets` (sorted, unique) of one partition: what the ranking tasks
    need of it as queries and positives."""
    return GatheredRows(offsets, np.ascontiguousarray(resolved_rows(config, key, partition, offsets)))


@ray.remote(runtime_env=TASK_RUNTIME_ENV)
@release_free_heap
@on_task_threads
def filtered_rank_task(config: ConfigSchema, jobs: List[RankJob], num_rel: int,
                       keys: List[PartitionKey], gathered_keys: List[PartitionKey],
                       params: ModelParams, *arrays: Any
                       ) -> List[Tuple[np.ndarray, Dict[str, np.ndarray]]]:
    """Per job (all of one candidate partition), (relation ids [E], per side the counts
    [E] of the candidate partition) of its query chunk (see evaluation.filtered). arrays:
    the candidate partitions of `keys`, read once for every job, then the GatheredRows of
    `gathered_keys`: the rows the jobs' edges name in the other partitions."""
    import torch

    from pbg_ray.evaluation.scoring import Scorer

    partitions = resolved(config, keys, arrays[:len(keys)])
    tables: Dict[PartitionKey, Any] = dict(zip(gathered_keys, arrays[len(keys):]))
    with warnings.catch_warnings():  # the arrays are read-only and nothing writes them
        warnings.simplefilter("ignore", UserWarning)
        tables.update({k: torch.from_numpy(e) for k, (e, _) in zip(keys, partitions)})
    scorer = Scorer(config, params.arrays)
    entity_counts = load_entity_counts(config)
    known_of: Dict[Tuple[str, int], KnownEdges] = {}  # (side, other part): its filter buckets
    shares = []
    for job in jobs:
        bucket, cand_part = job.bucket, job.cand_part
        edges = read_edges(job.edge_path, bucket, job.chunk_idx, job.num_chunks)
        known: Dict[str, Optional[KnownEdges]] = {}
        for side, other_part in (("rhs", bucket.lhs), ("lhs", bucket.rhs)) if job.filter_paths else ():
            # Partitions past 0 only rank partitioned types: a side without any has no
            # bucket file there.
            if cand_part == 0 or _partitioned(config, side):
                if (side, other_part) not in known_of:
                    known_of[side, other_part] = read_known(
                        config, list(job.filter_paths),
                        filter_buckets(config, side, other_part, cand_part), entity_counts,
                        num_rel)
                known[side] = known_of[side, other_part]
        shares.append((bucket, edges, known))
    counts = buckets_rank_counts(scorer, shares, jobs[0].cand_part, tables)
    return [(edges.rel, job_counts) for (_, edges, _), job_counts in zip(shares, counts)]


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
    (evaluation.metrics). A partition read from a checkpoint is read by rows: only those
    of the bucket's edges and their uniform negatives."""
    from pbg_ray.model.kernel import PartitionRows

    edges = read_edges(edge_path, bucket)
    tables = {key: _by_rows(config, key, p) if isinstance(p, CheckpointSource)
              else resolved(config, [key], [p])[0] for key, p in zip(keys, partitions)}
    counts: Dict[str, Dict[int, int]] = {}
    for (entity, part), table in tables.items():
        counts.setdefault(entity, {})[part] = (table.size if isinstance(table, PartitionRows)
                                               else len(table[0]))
    check_edges(edges, bucket, config, counts, num_relation_ids,
                f"edge file {edge_path}/edges_{bucket.lhs}_{bucket.rhs}.h5")
    return sampled_stats(config, bucket, edges, tables, params,
                         negatives=negatives, per_relation=per_relation, seed=seed)


def _by_rows(config: ConfigSchema, key: PartitionKey, source: CheckpointSource) -> Any:
    """A checkpoint partition as the kernel's PartitionRows: read by rows, or whole in one
    read where most rows are needed."""
    from pbg_ray.model.kernel import PartitionRows

    def read(offsets: Optional[np.ndarray]) -> np.ndarray:
        if offsets is None:
            return source.load(config, key)[0]
        return source.load_rows(config, key, offsets)
    return PartitionRows(source.size(key), read)


def _partitioned(config: ConfigSchema, side: str) -> bool:
    return any(config.entities[getattr(r, side)].num_partitions > 1 for r in config.relations)


class Evaluator:
    """Evaluates edge paths with the model held in Ray's object store.

    partitions: (entity type, partition) -> ref to (embeddings [N, D], sums), or in disk
    placement the source that a task reads it from;
    params: ref to the ModelParams."""

    def __init__(self, config: ConfigSchema, partitions: Mapping[PartitionKey, ray.ObjectRef],
                 params: ray.ObjectRef, num_rel: int) -> None:
        self.config = config
        self.partitions = partitions
        self.params = params
        self.num_rel = num_rel
        self.nparts_lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
        self.nparts_rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)

    def _buckets(self, edge_path: str) -> List[Tuple[Bucket, int]]:
        """(bucket, edge count) of the non-empty buckets of edge_path."""
        buckets = [Bucket(l, r) for l in range(self.nparts_lhs) for r in range(self.nparts_rhs)]
        return [(b, n) for b in buckets for n in [count_edges(edge_path, b)] if n]

    def _options(self) -> Dict[str, Any]:
        return {"num_cpus": self.config.ray.task_cpus()}

    def sampled(self, edge_path: str, negatives: SampledNegatives, per_relation: bool,
                seed: int = 0) -> Dict[Any, Dict]:
        """PBG's sampled metrics against `negatives` as summed stats: {ALL: stats,
        relation id: stats, ...}."""
        tasks = []
        for bucket, _ in self._buckets(edge_path):
            keys = partition_keys(self.config, bucket)
            tasks.append(evaluate_bucket_task.options(**self._options()).remote(
                self.config, bucket, edge_path, self.num_rel, keys, self.params,
                *[self.partitions[k] for k in keys], negatives=negatives,
                per_relation=per_relation, seed=seed))
        total: Dict[Any, Dict] = {}
        for stats in get_results(tasks):
            for key, value in stats.items():
                total[key] = add_stats(total.get(key), value)
        return total

    def filtered_ranks(self, edge_path: str, filter_paths: Sequence[str]
                       ) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        """(relation ids [E], per side the filtered ranks [E]) of every edge of edge_path:
        the rows its edges name gathered once per partition, then per candidate partition
        a task or a few (enough for every CPU) ranking every bucket's edges against it,
        so that each partition is read about twice whatever the number of buckets."""
        config = self.config
        buckets = self._buckets(edge_path)
        if not buckets:
            return np.empty(0, np.int64), {side: np.empty(0, np.int64) for side in SIDES}
        gathered = self._gather(edge_path, [b for b, _ in buckets])
        cand_parts = range(config.num_partitions())
        cpus = ray.cluster_resources().get("CPU", 1) / config.ray.task_cpus()
        groups = max(1, math.ceil(cpus / len(cand_parts)))
        per_bucket = max(1, math.ceil(groups / len(buckets)))
        chunks = {b: max(1, min(per_bucket, n // QUERY_BLOCK)) for b, n in buckets}
        tasks = []
        for cand_part in cand_parts:
            keys = list(dict.fromkeys(partition_key(config, getattr(r, side), cand_part)
                                      for side in SIDES for r in config.relations))
            jobs = [RankJob(b, edge_path, c, chunks[b], cand_part, tuple(filter_paths))
                    for b, _ in buckets for c in range(chunks[b])]
            for group in (jobs[i::groups] for i in range(min(groups, len(jobs)))):
                named = sorted({k for job in group for k in partition_keys(config, job.bucket)
                                if k not in keys and k in gathered})  # what edges name
                tasks.append((group, filtered_rank_task.options(**self._options()).remote(
                    config, group, self.num_rel, keys, named, self.params,
                    *[self.partitions[k] for k in keys], *[gathered[k] for k in named])))
        ranks: Dict[Any, Tuple[np.ndarray, Dict[str, np.ndarray]]] = {}
        for (group, _), results in zip(tasks, get_results([ref for _, ref in tasks])):
            for job, (rel, counts) in zip(group, results):
                _, acc = ranks.setdefault((job.bucket, job.chunk_idx), (rel, {
                    side: np.ones(len(rel), np.int64) for side in SIDES}))
                for side in SIDES:
                    acc[side] += counts[side]
        order = [(b, c) for b, _ in buckets for c in range(chunks[b])]
        return (np.concatenate([ranks[w][0] for w in order]),
                {side: np.concatenate([ranks[w][1][side] for w in order]) for side in SIDES})

    def _gather(self, edge_path: str, buckets: Sequence[Bucket]) -> Dict[PartitionKey, Any]:
        """Per partition the edges of edge_path name, a ref to their rows (GatheredRows)."""
        config = self.config
        counts = load_entity_counts(config)
        wanted: Dict[PartitionKey, List[np.ndarray]] = {}
        for bucket in buckets:
            edges = read_edges(edge_path, bucket)
            check_edges(edges, bucket, config, counts, self.num_rel,
                        f"edge file {edge_path}/edges_{bucket.lhs}_{bucket.rhs}.h5")
            for relation, idx in relation_groups(config, edges.rel):
                rconf = config.relations[relation]
                for side, part in zip(SIDES, bucket):
                    key = partition_key(config, getattr(rconf, side), part)
                    wanted.setdefault(key, []).append(getattr(edges, side)[idx])
        return {key: gather_rows_task.options(**self._options()).remote(
            config, key, np.unique(np.concatenate(ids)), self.partitions[key])
            for key, ids in wanted.items()}


def filtered_stats(rel: np.ndarray, ranks: Mapping[str, np.ndarray], hits_at: Sequence[int],
                   per_relation: bool) -> Dict[Any, Dict]:
    """Filtered metrics of both sides' ranks as summed stats: {ALL: ..., relation id: ...}."""
    both = np.concatenate([ranks["lhs"], ranks["rhs"]])
    rel2 = np.concatenate([rel, rel])
    result = {ALL: rank_stats(both, hits_at)}
    if per_relation:
        for r in np.unique(rel):
            result[int(r)] = rank_stats(both[rel2 == r], hits_at)
    return result


@ray.remote(runtime_env=TASK_RUNTIME_ENV)
def load_partition_task(path: str, version: int, entity: str, part: int
                        ) -> Tuple[np.ndarray, np.ndarray]:
    """(embeddings [N, D], empty sums) of a checkpoint partition: evaluation never updates,
    so the optimizer state stays on disk."""
    embs, _ = CheckpointManager(path).read_partition(version, entity, part)
    return embs, np.zeros(0, np.float32)


def checkpoint_partitions(config: ConfigSchema, checkpoint: CheckpointManager, version: int,
                          num_rel: int) -> Tuple[Dict[PartitionKey, Any], ray.ObjectRef]:
    """(what each task gets per partition, params ref) of checkpoint `version` in
    `checkpoint`. Memory placement: refs of partitions that load tasks put in the object
    store (never through the driver). Disk placement: their sources, so that each task reads
    the partitions it needs itself and memory holds only those of the tasks in flight."""
    arrays, optim_state = checkpoint.read_model(version)
    params = ray.put(params_from_checkpoint(config, num_rel, arrays, optim_state,
                                            where=str(checkpoint.model_file(version))))
    keys = [(e, p) for e, c in config.entities.items() for p in range(c.num_partitions)]
    if config.ray.placement == "disk":
        return {key: CheckpointSource(str(checkpoint.path), version) for key in keys}, params
    refs = {key: load_partition_task.remote(str(checkpoint.path), version, *key) for key in keys}
    return refs, params


def evaluation_plan(config: ConfigSchema, counts: Mapping[str, Sequence[int]],
                    filter_edges: int, query_edges: int, tasks: int) -> MemoryPlan:
    """What an evaluation holds at its peak: in memory placement every partition's
    embeddings in the object store (never the optimizer state); per task, in disk placement
    the candidate partition it reads (one per entity type), and for filtered ranking the
    rows of the query edges it ranks (both sides) and the known edges of the filter
    buckets of its candidate partition (filter_edges spread over the partitions)."""
    rows = lambda e: [n * config.entity_dimension(e) * 4 for n in counts[e]]  # noqa: E731
    nparts = max(c.num_partitions for c in config.entities.values())
    dim = max(config.entity_dimension(e) for e in config.entities)
    per_task = (TASK_SCRATCH + 2 * KNOWN_EDGE_BYTES * filter_edges // nparts
                + 2 * dim * 4 * query_edges)
    placement = config.ray.placement
    if placement == "disk":
        table = 0
        per_task += sum(max(rows(e), default=0) for e in config.entities)
    else:
        table = sum(sum(rows(e)) for e in config.entities)
    return MemoryPlan("this evaluation", placement, table, per_task, tasks,
                      RAY_PROCESSES + DRIVER + tasks * TASK_WORKER)


def check_evaluation_fits(config: ConfigSchema, edge_paths: Sequence[str],
                          filter_paths: Sequence[str]) -> None:
    """Refuse an evaluation on the local Ray whose plan exceeds the memory budget, naming
    what would fit (runtime.connect.check_plan_fits)."""
    counts = load_entity_counts(config)
    nparts = {side: max(config.entities[getattr(r, side)].num_partitions
                        for r in config.relations) for side in SIDES}
    edges_of = lambda paths: sum(  # noqa: E731
        count_edges(path, Bucket(lhs, rhs)) for path in paths
        for lhs in range(nparts["lhs"]) for rhs in range(nparts["rhs"])
        if edges_file(path, Bucket(lhs, rhs)).is_file())
    filter_edges = edges_of(filter_paths)
    query_edges = edges_of(edge_paths) if filter_paths else 0
    tasks = local_task_slots(config.ray)

    def fix(budget: MemoryBudget) -> str:
        fits = lambda placement, n: evaluation_plan(  # noqa: E731
            dataclasses.replace(config, ray=dataclasses.replace(config.ray, placement=placement)),
            counts, filter_edges, query_edges, n).total <= budget.bytes
        one_task = f"ray.num_cpus={config.ray.task_cpus():g} (one task at a time)"
        ways = []
        if config.ray.placement == "memory" and fits("disk", tasks):
            ways.append("set ray.placement=disk (each task reads the partitions it ranks from "
                        "the checkpoint)")
        elif config.ray.placement == "memory" and fits("disk", 1):
            ways.append(f"set ray.placement=disk and {one_task}")
        elif tasks > 1 and fits(config.ray.placement, 1):
            ways.append(f"set {one_task}")
        return "; or ".join(ways + [
            "split the entities into more partitions, or give it more memory "
            "(ray.memory_budget states it in bytes where the detected limit is wrong)"])

    check_plan_fits(config.ray, evaluation_plan(config, counts, filter_edges, query_edges, tasks),
                    fix)


def _unique(paths: Sequence[str]) -> List[str]:
    return list(dict.fromkeys(paths))


def evaluate_checkpoint(config: ConfigSchema) -> Dict[str, Any]:
    """Evaluate `config.eval` (see EvalConfig) on its checkpoint version, with the model it
    was trained with (CheckpointManager.with_trained_model); returns the report (also
    appended to <checkpoint_path>/eval_stats.json) with metric means."""
    config = config.checked()
    settings = config.eval
    checkpoints = CheckpointManager(config.checkpoint_path)
    located, version = checkpoints.locate(config, settings.version, "eval.version")
    config = located.with_trained_model(config, version)
    edge_paths = _unique(settings.edge_paths or config.eval_edge_paths or config.edge_paths)
    trained = [path for path in edge_paths if path in config.edge_paths]
    if trained:
        logger.warning("eval scores edges the model was trained on (edge_paths %s)%s: their "
                       "metrics say how well it fits them, not how it generalizes. Set "
                       "eval.edge_paths=[<held-out edges>] to evaluate held-out edges.",
                       ", ".join(trained), "" if settings.edge_paths or config.eval_edge_paths
                       else ", as neither eval.edge_paths nor eval_edge_paths is set")
    filter_paths = (_unique(config.edge_paths + config.eval_edge_paths + settings.edge_paths)
                    if settings.filter_paths is None else _unique(settings.filter_paths))
    if not (settings.sampled or settings.filtered):
        raise PbgRayError("eval.sampled and eval.filtered are both false: nothing to compute. "
                          "Set at least one of them to true.")
    if settings.filtered:
        check_rankable(config)
    num_rel = num_relation_ids(config)
    check_evaluation_fits(config, edge_paths, filter_paths if settings.filtered else ())
    start = time.perf_counter()
    connect_ray(config.ray)
    check_cpus_per_trainer(config.ray)
    sampled: Dict[Any, Dict] = {}
    filtered: Dict[Any, Dict] = {}
    counts: Dict[Any, int] = {}
    evaluator = Evaluator(config, *checkpoint_partitions(config, located, version, num_rel),
                          num_rel)
    negatives = SampledNegatives.of_edge_paths(config)
    for path in edge_paths:
        if settings.sampled:
            for key, stats in evaluator.sampled(path, negatives, settings.per_relation,
                                                settings.seed).items():
                sampled[key] = add_stats(sampled.get(key), stats)
        if settings.filtered:
            rel, ranks = evaluator.filtered_ranks(path, filter_paths)
            per_path = filtered_stats(rel, ranks, settings.hits_at, settings.per_relation)
            for key, stats in per_path.items():
                filtered[key] = add_stats(filtered.get(key), stats)
    for key in set(sampled) | set(filtered):  # edges: filtered ranks two queries per edge
        counts[key] = filtered[key]["count"] // 2 if key in filtered else sampled[key]["count"]
    names = (load_relation_names(config.entity_path) if config.dynamic_relations
             else [r.name for r in config.relations])
    metrics = {}
    for key in sorted(set(sampled) | set(filtered), key=lambda k: (k != ALL, k if k != ALL else -1)):
        row: Dict[str, Any] = {"count": counts.get(key, 0)}
        if key in sampled:
            row["sampled"] = stats_mean([sampled[key]])
        if key in filtered:
            row["filtered"] = stats_mean([filtered[key]])
        metrics[ALL if key == ALL else names[key]] = row
    report = {"checkpoint_path": str(located.path), "version": version, "edge_paths": edge_paths,
              "training_edge_paths": trained,
              "sampled_negatives": negatives.to_report() if settings.sampled else None,
              "filter_paths": filter_paths if settings.filtered else None,
              "metrics": metrics, "time_s": round(time.perf_counter() - start, 3)}
    checkpoints.append_eval_stats(json.dumps(report) + "\n")
    return report


def print_report(report: Mapping[str, Any]) -> None:
    """The table, then the report as one JSON line."""
    trained = ", ".join(report["training_edge_paths"])
    print(f"checkpoint {report['checkpoint_path']} version {report['version']}, edge paths "
          f"{', '.join(report['edge_paths'])}{f' (trained on: {trained})' if trained else ''}")
    negatives = report["sampled_negatives"]
    if negatives is not None:
        print("s. = PBG's sampled metrics, as torchbiggraph_eval's: each edge against "
              f"{SampledNegatives.of_report(negatives).describe()}")
    print("f. = filtered full ranking against every entity of the type")
    print(format_table(report["metrics"]))
    print(json.dumps(report))
