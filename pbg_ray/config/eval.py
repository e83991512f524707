"""The `eval` section of the config: what `python -m pbg_ray.eval` evaluates and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from pbg_ray.config.options import each, not_negative, option, positive


@dataclass
class EvalConfig:
    """`python -m pbg_ray.eval`: sampled and filtered metrics of a checkpoint."""

    version: Optional[int] = option(None, check=positive, help=
        "Checkpoint version; null: the best on validation (best/) where training kept one "
        "(validation.edge_paths), else the newest (older ones from epoch_{k}/ snapshots).")
    edge_paths: List[str] = option(factory=list, location=True, help=
        "Edges to rank; empty: eval_edge_paths, or edge_paths when that is empty too.")
    filter_paths: Optional[List[str]] = option(None, location=True, help=
        "Known true edges removed from the candidates of filtered ranking; null: every edge "
        "of edge_paths, eval_edge_paths and eval.edge_paths; []: raw full ranking.")
    sampled: bool = option(True, help=
        "PBG's sampled metrics, as torchbiggraph_eval computes them: each edge ranked "
        "against num_batch_negs batch and num_uniform_negs uniform negatives (held-out edges "
        "during training use eval_num_batch_negs / eval_num_uniform_negs, as PBG's trainer); "
        "a relation with all_negs against every entity of the partition. Eval's report and "
        "train's lines name the negatives used.")
    filtered: bool = option(True, help=
        "Full ranking against every entity of the type, on both sides.")
    per_relation: bool = option(True, help="Metrics of each relation besides the overall ones.")
    hits_at: List[int] = option(factory=lambda: [1, 3, 10], check=each(positive), help=
        "Cut-offs of the filtered hits@k.")
    seed: int = option(0, check=not_negative, help=
        "Seed of the sampled metrics' uniform negatives and AUC draws.")
