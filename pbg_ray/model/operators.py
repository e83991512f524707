"""Relation operators: the transformation a relation applies to an embedding before comparison.

Each operator works on vectors x [..., D] with parameters `p` (name -> tensor). A
parameter either has its stored shape (per-relation mode: one set for the batch's
relation, broadcast over all rows) or a leading row dimension matching x [n, D]
(dynamic mode: `p[name] = stored[rel_ids]`, one set per edge). `backward` returns
the input gradient and parameter gradients reduced to the shapes of `p`.

Parameter names are PBG's checkpoint names; `dynamic_names` are those of PBG's
dynamic operators (the same tensors with a leading [num_relations] dimension).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import numpy as np

from pbg_ray.model.native import c_ready, extension
from pbg_ray.model.registry import Registry

if TYPE_CHECKING:  # the math uses tensor methods only, so the layout loads without torch
    from torch import Tensor

Params = Dict[str, "Tensor"]


def _sum_to(grad: Tensor, like: Tensor) -> Tensor:
    """Sum broadcast leading dimensions away so grad has like's shape."""
    if grad.dim() > like.dim():
        grad = grad.reshape(-1, *like.shape).sum(0)
    return grad


class Operator:
    """Base: the identity. Subclasses define `param_names`, `init`, `forward`, `backward`."""

    name: str
    # (per-relation name, dynamic-mode name) of each parameter, in PBG's registration order.
    param_names: Tuple[Tuple[str, str], ...] = ()
    # Parameters the N3 regularizer penalizes; None: the operator can't be regularized (as in PBG).
    reg_params: Optional[Tuple[str, ...]] = ()
    # N3 measures complex moduli of (first half, second half) pairs instead of absolute values.
    complex_pairs = False

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def init(self) -> Dict[str, np.ndarray]:
        """Per-relation parameters at PBG's initial values (the identity transformation)."""
        return {}

    def forward(self, x: Tensor, p: Params) -> Tensor:
        return x

    def backward(self, x: Tensor, p: Params, dy: Tensor) -> Tuple[Tensor, Params]:
        return dy, {}


OPERATORS: Registry[Operator] = Registry("operator")
OPERATORS.register("none")(Operator)


@OPERATORS.register("diagonal")
class DiagonalOperator(Operator):
    param_names = (("diagonal", "diagonals"),)
    reg_params = ("diagonal",)

    def init(self):
        return {"diagonal": np.ones(self.dim, np.float32)}

    def forward(self, x, p):
        return x * p["diagonal"]

    def backward(self, x, p, dy):
        d = p["diagonal"]
        return dy * d, {"diagonal": _sum_to(dy * x, d)}


@OPERATORS.register("translation")
class TranslationOperator(Operator):
    param_names = (("translation", "translations"),)
    reg_params = ("translation",)

    def init(self):
        return {"translation": np.zeros(self.dim, np.float32)}

    def forward(self, x, p):
        return x + p["translation"]

    def backward(self, x, p, dy):
        return dy, {"translation": _sum_to(dy, p["translation"])}


def _linear(x: Tensor, a: Tensor) -> Tensor:
    # PBG computes matmul(A, x.unsqueeze(-1)): y_i = sum_j A_ij x_j.
    if a.dim() == 3:  # one matrix per row
        return a.bmm(x.unsqueeze(-1)).squeeze(-1)
    return x @ a.t()


def _linear_backward(x: Tensor, a: Tensor, dy: Tensor) -> Tuple[Tensor, Tensor]:
    if a.dim() == 3:
        return dy.unsqueeze(1).bmm(a).squeeze(1), dy.unsqueeze(-1) * x.unsqueeze(-2)
    d = a.shape[0]
    return dy @ a, dy.reshape(-1, d).t() @ x.reshape(-1, d)


