"""Negatives from beyond the bucket (beyond_bucket_negs, docs/quality.md): besides its own
negatives, a side scores a uniform sample of the rows of its type's other partitions
(BeyondBucket, drawn per bucket by the driver from the partitions' current values),
read-only copies whose gradients are dropped; under softmax each such score gets log(rows
of those partitions / rows drawn) added (the sampled softmax's correction). numpy only:
the driver draws them without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

import numpy as np


def draw_beyond(sizes: Dict[int, int], count: int, rng: np.random.Generator
                ) -> Dict[int, np.ndarray]:
    """A uniform sample, without replacement, of `count` rows (or every row, if fewer) of
    the partitions sized `sizes`: per partition the sorted offsets drawn from it."""
    parts = sorted(sizes)
    bounds = np.cumsum([0] + [sizes[p] for p in parts])
    drawn = np.sort(rng.choice(int(bounds[-1]), min(count, int(bounds[-1])), replace=False))
    cuts = np.searchsorted(drawn, bounds)
    return {p: drawn[cuts[i]:cuts[i + 1]] - bounds[i] for i, p in enumerate(parts)
            if cuts[i + 1] > cuts[i]}


@dataclasses.dataclass(frozen=True)
class BeyondBucket:
    """An entity type's rows drawn for a bucket's negatives from beyond it (draw_beyond
    over all its partitions): rows [S, D] float32, read-only copies; partitions [S] each
    row's partition; sizes: every partition's row count."""

    rows: np.ndarray
    partitions: np.ndarray
    sizes: Dict[int, int]

    def for_side(self, own: int) -> Optional["BeyondRows"]:
        """The rows a side whose own partition is `own` scores: those of the other
        partitions (its own are its negatives already), with the log of the rate they
        were drawn at (None if none were drawn)."""
        keep = np.flatnonzero(self.partitions != own)
        if not len(keep):
            return None
        population = sum(n for p, n in self.sizes.items() if p != own)
        return BeyondRows(np.ascontiguousarray(self.rows[keep]),
                          math.log(population / len(keep)))


@dataclasses.dataclass(frozen=True)
class BeyondRows:
    """What a batch side scores from beyond its bucket: rows [S, D] and log_weight, the
    log of the inverse rate they were drawn at (added to their scores under softmax)."""

    rows: np.ndarray
    log_weight: float
