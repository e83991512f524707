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

Negatives from beyond the bucket (beyond_bucket_negs): model/beyond.py.
"""

from __future__ import annotations

import enum
from typing import Tuple

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