@OPERATORS.register("linear")
class LinearOperator(Operator):
    param_names = (("linear_transformation", "linear_transformations"),)
    reg_params = None

    def init(self):
        return {"linear_transformation": np.eye(self.dim, dtype=np.float32)}

    def forward(self, x, p):
        return _linear(x, p["linear_transformation"])

    def backward(self, x, p, dy):
        dx, da = _linear_backward(x, p["linear_transformation"], dy)
        return dx, {"linear_transformation": da}


@OPERATORS.register("affine")
class AffineOperator(Operator):
    param_names = (("linear_transformation", "linear_transformations"),
                   ("translation", "translations"))
    reg_params = None

    def init(self):
        return {"linear_transformation": np.eye(self.dim, dtype=np.float32),
                "translation": np.zeros(self.dim, np.float32)}

    def forward(self, x, p):
        return _linear(x, p["linear_transformation"]) + p["translation"]

    def backward(self, x, p, dy):
        dx, da = _linear_backward(x, p["linear_transformation"], dy)
        return dx, {"linear_transformation": da, "translation": _sum_to(dy, p["translation"])}


_operators = extension("_operators")


@OPERATORS.register("complex_diagonal")
class ComplexDiagonalOperator(Operator):
    """x = (re, im) halves times the complex diagonal (real, imag):
    y = x * [real, real] + swap(x) * [-imag, imag], swap exchanging the halves
    (three passes over x instead of PBG's seven; on the CPU one C loop, _operators.c,
    for the relation's own parameters)."""

    param_names = (("real", "real"), ("imag", "imag"))
    reg_params = ("real", "imag")
    complex_pairs = True

    def init(self):
        half = self.dim // 2
        return {"real": np.ones(half, np.float32), "imag": np.zeros(half, np.float32)}

    @staticmethod
    def _swap(x: Tensor) -> Tensor:
        return x.roll(x.shape[-1] // 2, dims=-1)

    @staticmethod
    def _halves(first: Tensor, second: Tensor) -> Tensor:
        """[first, second] along the last dimension."""
        h = first.shape[-1]
        out = first.new_empty(*first.shape[:-1], 2 * h)
        out[..., :h] = first
        out[..., h:] = second
        return out

    @staticmethod
    def _native(x: Tensor, p: Params, *others: Tensor) -> bool:
        """Whether _operators.c serves x [..., D] with one parameter set [D/2]."""
        return (_operators is not None and p["real"].dim() == 1
                and c_ready((x, p["real"], p["imag"], *others)))

    def forward(self, x, p):
        r, i = p["real"], p["imag"]
        if self._native(x, p):
            out = x.new_empty(x.shape)
            _operators.forward(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                               r.data_ptr(), i.data_ptr(), out.data_ptr())
            return out
        # In place on the one new buffer: these vectors are large and memory-bound.
        return self._swap(x).mul_(self._halves(-i, i)).addcmul_(x, self._halves(r, r))

    def backward(self, x, p, dy):
        r, i = p["real"], p["imag"]
        h = r.shape[-1]
        if self._native(x, p, dy):
            dx, d_real, d_imag = x.new_empty(x.shape), r.new_empty(h), i.new_empty(h)
            _operators.backward(x.data_ptr(), dy.data_ptr(), x.numel() // x.shape[-1],
                                x.shape[-1], r.data_ptr(), i.data_ptr(), dx.data_ptr(),
                                d_real.data_ptr(), d_imag.data_ptr())
            return dx, {"real": d_real, "imag": d_imag}
        like = x.new_empty(*r.shape[:-1], 2 * h)
        # d real = dy_re re + dy_im im;  d imag = dy_im re - dy_re im.
        t = _sum_to(dy * x, like)
        dx = self._swap(dy)
        s = _sum_to(dx * x, like)
        dx.mul_(self._halves(i, -i)).addcmul_(dy, self._halves(r, r))
        return dx, {"real": t[..., :h] + t[..., h:], "imag": s[..., :h] - s[..., h:]}
