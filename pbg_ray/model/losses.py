"""Loss functions with their analytic gradients (PBG's ranking, logistic and softmax).

Each side of a batch has positive scores `pos` [n, C] (n chunks of C edges) and its
negative scores split over one or more blocks [n, C, N_k] (e.g. the shared batch block and
the uniform block), so that no concatenated copy is ever made. `weight` [n, C] multiplies
each edge's loss: relation weight x per-edge weight, and 0 for the padding rows of the last
chunk. `num_neg` is the total number of negative columns, masked ones included (the
logistic loss divides by it, like PBG's).

`forward_backward` returns (loss, dpos, dblocks), the gradient of each block written into
`out` (one tensor per block, of its shape): the block itself when the caller no longer needs
the scores, else a reusable buffer, so no large tensor is allocated per batch.

`rows` is the same loss in the device step's layout (model.device_step): scores
[2, n, C, K] hold both sides' rows at once, each row's positive on the diagonal of its
chunk's [C, C] block and its negatives in every other column; it adds each row's loss into
an accumulator, returns the scores' gradient (the diagonal holding the positives'), and
never reads a value back to the host.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pbg_ray.model.blas import sgemm_address
from pbg_ray.model.native import c_ready, extension
from pbg_ray.model.operators import StepOperator
from pbg_ray.model.registry import Registry

_loss = extension("_loss")

Result = Tuple[Tensor, Tensor, List[Tensor]]


def _native_blocks(pos: Tensor, blocks: List[Tensor], *more: Tensor) -> bool:
    """Whether _loss.c can take these: built, all float32 on the CPU,
    pos contiguous, each block contiguous along its columns or its rows."""
    return (_loss is not None and len(blocks) <= 4
            and all(t.device.type == "cpu" and t.dtype == torch.float32
                    for t in (pos, *blocks, *more))
            and pos.is_contiguous() and all(1 in (b.stride(1), b.stride(2)) for b in blocks))


def _native_softmax(pos: Tensor, blocks: List[Tensor], weight: Tensor, out: List[Tensor]) -> bool:
    """Whether the C softmax (_loss.c) can serve: _native_blocks, weight contiguous, and
    each block's gradient buffer laid out like it."""
    return (_native_blocks(pos, blocks, weight, *out) and weight.is_contiguous()
            and all(o.stride() == b.stride() for b, o in zip(blocks, out)))


def _c_blocks(blocks: List[Tensor], out: List[Tensor]) -> List[Tuple[int, ...]]:
    """The non-empty blocks as _loss.c takes them: (in, out, columns, strides)."""
    return [(b.data_ptr(), o.data_ptr(), b.shape[2], *b.stride())
            for b, o in zip(blocks, out) if b.shape[2]]


def count_violators(pos: Tensor, blocks: List[Tensor], valid_rows: int) -> Optional[int]:
    """PBG's violators of a batch side: the scores of `blocks` [chunks, C, N] above their
    row's positive score in `pos` [chunks, C], over the first `valid_rows` rows (the rest
    pad the last chunk), counted in one C pass (_loss.c); None where that cannot serve."""
    if not _native_blocks(pos, blocks):
        return None
    return _loss.violators(pos.data_ptr(), pos.shape[0], pos.shape[1], valid_rows,
                           _c_blocks(blocks, blocks))


def dot_softmax_ready(u: Tensor, v: Tensor) -> bool:
    """Whether dot_softmax_step can serve the rows u and v: _loss.c built, numpy's BLAS an
    ILP64 OpenBLAS, and both contiguous float32 on the CPU."""
    return _loss is not None and sgemm_address() is not None and c_ready((u, v))


