"""Model selection while training (the `validation` section of the config).

The validation edges are ranked after every `validation.every` epochs (and after the last
one) with the embeddings just trained, before their version is committed: the validation's
line in training_stats.json, the figures in the version's metadata and, when it is the
best so far, its copy in best/ land with the version. After `validation.patience`
validations without a better one, training stops (early stopping). What the validations so
far say is read back from training_stats.json, so a resumed run knows its best version and
how many validations ago it came.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from pbg_ray.checkpoints.position import Position
from pbg_ray.config import ConfigSchema
from pbg_ray.config.model_selection import ValidationConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import Evaluator, filtered_stats
from pbg_ray.evaluation.metrics import ALL, SampledNegatives, stats_mean
from pbg_ray.io.edges import count_edges
from pbg_ray.types import Bucket

logger = logging.getLogger("pbg_ray")

FILTERED, SAMPLED = "filtered", "sampled"
HITS_AT = (1, 3, 10)
# A validation metric's name among PBG's sampled metrics (which have no hits@3).
SAMPLED_NAMES = {"mrr": "mrr", "hits@1": "r1", "hits@10": "r10"}


@dataclass(frozen=True)
class Validation:
    """The validation after `epoch` epochs (1-based) of the version they made."""

    epoch: int
    version: int
    ranking: str  # FILTERED or SAMPLED
    metric: str  # validation.metric
    value: float  # that metric's value
    metrics: Dict[str, float]  # every metric of the ranking, means over the queries

    def stats_line(self, position: Position) -> Dict[str, Any]:
        """Its line in training_stats.json: the pass's position keys, as PBG's lines of
        per-chunk eval stats have them, and the validation."""
        return {**position.stats_keys(), "validation": dataclasses.asdict(self)}

    def metadata(self) -> Dict[str, Any]:
        """Its attributes in the metadata of its version's files."""
        return {"validation/ranking": self.ranking, "validation/metric": self.metric,
                "validation/value": self.value}

    def describe(self) -> str:
        return (f"{self.ranking} {self.metric} {self.value:.4f} (version {self.version}, "
                f"epoch {self.epoch})")


@dataclass(frozen=True)
class ModelSelection:
    """What the validations of a run say so far."""

    settings: ValidationConfig
    history: Tuple[Validation, ...] = ()

    @classmethod
    def of_stats(cls, settings: ValidationConfig, lines: Iterable[Mapping[str, Any]],
                 version: int) -> "ModelSelection":
        """From the validation lines among training_stats.json's `lines` of versions up to
        `version` (the current one; those of an interrupted run's unfinished one go) on
        settings.metric (a rerun that changed it compares like with like)."""
        validations = (Validation(**line["validation"]) for line in lines if "validation" in line)
        return cls(settings, tuple(v for v in validations
                                   if v.version <= version and v.metric == settings.metric))

    @property
    def best(self) -> Optional[Validation]:
        """The best validation so far (the earliest among equals)."""
        return max(self.history, key=lambda v: v.value, default=None)

    def due(self, position: Position) -> bool:
        """Whether the validation edges are ranked after the pass at `position`."""
        epoch = position.epoch_idx + 1
        return bool(self.settings.edge_paths) and position.last_of_epoch and (
            epoch % self.settings.every == 0 or epoch == position.num_epochs)

    def after(self, validation: Validation) -> "ModelSelection":
        return dataclasses.replace(self, history=self.history + (validation,))

    def stopped(self) -> bool:
        """Whether `patience` validations in a row came after the best without beating it."""
        best = self.best
        patience = self.settings.patience
        return (best is not None and patience is not None
                and len(self.history) - 1 - self.history.index(best) >= patience)


def choose_ranking(config: ConfigSchema, buckets: Sequence[Bucket],
                   entity_counts: Mapping[str, List[int]]) -> str:
    """validation.filtered as set, or for null, filtered while 2 x validation edges (in
    `buckets`) x the entities of their types stay within validation.max_filtered_scores.
    Filtered ranking needs embeddings to rank against (no featurized type); sampled metrics
    have no hits@3."""
    settings = config.validation
    featurized = sorted(e for e, c in config.entities.items() if c.featurized)
    filtered = settings.filtered
    if filtered is None:
        edges = sum(count_edges(path, bucket) for path in settings.edge_paths
                    for bucket in buckets)
        candidates = max(sum(entity_counts[t]) for r in config.relations for t in (r.lhs, r.rhs))
        filtered = not featurized and 2 * edges * candidates <= settings.max_filtered_scores
        logger.info("validation ranks %s (validation.filtered=null: %d edges x %d entities x 2 "
                    "sides %s validation.max_filtered_scores%s)", FILTERED if filtered else SAMPLED,
                    edges, candidates, "within" if 2 * edges * candidates <=
                    settings.max_filtered_scores else "over",
                    f"; featurized types {featurized}" if featurized else "")
    if filtered and featurized:
        raise PbgRayError(f"validation.filtered=true ranks against every entity's embedding, and "
                          f"the entity types {featurized} are featurized (bags of features, no "
                          "embedding of their own). Set validation.filtered=null or false.")
    if filtered:
        return FILTERED
    if settings.metric not in SAMPLED_NAMES:
        raise PbgRayError(f"validation.metric={settings.metric} is not among the sampled metrics "
                          f"that validation ranks with here (validation.filtered=false, over "
                          f"validation.max_filtered_scores or featurized types). Set "
                          f"validation.metric to one of {sorted(SAMPLED_NAMES)}, or "
                          f"validation.filtered=true.")
    return SAMPLED


def validate(config: ConfigSchema, evaluator: Evaluator, ranking: str, epoch: int,
             version: int) -> Validation:
    """Rank the validation edges with the embeddings `evaluator` holds."""
    settings = config.validation
    paths = settings.edge_paths
    if ranking == FILTERED:
        filter_paths = list(dict.fromkeys(config.edge_paths + config.eval_edge_paths + paths))
        summed = []
        for path in paths:
            rel, ranks = evaluator.filtered_ranks(path, filter_paths)
            summed.append(filtered_stats(rel, ranks, HITS_AT, per_relation=False)[ALL])
        metrics = stats_mean(summed)
        value = metrics.get(settings.metric, 0.0)
    else:
        negatives = SampledNegatives.of_held_out(config)
        summed = [stats for path in paths
                  for stats in [evaluator.sampled(path, negatives, per_relation=False).get(ALL)]
                  if stats is not None]
        metrics = stats_mean(summed) if summed else {}
        value = metrics.get(SAMPLED_NAMES[settings.metric], 0.0)
    return Validation(epoch, version, ranking, settings.metric, value, metrics)
