"""Negative sampling as PBG defines it.

A batch of B positives is cut into chunks of `chunk_size` edges (the last one padded).
Per side, the negatives of a chunk are, by mode:
  BATCH_UNIFORM  the chunk's own positives on that side (C = num_batch_negs) plus
                 num_uniform_negs entities drawn uniformly from the side's partition,
                 shared by the chunk;
  UNIFORM        (num_batch_negs = 0) only the uniform draws, with chunks of num_uniform_negs;
  ALL            (relation.all_negs) every entity of the partition, one chunk;
  NONE           (disable_lhs_negs / disable_rhs_negs) no negatives.
Scores a positive gets against itself (the chunk diagonal, or its own id under ALL) and
against padding are masked to -1e9, as in PBG; featurized entities only have batch
negatives.

Negatives from beyond the bucket (beyond_bucket_negs, docs/quality.md): besides those, a
side scores a uniform sample of the rows of its type's other partitions (BeyondBucket,
drawn per bucket by the driver from the partitions' current values), read-only copies
whose gradients are dropped; under softmax each such score gets log(rows of those
partitions / rows drawn) added (the sampled softmax's correction).
"""

from __future__ import annotations

import enum
import dataclasses
import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.errors import PbgRayError

MASKED_SCORE = -1e9


class Negatives(enum.Enum):
    NONE = "none"
    UNIFORM = "uniform"
    BATCH_UNIFORM = "batch_uniform"
    ALL = "all"


def negative_modes(num_pos: int, all_negs: bool, num_batch_negs: int, num_uniform_negs: int,
                   disabled: Tuple[bool, bool], featurized: Tuple[bool, bool]
                   ) -> Tuple[int, Tuple[Negatives, Negatives]]:
    """(chunk_size, (lhs mode, rhs mode)) for a batch of num_pos edges of one relation."""
    if all_negs:
        chunk_size, mode = num_pos, Negatives.ALL
    elif num_batch_negs == 0:
        if num_uniform_negs == 0:
            raise PbgRayError("num_batch_negs and num_uniform_negs are both 0: there are no "
                              "negatives to train against. Set at least one of them above 0.")
        chunk_size, mode = num_uniform_negs, Negatives.UNIFORM
    else:
        chunk_size, mode = num_batch_negs, Negatives.BATCH_UNIFORM
    modes = tuple(Negatives.NONE if off else mode for off in disabled)
    for side, m, feat in zip(("lhs", "rhs"), modes, featurized):
        if feat and m in (Negatives.ALL, Negatives.UNIFORM):
            raise PbgRayError(f"the {side} entity type is featurized, and featurized entities "
                              "can only get batch negatives: set num_batch_negs above 0 and "
                              "all_negs=false for its relations.")
    return chunk_size, modes  # type: ignore[return-value]


def num_uniform(mode: Negatives, num_uniform_negs: int, featurized: bool) -> int:
    """Uniform negatives drawn per chunk on a side in `mode`."""
    if mode is Negatives.UNIFORM or (mode is Negatives.BATCH_UNIFORM and not featurized):
        return num_uniform_negs
    return 0


def sample_uniform(num_entities: int, num_chunks: int, count: int,
                   generator: torch.Generator) -> Tensor:
    """Uniform negative ids [num_chunks, count] from a partition of num_entities."""
    return torch.randint(num_entities, (num_chunks, count), generator=generator)


def mask_batch_block(block: Tensor, last_chunk_size: int) -> None:
    """Mask a [chunks, C, C] batch-negative block (may be a view): each positive against
    itself, and, in the last chunk, pairs with padding rows or columns."""
    block.diagonal(dim1=1, dim2=2).fill_(MASKED_SCORE)
    block[-1, :, last_chunk_size:] = MASKED_SCORE
    block[-1, last_chunk_size:, :] = MASKED_SCORE


def mask_own_ids(block: Tensor, ids: Tensor) -> None:
    """Under ALL negatives: mask each positive's score against its own entity.
    block [1, P, N] (P >= len(ids)), ids [B]."""
    block[0, torch.arange(len(ids), device=ids.device), ids] = MASKED_SCORE


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
        return BeyondRows(torch.from_numpy(np.ascontiguousarray(self.rows[keep])),
                          math.log(population / len(keep)))


@dataclasses.dataclass(frozen=True)
class BeyondRows:
    """What a batch side scores from beyond its bucket: rows [S, D] and log_weight, the
    log of the inverse rate they were drawn at (added to their scores under softmax)."""

    rows: Tensor
    log_weight: float

