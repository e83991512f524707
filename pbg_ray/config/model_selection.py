"""The `validation` section of the config: validation edges ranked during training, early
stopping, and the best version kept (training/model_selection.py does the work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from pbg_ray.config.options import one_of, option, positive

# What a validation can be judged on: the filtered ranking's (or the sampled metrics') MRR
# or hits@k.
VALIDATION_METRICS = ("mrr", "hits@1", "hits@3", "hits@10")


@dataclass
class ValidationConfig:
    """Model selection on validation edges while training."""

    edge_paths: List[str] = option(factory=list, location=True, help=
        "Validation edges, ranked after every `every` epochs (and after the last one) with "
        "the embeddings just trained; the version that ranks them best is kept in "
        "<checkpoint_path>/best/ and is what eval, predict and export read by default. "
        "Empty: no validation.")
    every: int = option(1, check=positive, help="Epochs between two validations.")
    metric: str = option("mrr", check=one_of(VALIDATION_METRICS), help=
        "What the best version is chosen on: mrr, hits@1, hits@3 or hits@10.")
    filtered: Optional[bool] = option(None, help=
        "Filtered ranking against every entity of the type (true), or PBG's sampled metrics "
        "against eval_num_batch_negs + eval_num_uniform_negs negatives (false); null: "
        "filtered while that takes at most max_filtered_scores scores, else sampled. The "
        "choice is stated in the log and in each validation line of training_stats.json.")
    max_filtered_scores: float = option(2e10, check=positive, help=
        "validation.filtered=null ranks filtered while 2 x validation edges x the entities "
        "of their types stays at most this.")
    patience: Optional[int] = option(None, check=positive, help=
        "Validations in a row without a better one after which training stops (early "
        "stopping); null: every epoch of num_epochs is trained.")
