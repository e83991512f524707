"""Regularizers (not in PBG 1.0.0; N3 follows later PBG releases and Lacroix et al. 2018).

N3 adds coef * sum m(v)^3 over the batch's positive embeddings (both sides, after the
global embedding, before operator and comparator) and over the operator parameters used
by each edge (per-relation mode: batch size x the relation's parameters; dynamic mode:
every edge's lhs and rhs operator parameters). m is the absolute value, or the modulus of
(real, imaginary) pairs for complex_diagonal. Linear and affine operators can't be
regularized (as in PBG); config validation refuses them.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from pbg_ray.model.operators import Operator
from pbg_ray.model.registry import Registry

REGULARIZERS: Registry["Regularizer"] = Registry("regularizer")


class Regularizer:
    name: str

    def __init__(self, coef: float) -> None:
        self.coef = coef

    def embeddings(self, x: Tensor, op: Operator) -> Tuple[Tensor, Tensor]:
        """(penalty of the vectors x [..., D], its gradient)."""
        raise NotImplementedError

    def params(self, p: Dict[str, Tensor], op: Operator, count: int
               ) -> Tuple[Tensor, Dict[str, Tensor]]:
        """(penalty of the operator parameters p, used `count` times, and its gradients)."""
        raise NotImplementedError


@REGULARIZERS.register("N3")
class N3Regularizer(Regularizer):

    def _cubes(self, parts: Tuple[Tensor, ...], complex_pairs: bool
               ) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """sum m^3 and its gradients w.r.t. each part."""
        if complex_pairs:  # parts = (re, im): m = |re + i im|, d m^3 = 3 m (re, im)
            re, im = parts
            m = (re * re + im * im).sqrt_()
            return m.pow(3).sum(), (3 * self.coef * m * re, 3 * self.coef * m * im)
        value = sum(t.abs().pow(3).sum() for t in parts)
        return value, tuple(3 * self.coef * t * t.abs() for t in parts)

    def embeddings(self, x, op):
        if op.complex_pairs:
            value, (dre, dim_) = self._cubes(tuple(x.chunk(2, dim=-1)), True)
            return self.coef * value, torch.cat([dre, dim_], dim=-1)
        value, (dx,) = self._cubes((x,), False)
        return self.coef * value, dx

    def params(self, p, op, count):
        names = op.reg_params
        if not names:
            return torch.zeros(()), {}
        value, grads = self._cubes(tuple(p[n] for n in names), op.complex_pairs)
        return self.coef * count * value, {n: g * count for n, g in zip(names, grads)}