def dot_softmax_step(u: Tensor, v: Tensor, du: Tensor, dv: Tensor, weight: Tensor,
                     chunk_size: int, num_pos: int, op: Optional[StepOperator] = None
                     ) -> Tuple[float, int, int]:
    """The dot comparator's scores and the softmax loss of a batch of one relation whose
    sides both have batch negatives and the same number of uniform ones, with their
    gradients, in one C call that runs chunk by chunk (_loss.c, dot_softmax_step): u, v
    [chunks, C + U, D] the lhs and rhs rows (each chunk's positives, then its uniform
    negatives; padding rows zero), weight [chunks, C]. Writes the rows' gradients du and
    dv (contiguous, of u's shape) and returns (loss, violators lhs, violators rhs). With
    op (the relation's operator, Operator.in_step), v holds the rhs rows before it and dv
    gets their gradient through it; the step writes the parameters' gradients (op.grads)."""
    n, k, d = u.shape
    return _loss.dot_softmax_step(sgemm_address(), u.data_ptr(), v.data_ptr(), du.data_ptr(),
                                  dv.data_ptr(), weight.data_ptr(), n, chunk_size,
                                  k - chunk_size, d, num_pos, None if op is None else op.args())


def count_at_least(scores: Tensor, pos: Tensor, counts: Tensor) -> bool:
    """counts [B] (int64) += per row of scores [B, N] the entries at or above the row's
    positive pos [B], in one C pass (_loss.c); False, and nothing counted, where that
    cannot serve (not built, or not float32 rows contiguous on the CPU)."""
    if not (_loss is not None and scores.device.type == pos.device.type == "cpu"
            and scores.dtype == pos.dtype == torch.float32 and scores.stride(1) == 1
            and pos.is_contiguous() and counts.dtype == torch.int64 and counts.is_contiguous()):
        return False
    _loss.at_least(scores.data_ptr(), scores.stride(0), scores.shape[0], scores.shape[1],
                     pos.data_ptr(), counts.data_ptr())
    return True


class Loss:
    name: str

    def __init__(self, margin: float) -> None:
        self.margin = margin

    def forward_backward(self, pos: Tensor, blocks: List[Tensor], weight: Tensor,
                         num_neg: int, out: List[Tensor]) -> Result:
        raise NotImplementedError

    def rows(self, scores: Tensor, weight: Optional[Tensor], inv_num_neg: Tensor,
             loss_sum: Tensor) -> Tensor:
        """The device layout's loss (module docstring): adds each row's loss times its
        weight into loss_sum [2, n, C] and returns the gradient [2, n, C, K]. weight:
        [.., n, C] (relation x edge weight, 0 on padding rows), or None where every row
        weighs 1 (padding rows then carry a masked score that zeroes their loss: see
        model.device_step); inv_num_neg [2, 1, 1]: 1 / each side's number of negatives
        (masked ones included, as PBG counts them), 0 for a side without."""
        raise NotImplementedError


def _diagonal(t: Tensor) -> Tensor:
    """The positives' entries of a [2, n, C, K] tensor of rows: [2, n, C] (a view)."""
    return t.diagonal(0, 2, 3)


LOSS_FUNCTIONS: Registry[Loss] = Registry("loss_fn")


def _no_loss(pos: Tensor, out: List[Tensor]) -> Result:
    # PBG returns a constant 0 when there are no negatives (ranking, softmax).
    return pos.new_zeros(()), torch.zeros_like(pos), [o.zero_() for o in out]


@LOSS_FUNCTIONS.register("ranking")
class RankingLoss(Loss):
    """sum_j max(0, margin - pos_i + neg_ij)."""

    def forward_backward(self, pos, blocks, weight, num_neg, out):
        if num_neg == 0:
            return _no_loss(pos, out)
        shift = (self.margin - pos).unsqueeze(-1)
        w = weight.unsqueeze(-1)
        unit = bool((weight == 1).all())  # the common case: skip a pass over each block
        loss = pos.new_zeros(())
        dpos = torch.zeros_like(pos)
        grads = []
        for block, o in zip(blocks, out):
            hinge = torch.add(block, shift, out=o).clamp_min_(0)
            loss += (hinge.sum(-1) * weight).sum()
            grad = hinge.sign_()  # d/d neg = weight where the hinge is active
            if not unit:
                grad.mul_(w)
            dpos -= grad.sum(-1)
            grads.append(grad)
        return loss, dpos, grads

    def rows(self, scores, weight, inv_num_neg, loss_sum):
        hinge = torch.sub(scores, _diagonal(scores).unsqueeze(-1)).add_(self.margin).clamp_min_(0)
        _diagonal(hinge).zero_()  # the positive against itself
        if weight is None:
            loss_sum.add_(hinge.sum(-1))
        else:
            loss_sum.addcmul_(hinge.sum(-1), weight)
        grad = hinge.sign_()
        if weight is not None:
            grad.mul_(weight.unsqueeze(-1))
        _diagonal(grad).sub_(grad.sum(-1))
        return grad


