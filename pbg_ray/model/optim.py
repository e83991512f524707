"""Optimizers, as update functions on raw tensors (no torch.optim objects in the hot loop).

Row-wise Adagrad (PBG's RowAdagrad) keeps one accumulator per embedding row; Adagrad
(torch.optim.Adagrad with PBG's settings) one per parameter element. Both are exact
re-implementations of those steps, so training matches PBG update for update.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pbg_ray.model import rows

# torch.optim.Adagrad's default eps, which RowAdagrad hard-codes too.
EPS = 1e-10


def row_adagrad_(table: Tensor, sums: Tensor, ids: Tensor, grads: Tensor, lr: float,
                 owner: Tensor, known: int = 0, known_scale: float = 1.0) -> None:
    """One RowAdagrad step on the rows `ids` [n] (duplicates allowed) of table [N, D]
    with gradients grads [n, D] (overwritten), accumulators sums [N]. Rows below `known`
    step at lr * known_scale; known_scale 0 leaves them and their accumulators untouched.

    Duplicate rows are folded without sort/unique: every position writes its index into
    `owner` (scratch, int64 [N], one per worker) and reads back the winner (whichever
    write landed), so all occurrences of a row agree on one representative position.
    On the CPU the same steps run as one C loop (pbg_ray/model/_rows.c).
    """
    if rows.native((table, sums, grads), (ids, owner)):
        rows.row_adagrad_(table, sums, ids, grads, lr, owner, known, known_scale)
        return
    if known and known_scale == 0:
        new = (ids >= known).nonzero().squeeze(1)
        ids, grads = ids.index_select(0, new), grads.index_select(0, new)
    if ids.numel() == 0:
        return
    position = torch.arange(ids.numel(), device=ids.device)
    owner.index_copy_(0, ids, position)
    rep = owner.index_select(0, ids)
    dup = (rep != position).nonzero().squeeze(1)
    if dup.numel():
        # Fold each duplicate into its representative and zero it: a zero gradient leaves
        # both its accumulator and its row unchanged, so no compaction is needed.
        grads.index_add_(0, rep[dup], grads[dup])
        grads.index_fill_(0, dup, 0)
    sums.index_add_(0, ids, torch.linalg.vector_norm(grads, dim=1).square_().div_(grads.shape[1]))
    step = sums.index_select(0, ids).sqrt_().add_(EPS).reciprocal_().mul_(-lr)
    if known and known_scale != 1:
        step.mul_(torch.where(ids < known, known_scale, 1.0))
    table.index_add_(0, ids, grads.mul_(step.unsqueeze(1)))


def adagrad_(param: Tensor, sums: Tensor, grad: Tensor, lr: float,
             row_scale: Optional[Tensor] = None) -> None:
    """One torch.optim.Adagrad step (lr_decay=0, weight_decay=0, eps=1e-10). row_scale:
    a multiplier of lr per index of the first dimension [param.shape[0]]; where it is 0,
    the entries and their accumulators are left untouched."""
    if row_scale is not None:
        scale = row_scale.view((-1,) + (1,) * (grad.dim() - 1))
        grad = torch.where(scale > 0, grad, 0.0)  # +0.0: x - lr * 0 / d is exactly x
        sums.addcmul_(grad, grad)
        param.addcdiv_(grad * scale, sums.sqrt().add_(EPS), value=-lr)
        return
    if rows.native((param, sums, grad), ()) and param.numel() == grad.numel() == sums.numel():
        rows.adagrad_(param, sums, grad, lr)  # the same steps as one C loop (_rows.c)
        return
    sums.addcmul_(grad, grad)
    param.addcdiv_(grad, sums.sqrt().add_(EPS), value=-lr)
