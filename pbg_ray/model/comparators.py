"""Comparators: the score of a (lhs, rhs) pair of prepared vectors, with hand-written gradients.

Shapes: vectors [..., D]; `pos(q, k)` scores matching rows -> [...]; `matrix(Q, K)` scores
all pairs of each chunk, Q [n, P, D] x K [n, N, D] -> [n, P, N]. Comparators are symmetric,
so matrix(K, Q) is matrix(Q, K) transposed (the kernel relies on it to share the
batch-negative block between the two sides).

`matrix_backward(Q, K, S, G)` maps the gradient G [n, P, N] of the scores S to gradients of
Q and K. It is linear in G (the kernel sums both sides' G before calling it) and may
overwrite G. Comparators with `needs_scores` read S there; the others never do, so the
loss may turn S into G in place.

The batched products go through `bmm`: the CPU kernel's numpy BLAS (blas.bmm) by default;
a comparator made `for_device` uses torch.bmm, writes the gradients into given tensors
where it can, and never reads a value back to the host (the device step, model.device_step).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from pbg_ray.model.blas import bmm
from pbg_ray.model.registry import Registry

# PBG clamps squared distances to this before the square root (and so has no gradient there).
_MIN_SQUARED_DIST = 1e-30
_MAX_CLAMPED_SCORE = -1.0000001e-15  # l2 scores at or above this were clamped


class Comparator:
    name: str
    needs_scores = False
    # Whether pos(q, k) is matrix's entry for the pair, with the gradient matrix_backward
    # gives that entry: then a kernel whose matrix scores each positive pair (on a
    # diagonal) reads the positives there and adds their gradients there.
    pos_in_matrix = False
    # The batched product, and whether the comparator may read values on the host to skip
    # work (the CPU kernel) or must never (the device step: make_comparator(for_device=True)).
    bmm = staticmethod(bmm)
    host_checks = True

    def prepare(self, x: Tensor) -> Tuple[Tensor, Any]:
        """Per-vector preparation before comparing (e.g. normalization): (y, ctx for backward)."""
        return x, None

    def prepare_backward(self, ctx: Any, dy: Tensor) -> Tensor:
        return dy

    def pos(self, q: Tensor, k: Tensor) -> Tensor:
        raise NotImplementedError

    def pos_backward(self, q: Tensor, k: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def matrix(self, q: Tensor, k: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """All-pairs scores [n, P, N], written into `out` if given (a reused buffer)."""
        raise NotImplementedError

    def matrix_backward(self, q: Tensor, k: Tensor, s: Tensor, g: Tensor,
                        out: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
        """(dQ, dK), written into out = (dQ, dK) if given."""
        raise NotImplementedError


COMPARATORS: Registry[Comparator] = Registry("comparator")


@COMPARATORS.register("dot")
class DotComparator(Comparator):
    pos_in_matrix = True

    def pos(self, q, k):
        return (q * k).sum(-1)

    def pos_backward(self, q, k, g):
        g = g.unsqueeze(-1)
        return g * k, g * q

    def matrix(self, q, k, out=None):
        return self.bmm(q, k.transpose(1, 2), out)

    def matrix_backward(self, q, k, s, g, out=None):
        dq, dk = (None, None) if out is None else out
        return self.bmm(g, k, dq), self.bmm(g.transpose(1, 2), q, dk)


@COMPARATORS.register("cos")
class CosComparator(DotComparator):
    """Dot product of L2-normalized vectors (normalized once, in prepare)."""

    def prepare(self, x):
        rnorm = x.norm(dim=-1, keepdim=True).reciprocal_()
        y = x * rnorm
        return y, (y, rnorm)

    def prepare_backward(self, ctx, dy):
        y, rnorm = ctx
        return (dy - y * (y * dy).sum(-1, keepdim=True)).mul_(rnorm)


def _augment(x: Tensor, *columns: Tensor) -> Tensor:
    """x [..., D] with extra columns appended, zero-padded to a multiple of 8 wide (an odd
    inner dimension leaves the bmm's vector lanes part empty and slows it down)."""
    width = x.shape[-1] + len(columns)
    pad = x.new_zeros(*x.shape[:-1], -width % 8)
    return torch.cat([x, *columns, pad], dim=-1)


def _expanded_bmm(bmm, q: Tensor, k: Tensor, scale: float, sign: float,
                  out: Optional[Tensor]) -> Tensor:
    """sign * (|q_i|^2 + |k_j|^2) + scale * q_i.k_j for all pairs of each chunk, [n, P, N],
    from one bmm of vectors augmented with their squared norms and ones (no extra passes
    over the large score matrix)."""
    q2 = q.pow(2).sum(-1, keepdim=True)
    k2 = k.pow(2).sum(-1, keepdim=True)
    qa = _augment(q, q2.mul_(sign), torch.ones_like(q2))
    ka = _augment(k * scale, torch.ones_like(k2), k2.mul_(sign))
    return bmm(qa, ka.transpose(1, 2), out)


def _squared_dist_backward(bmm, q: Tensor, k: Tensor, h: Tensor, scale: float = 2.0,
                           out: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """Gradients of sum_ij h_ij * (-|q_i - k_j|^2) * scale / 2 w.r.t. q and k:
    scale (h k - rowsum(h) q) and scale (h^T q - colsum(h) k). A column of ones appended
    to k and q makes the bmm's produce the row and column sums too (no passes over h)."""
    d = q.shape[-1]
    hk = bmm(h, _augment(k, torch.ones_like(k[..., :1])))
    hq = bmm(h.transpose(1, 2), _augment(q, torch.ones_like(q[..., :1])))
    dq = hk[..., :d].sub_(hk[..., d:d + 1] * q).mul_(scale)
    dk = hq[..., :d].sub_(hq[..., d:d + 1] * k).mul_(scale)
    return _into(out, dq, dk)


def _into(out: Optional[Tuple[Tensor, Tensor]], dq: Tensor, dk: Tensor) -> Tuple[Tensor, Tensor]:
    """(dq, dk), copied into out's tensors if given."""
    if out is None:
        return dq, dk
    return out[0].copy_(dq), out[1].copy_(dk)


@COMPARATORS.register("squared_l2")
class SquaredL2Comparator(Comparator):
    """Minus the squared Euclidean distance."""

    def pos(self, q, k):
        return (q - k).pow_(2).sum(-1).neg_()

    def pos_backward(self, q, k, g):
        dq = (q - k).mul_(g.unsqueeze(-1) * -2)
        return dq, -dq

    def matrix(self, q, k, out=None):
        # -(|q|^2 + |k|^2 - 2 q.k), the all-pairs expansion PBG uses, as one bmm.
        return _expanded_bmm(self.bmm, q, k, 2.0, -1.0, out)

    def matrix_backward(self, q, k, s, g, out=None):
        return _squared_dist_backward(self.bmm, q, k, g, out=out)


@COMPARATORS.register("l2")
class L2Comparator(Comparator):
    """Minus the Euclidean distance (squared distance clamped at 1e-30 like PBG)."""

    needs_scores = True

    def pos(self, q, k):
        return (q - k).pow_(2).sum(-1).clamp_min_(_MIN_SQUARED_DIST).sqrt_().neg_()

    def pos_backward(self, q, k, g):
        s = self.pos(q, k)
        factor = (g / s).masked_fill_(s > _MAX_CLAMPED_SCORE, 0)  # = -g / dist
        dq = (q - k).mul_(factor.unsqueeze(-1))
        return dq, -dq

    def matrix(self, q, k, out=None):
        sq = _expanded_bmm(self.bmm, q, k, -2.0, 1.0, out)
        return sq.clamp_min_(_MIN_SQUARED_DIST).sqrt_().neg_()

    def matrix_backward(self, q, k, s, g, out=None):
        # d(-dist)/d(-sq) = 1 / (2 dist) = -0.5 / s, zero where the clamp was active; the
        # -0.5 is folded into the gradient formula's factor of 2.
        h = g.div_(s)
        # Rare (identical vectors): on the host, masked only then.
        if not self.host_checks or s.amax() > _MAX_CLAMPED_SCORE:
            h.masked_fill_(s > _MAX_CLAMPED_SCORE, 0)
        return _squared_dist_backward(self.bmm, q, k, h, -1.0, out)


class BiasedComparator(Comparator):
    """PBG's `bias` option: coordinate 0 of each vector is a bias added to the score;
    the base comparator sees coordinates 1: (prepare included)."""

    def __init__(self, base: Comparator) -> None:
        self.base = base
        self.needs_scores = base.needs_scores
        self.bmm, self.host_checks = base.bmm, base.host_checks
        self.name = f"biased {base.name}"

    def prepare(self, x):
        y, ctx = self.base.prepare(x[..., 1:])
        return torch.cat([x[..., :1], y], dim=-1), ctx

    def prepare_backward(self, ctx, dy):
        return torch.cat([dy[..., :1], self.base.prepare_backward(ctx, dy[..., 1:])], dim=-1)

    def pos(self, q, k):
        return self.base.pos(q[..., 1:], k[..., 1:]) + q[..., 0] + k[..., 0]

    def pos_backward(self, q, k, g):
        dq, dk = self.base.pos_backward(q[..., 1:], k[..., 1:], g)
        g = g.unsqueeze(-1)
        return torch.cat([g, dq], dim=-1), torch.cat([g, dk], dim=-1)

    def matrix(self, q, k, out=None):
        s = self.base.matrix(q[..., 1:], k[..., 1:], out)
        return s.add_(q[..., :1]).add_(k[..., 0].unsqueeze(-2))

    def matrix_backward(self, q, k, s, g, out=None):
        dq0 = g.sum(-1, keepdim=True)
        dk0 = g.sum(-2).unsqueeze(-1)
        if self.base.needs_scores:
            s = s - q[..., :1] - k[..., 0].unsqueeze(-2)
        dq, dk = self.base.matrix_backward(q[..., 1:], k[..., 1:], s, g)
        if out is None:
            return torch.cat([dq0, dq], dim=-1), torch.cat([dk0, dk], dim=-1)
        return torch.cat([dq0, dq], dim=-1, out=out[0]), torch.cat([dk0, dk], dim=-1, out=out[1])


def make_comparator(name: str, bias: bool, for_device: bool = False) -> Comparator:
    """The comparator `name` (with PBG's bias coordinate if `bias`); `for_device`: for the
    device step (torch's bmm, no host reads)."""
    comparator = COMPARATORS.get(name)()
    if for_device:
        comparator.bmm, comparator.host_checks = _torch_bmm, False
    return BiasedComparator(comparator) if bias else comparator


def _torch_bmm(a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
