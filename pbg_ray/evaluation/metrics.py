"""Ranks to metrics, PBG's sampled metrics per relation, and the printed report.

Tie rule, the same everywhere (PBG's, from torchbiggraph's RankingEvaluator): a candidate
whose score is >= the positive's counts as ranked above it, so

    rank = 1 + #{candidates c other than the true entity (and, filtered, the known true
                 edges) : score(c) >= score(true)}

Ties cost the positive (the pessimistic rank), in the sampled metrics and in filtered
ranking alike. The positive's score is c(query, true candidate) computed for the pair,
the candidates' scores come from the all-pairs matrix, as in PBG.

Metrics travel as PBG's stats layout, sums over ranked items: {"count", "metrics"}; means
are taken once at the end (stats_mean).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.model.params import ModelParams
from pbg_ray.types import Bucket, EdgeList

Stats = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SampledNegatives:
    """The negatives each positive of PBG's sampled metrics is ranked against: `batch`
    from the other edges of its chunk and `uniform` drawn from its partition (`keys`: the
    config keys that set them), except on the relations with all_negs (`all_negs`, by
    name), ranked against every entity of the partition instead. `describe` names them
    for every figure that reports them."""

    batch: int
    uniform: int
    keys: Tuple[str, str] = ("num_batch_negs", "num_uniform_negs")
    all_negs: Tuple[str, ...] = ()
    every_relation_all_negs: bool = False

    @classmethod
    def of_edge_paths(cls, config: ConfigSchema) -> "SampledNegatives":
        """Those of an edge path's evaluation (python -m pbg_ray.eval), as
        torchbiggraph_eval scores them: num_batch_negs and num_uniform_negs."""
        return cls(config.num_batch_negs, config.num_uniform_negs,
                   ("num_batch_negs", "num_uniform_negs"), *all_negs_relations(config))

    @classmethod
    def of_held_out(cls, config: ConfigSchema) -> "SampledNegatives":
        """Those of held-out edges during training, as PBG's trainer scores them:
        eval_num_batch_negs and eval_num_uniform_negs."""
        return cls(config.eval_num_batch_negs, config.eval_num_uniform_negs,
                   ("eval_num_batch_negs", "eval_num_uniform_negs"), *all_negs_relations(config))

    @classmethod
    def of_report(cls, report: Mapping[str, Any]) -> "SampledNegatives":
        """The negatives a report names (to_report's)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in report.items()})

    def to_report(self) -> Dict[str, Any]:
        """The fields as a report's JSON holds them (lists for tuples), so that a report
        returned equals the line eval_stats.json keeps of it."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    def describe(self) -> str:
        """What the figures were ranked against: "50 batch + 100 uniform negatives
        (num_batch_negs, num_uniform_negs)", the all_negs relations' said apart, or "every
        entity of the partition (all_negs)" where every relation has all_negs."""
        every = "every entity of the partition (all_negs)"
        if self.every_relation_all_negs:
            return every
        sampled = (f"{self.batch} batch + {self.uniform} uniform negatives "
                   f"({', '.join(self.keys)})")
        if not self.all_negs:
            return sampled
        return f"{sampled}; relations {', '.join(self.all_negs)}: {every}"


def all_negs_relations(config: ConfigSchema) -> Tuple[Tuple[str, ...], bool]:
    """(the names of the relations with all_negs, whether that is every relation)."""
    names = tuple(r.name for r in config.relations if r.all_negs)
    return names, len(names) == len(config.relations)


SAMPLED_METRICS = ("pos_rank", "mrr", "r1", "r10", "r50", "auc")
ALL = "all"  # the key of the overall metrics, next to relation names


def rank_stats(ranks: np.ndarray, hits_at: Sequence[int]) -> Stats:
    """Filtered metrics of ranks [Q] (int, >= 1) as sums: mr, mrr, hits@k."""
    ranks = np.asarray(ranks, np.float64)
    metrics = {"mr": float(ranks.sum()), "mrr": float((1.0 / ranks).sum())}
    for k in hits_at:
        metrics[f"hits@{k}"] = float((ranks <= k).sum())
    return {"count": len(ranks), "metrics": metrics}


def add_stats(a: Optional[Stats], b: Stats) -> Stats:
    """Sum of two stats in PBG's layout (a may be None)."""
    if a is None:
        return {"count": b["count"], "metrics": dict(b["metrics"])}
    return {"count": a["count"] + b["count"],
            "metrics": {k: a["metrics"][k] + b["metrics"][k] for k in a["metrics"]}}


def average(stats: Stats) -> Stats:
    """Summed stats as PBG writes them to training_stats.json (its Stats.average()): the
    count and the per-edge means."""
    count = stats["count"]
    return {"count": count,
            "metrics": {k: v / count for k, v in stats["metrics"].items()} if count else dict(stats["metrics"])}


def stats_mean(stats: List[Dict[str, Any]]) -> Dict[str, float]:
    """Edge-weighted means of summed PBG stats ({"count", "metrics"})."""
    count = sum(s["count"] for s in stats)
    if count == 0:
        return {}
    names = stats[0]["metrics"].keys()
    return {name: sum(s["metrics"][name] for s in stats) / count for name in names}


def sampled_stats(config: ConfigSchema, bucket: Bucket, edges: EdgeList,
                  partitions: Mapping, params: ModelParams, *, negatives: SampledNegatives,
                  per_relation: bool, seed: int = 0) -> Dict[Any, Stats]:
    """PBG's sampled metrics of one bucket's edges against `negatives`: {ALL: stats} plus,
    with per_relation, {relation id: stats}.

    Per-relation mode: PBG batches each relation's edges on their own anyway, so each
    relation is evaluated alone and ALL is their sum. Dynamic mode batches mix relations,
    so only ALL is computed (per-relation figures come from filtered ranking).

    The edges are taken in torchbiggraph's order, so that batch negatives come from the
    same chunks as torchbiggraph_eval's: per-relation mode groups a bucket's edges by
    torch.sort of their relation ids, which is not stable (a relation's edges come in the
    order it leaves them).

    The kernel (and torch) is imported here, in the task that evaluates: drivers import
    this module for its sums and tables."""
    import torch

    from pbg_ray.model.kernel import evaluate_bucket

    if not config.dynamic_relations:
        edges = edges[torch.from_numpy(edges.rel).sort()[1].numpy()]
    counts = {"num_batch_negs": negatives.batch, "num_uniform_negs": negatives.uniform}
    if config.dynamic_relations or not per_relation:
        return {ALL: evaluate_bucket(config, bucket, edges, partitions, params, seed=seed,
                                     **counts)}
    result: Dict[Any, Stats] = {}
    for rel in np.unique(edges.rel):
        idx = np.flatnonzero(edges.rel == rel)
        result[int(rel)] = evaluate_bucket(config, bucket, edges[idx], partitions, params,
                                           seed=seed, **counts)
        result[ALL] = add_stats(result.get(ALL), result[int(rel)])
    return result


def format_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A text table: one row per key of `rows` (ALL first), one column per metric.
    rows: name -> {"count": edges, "sampled": means or absent, "filtered": means or absent}."""
    columns: List[str] = []
    for row in rows.values():
        for kind in ("sampled", "filtered"):
            for metric in row.get(kind, {}):
                name = f"{kind[0]}.{metric}"
                if name not in columns:
                    columns.append(name)
    width = max([len("relation")] + [len(str(n)) for n in rows])
    header = f"{'relation':<{width}}  {'edges':>8}  " + "  ".join(f"{c:>9}" for c in columns)
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        values = {f"{kind[0]}.{m}": v for kind in ("sampled", "filtered")
                  for m, v in row.get(kind, {}).items()}
        cells = [f"{values[c]:>9.4g}" if c in values else f"{'-':>9}" for c in columns]
        lines.append(f"{name:<{width}}  {row['count']:>8}  " + "  ".join(cells))
    return "\n".join(lines)