@LOSS_FUNCTIONS.register("logistic")
class LogisticLoss(Loss):
    """softplus(-pos_i) + mean_j softplus(neg_ij) (binary cross-entropy with logits)."""

    def forward_backward(self, pos, blocks, weight, num_neg, out):
        loss = (F.softplus(-pos) * weight).sum()
        dpos = torch.sigmoid(pos).sub_(1).mul_(weight)
        if not num_neg:
            return loss, dpos, [o.zero_() for o in out]
        w = (weight / num_neg).unsqueeze(-1)
        grads = []
        for block, o in zip(blocks, out):
            loss += (F.softplus(block).sum(-1) * w.squeeze(-1)).sum()
            grads.append(torch.sigmoid(block, out=o).mul_(w))
        return loss, dpos, grads

    def rows(self, scores, weight, inv_num_neg, loss_sum):
        # weight is never None here: a padding row's negatives would count.
        pos = _diagonal(scores)
        soft = F.softplus(scores)
        soft_pos = _diagonal(soft)  # softplus(-pos) = softplus(pos) - pos
        negatives = (soft.sum(-1) - soft_pos).mul_(inv_num_neg)
        loss_sum.addcmul_(negatives.add_(soft_pos).sub_(pos), weight)
        grad = torch.sigmoid(scores).mul_((weight * inv_num_neg).unsqueeze(-1))
        _diagonal(grad).copy_(torch.sigmoid(pos).sub_(1).mul_(weight))
        return grad


@LOSS_FUNCTIONS.register("softmax")
class SoftmaxLoss(Loss):
    """-log softmax of the positive among [pos_i, neg_i*] (PBG: cross-entropy of
    [pos, logsumexp(neg)]). On the CPU one C call (_loss.c) where it is built."""

    def forward_backward(self, pos, blocks, weight, num_neg, out):
        if num_neg == 0:
            return _no_loss(pos, out)
        if _native_softmax(pos, blocks, weight, out):
            dpos = torch.empty_like(pos)
            loss = _loss.softmax(
                pos.data_ptr(), weight.data_ptr(), dpos.data_ptr(), pos.shape[0], pos.shape[1],
                _c_blocks(blocks, out))
            return pos.new_tensor(loss), dpos, out
        top = pos.clone()
        for block in blocks:
            if block.shape[-1]:
                torch.maximum(top, block.amax(-1), out=top)
        shift = top.unsqueeze(-1)
        total = (pos - top).exp_()
        exps = []
        for block, o in zip(blocks, out):
            e = torch.sub(block, shift, out=o).exp_()
            total += e.sum(-1)
            exps.append(e)
        log_total = total.log()
        loss = ((top + log_total - pos) * weight).sum()
        scale = weight / total
        dpos = (pos - top).exp_().mul_(scale).sub_(weight)
        grads = [e.mul_(scale.unsqueeze(-1)) for e in exps]
        return loss, dpos, grads

    def rows(self, scores, weight, inv_num_neg, loss_sum):
        # Cross-entropy of each row against its diagonal (PBG's [pos, logsumexp(neg)]: the
        # masked self it puts among the negatives adds exp(-1e9) = 0).
        log_p = torch.log_softmax(scores, -1)
        if weight is None:
            loss_sum.sub_(_diagonal(log_p))
        else:
            loss_sum.addcmul_(_diagonal(log_p), weight, value=-1)
        grad = log_p.exp_()
        if weight is None:
            _diagonal(grad).sub_(1)
        else:
            grad.mul_(weight.unsqueeze(-1))
            _diagonal(grad).sub_(weight)
        return grad
