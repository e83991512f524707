"""Negatives from beyond the bucket (beyond_bucket_negs, docs/quality.md): besides its own
negatives, a side scores a uniform sample of the rows of its type's other partitions
(BeyondBucket, drawn per bucket by the driver from the partitions' current values); under
softmax each such score gets log(rows of those partitions / rows drawn) added (the
sampled softmax's correction). With beyond_batch_negs each batch scores a sample of its
own of the bucket's rows instead of all of them (BeyondRows.sample). The drawn rows are
read-only copies: their gradients, summed over the bucket's batches (RowGradients), are
applied later, as a delta, by the next task that trains their partition, or at the
pass's end by its store. numpy only: the driver draws them without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

import numpy as np

# torch.optim.Adagrad's eps, as model.optim's RowAdagrad uses it.
EPS = 1e-10


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
    row's partition and offsets [S] its offset there; sizes: every partition's row
    count."""

    rows: np.ndarray
    partitions: np.ndarray
    offsets: np.ndarray
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
                          math.log(population / len(keep)), keep)

    def gradients(self, grads: np.ndarray, squares: np.ndarray) -> Dict[int, "RowGradients"]:
        """Per partition the RowGradients of its drawn rows, from the bucket's sums over
        all rows: grads [S, D] and squares [S] (rows no side scored have zeros)."""
        scored = np.flatnonzero(squares > 0)
        return {int(p): RowGradients(self.offsets[rows], grads[rows], squares[rows])
                for p in np.unique(self.partitions[scored])
                for rows in [scored[self.partitions[scored] == p]]}


@dataclasses.dataclass(frozen=True)
class BeyondRows:
    """What a batch side scores from beyond its bucket: rows [S, D], log_weight, the log
    of the inverse rate they were drawn at (added to their scores under softmax), and
    index [S], the rows' places in their BeyondBucket (where their gradients add up)."""

    rows: np.ndarray
    log_weight: float
    index: np.ndarray

    def sample(self, count: int, rng: np.random.Generator) -> "BeyondRows":
        """`count` of these rows (all, if fewer) drawn uniformly without replacement, in
        their order, log_weight raised to the smaller sample's rate: what one batch scores
        under beyond_batch_negs, so that each batch meets other rows of the bucket's draw."""
        if count >= len(self.index):
            return self
        pick = np.sort(rng.choice(len(self.index), count, replace=False))
        return BeyondRows(self.rows[pick], self.log_weight + math.log(len(self.index) / count),
                          self.index[pick])


@dataclasses.dataclass(frozen=True)
class RowGradients:
    """A bucket's gradients of one partition's rows that it drew from beyond it, to apply
    later as a delta: offsets [S] (unique), grads [S, D], the gradients summed over the
    bucket's batches, and squares [S], per row the sum over batches of the mean square
    of its gradient (what RowAdagrad adds to its accumulator for each)."""

    offsets: np.ndarray
    grads: np.ndarray
    squares: np.ndarray

    def apply(self, embs: np.ndarray, sums: np.ndarray, lr: float, known: int = 0,
              known_scale: float = 1.0) -> None:
        """One RowAdagrad step in place on embs [N, D] and sums [N] with the bucket's
        summed gradients, after adding all its batches' squares to the accumulators.
        Rows below `known` step at lr * known_scale (0: left alone with their sums)."""
        offsets, grads, squares = self.offsets, self.grads, self.squares
        if known and known_scale == 0:
            new = offsets >= known
            offsets, grads, squares = offsets[new], grads[new], squares[new]
        sums[offsets] += squares
        step = -lr / (np.sqrt(sums[offsets]) + EPS)
        if known and known_scale != 1:
            step *= np.where(offsets < known, known_scale, 1.0)
        embs[offsets] += grads * step[:, None].astype(np.float32)
