"""training_stats.json (PBG's JSON-lines layout) turned into figures per bucket and per epoch.

One line per bucket and pass: epoch_idx, edge_path_idx, edge_chunk_idx, lhs_partition,
rhs_partition, index (the bucket's position in the whole run) and PBG stats
({"count", "metrics"}) under "stats" (training: loss, reg, violators_lhs/rhs) and
"eval_stats_before" / "eval_stats_after" (the bucket's held-out edges, eval_fraction:
pos_rank, mrr, r1, r10, r50, auc), as per-edge means with the edge count, in both
torchbiggraph's and pbg_ray's files (pbg_ray's lines also carry "timing"), so the plots
and logs work for checkpoints of either program, or of a run one resumed from the other.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple

from pbg_ray.evaluation.metrics import Stats, stats_mean

TRAIN = "stats"
HELD_OUT = "eval_stats_after"  # the held-out edges, scored after the bucket trained


def as_sums(count: int, means: Dict[str, float]) -> Stats:
    """Per-edge means over `count` edges as summed stats (what stats_mean weighs)."""
    return {"count": count, "metrics": {k: v * count for k, v in means.items()}}


def summed(line: Dict[str, Any], key: str) -> Optional[Stats]:
    """The line's `key` stats as sums over edges; None if absent or empty."""
    stats = line.get(key)
    if not stats or not stats.get("count"):
        return None
    return as_sums(stats["count"], stats["metrics"])


def bucket_means(lines: Iterable[Dict[str, Any]], key: str) -> List[Tuple[int, Dict[str, float]]]:
    """(index, per-edge means of `key`) of every bucket line that has them, in index order."""
    points = [(line["index"], summed(line, key)) for line in lines]
    return sorted((index, stats_mean([s])) for index, s in points if s is not None)


def epoch_means(lines: Iterable[Dict[str, Any]], key: str) -> Dict[int, Dict[str, float]]:
    """{epoch_idx: edge-weighted means of `key` over the epoch's buckets}, in epoch order."""
    by_epoch: Dict[int, List[Stats]] = defaultdict(list)
    for line in lines:
        stats = summed(line, key)
        if stats is not None:
            by_epoch[line["epoch_idx"]].append(stats)
    return {epoch: stats_mean(by_epoch[epoch]) for epoch in sorted(by_epoch)}
