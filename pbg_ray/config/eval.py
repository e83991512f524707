"""The `eval` section of the config: what `python -m pbg_ray.eval` evaluates and how."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class EvalConfig:
    """`python -m pbg_ray.eval`: sampled and filtered metrics of a checkpoint."""

    # Checkpoint version; null: the newest (older ones from epoch_{k}/ snapshots).
    version: Optional[int] = None
    # Edges to rank; empty: eval_edge_paths, or edge_paths when that is empty too.
    edge_paths: List[str] = field(default_factory=list)
    # Known true edges removed from the candidates of filtered ranking; null: every
    # edge of edge_paths, eval_edge_paths and eval.edge_paths; []: raw full ranking.
    filter_paths: Optional[List[str]] = None
    # PBG's sampled metrics (eval_num_batch_negs / eval_num_uniform_negs negatives).
    sampled: bool = True
    # Full ranking against every entity of the type, on both sides.
    filtered: bool = True
    # Metrics of each relation besides the overall ones.
    per_relation: bool = True
    # Cut-offs of the filtered hits@k.
    hits_at: List[int] = field(default_factory=lambda: [1, 3, 10])
    # Seed of the sampled metrics' uniform negatives and AUC draws.
    seed: int = 0
