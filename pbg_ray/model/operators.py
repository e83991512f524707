"""Relation operators: the transformation a relation applies to an embedding before comparison.

Each operator's math is written once, on its parameters packed into one vector theta of
`packed_size` floats (its parameters flattened in `param_names` order): `apply(x, theta)`
maps rows x [M, D]; `apply_backward(x, theta, dy)` returns the rows' gradient and theta's.
theta is either [P], one set for every row (per-relation mode: the batch's relation), or
[M, P], one set per row (dynamic mode: the set of each edge's relation id); theta's
gradient has theta's shape (summed over the rows for a shared set). Outputs may be written
into given tensors (`out`, `dx_out`, `dtheta_out`), so that the device step keeps its
buffers, and `expand(theta)`, the form the math uses (complex_diagonal's 2x2 matrices), may
be passed in once made for a batch's forward and backward. `forward` / `backward` take the parameters as PBG's named tensors instead
(rows of any leading shape), the form the CPU kernel and the scorer use.

Parameter names are PBG's checkpoint names; `dynamic_names` are those of PBG's
dynamic operators (the same tensors with a leading [num_relations] dimension).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import numpy as np

from pbg_ray.model.native import c_ready, extension
from pbg_ray.model.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

Params = Dict[str, "Tensor"]


def _torch():
    """torch, imported where the math runs: the layout (names, shapes, init) loads without it."""
    import torch
    return torch


@dataclasses.dataclass
class StepOperator:
    """An operator that losses.dot_softmax_step applies to the rhs rows itself, chunk by
    chunk while they are in the cache: its C row functions (addresses), its parameters,
    and the buffers the step writes the parameters' gradients into."""

    functions: Tuple[int, ...]
    params: Tuple[Tensor, ...]
    grads: Params

    def args(self) -> Tuple[int, ...]:
        """The step's operator argument: the functions, then the parameters' and their
        gradients' addresses."""
        return (*self.functions, *(t.data_ptr() for t in self.params),
                *(g.data_ptr() for g in self.grads.values()))


class Operator:
    """Base: the identity. Subclasses define `param_names`, `param_shapes`, `init`, `apply`
    and `apply_backward`."""

    name: str
    # (per-relation name, dynamic-mode name) of each parameter, in PBG's registration order.
    param_names: Tuple[Tuple[str, str], ...] = ()
    # Parameters the N3 regularizer penalizes; None: the operator can't be regularized (as in PBG).
    reg_params: Optional[Tuple[str, ...]] = ()
    # N3 measures complex moduli of (first half, second half) pairs instead of absolute values.
    complex_pairs = False

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def param_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        """The stored shape of each parameter, in param_names order."""
        return ()

    @property
    def packed_size(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes())

    def init(self) -> Dict[str, np.ndarray]:
        """Per-relation parameters at PBG's initial values (the identity transformation)."""
        return {}

    def pack(self, p: Params) -> Tensor:
        """theta [..., P] of named parameters (each of its stored shape after the leading ones)."""
        parts = [p[n] for n, _ in self.param_names]
        lead = parts[0].shape[:parts[0].dim() - len(self.param_shapes()[0])]
        return _cat([t.reshape(*lead, -1) for t in parts])

    def unpack(self, theta: Tensor) -> Params:
        """The named parameters in theta [..., P]: views."""
        out, start, lead = {}, 0, theta.shape[:-1]
        for (name, _), shape in zip(self.param_names, self.param_shapes()):
            size = math.prod(shape)
            out[name] = theta[..., start:start + size].view(*lead, *shape)
            start += size
        return out

    def expand(self, theta: Tensor) -> Tensor:
        """theta in the form apply and apply_backward compute with (theta itself here)."""
        return theta

    def apply(self, x: Tensor, theta: Tensor, out: Optional[Tensor] = None,
              expanded: Optional[Tensor] = None) -> Tensor:
        return x if out is None else out.copy_(x)

    def apply_backward(self, x: Tensor, theta: Tensor, dy: Tensor,
                       dx_out: Optional[Tensor] = None, dtheta_out: Optional[Tensor] = None,
                       expanded: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        return (dy if dx_out is None else dx_out.copy_(dy)), theta.new_zeros(theta.shape)

    def forward(self, x: Tensor, p: Params) -> Tensor:
        if not self.param_names:
            return x
        theta = self.pack(p)
        rows = x.reshape(-1, x.shape[-1])
        return self.apply(rows, theta).view(x.shape)

    def backward(self, x: Tensor, p: Params, dy: Tensor,
                 dx_out: Optional[Tensor] = None) -> Tuple[Tensor, Params]:
        """(dx, the parameters' gradients); dx written into dx_out (contiguous) if given."""
        if not self.param_names:
            return (dy if dx_out is None else dx_out.copy_(dy)), {}
        theta = self.pack(p)
        rows = None if dx_out is None else dx_out.view(-1, x.shape[-1])
        dx, dtheta = self.apply_backward(x.reshape(-1, x.shape[-1]), theta,
                                         dy.reshape(-1, dy.shape[-1]), dx_out=rows)
        return dx.view(x.shape), self.unpack(dtheta)

    def in_step(self, p: Params) -> Optional[StepOperator]:
        """The operator with the relation's parameters p for losses.dot_softmax_step to
        apply to the rhs rows; None where the step takes rows the caller passed through
        `forward` (every operator but complex_diagonal, whose C loops the step calls)."""
        return None


def _cat(parts):
    return _torch().cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _row_sum(t: Tensor, theta: Tensor, out: Optional[Tensor]) -> Tensor:
    """t [M, ...] summed over its rows where theta is one set for all rows ([P]), as it
    is where theta has a set per row; into `out` if given."""
    if theta.dim() == 1:
        return t.sum(0) if out is None else _torch().sum(t, 0, out=out)
    return t if out is None else out.copy_(t)


OPERATORS: Registry[Operator] = Registry("operator")
OPERATORS.register("none")(Operator)


@OPERATORS.register("diagonal")
class DiagonalOperator(Operator):
    param_names = (("diagonal", "diagonals"),)
    reg_params = ("diagonal",)

    def param_shapes(self):
        return ((self.dim,),)

    def init(self):
        return {"diagonal": np.ones(self.dim, np.float32)}

    def apply(self, x, theta, out=None, expanded=None):
        return _mul(x, theta, out)

    def apply_backward(self, x, theta, dy, dx_out=None, dtheta_out=None, expanded=None):
        return _mul(dy, theta, dx_out), _row_sum(dy * x, theta, dtheta_out)


def _mul(a: Tensor, b: Tensor, out: Optional[Tensor]) -> Tensor:
    return a * b if out is None else _torch().mul(a, b, out=out)


@OPERATORS.register("translation")
class TranslationOperator(Operator):
    param_names = (("translation", "translations"),)
    reg_params = ("translation",)

    def param_shapes(self):
        return ((self.dim,),)

    def init(self):
        return {"translation": np.zeros(self.dim, np.float32)}

    def apply(self, x, theta, out=None, expanded=None):
        return x + theta if out is None else _torch().add(x, theta, out=out)

    def apply_backward(self, x, theta, dy, dx_out=None, dtheta_out=None, expanded=None):
        return (dy if dx_out is None else dx_out.copy_(dy)), _row_sum(dy, theta, dtheta_out)


class _Linear(Operator):
    """y = A x (+ t): PBG computes matmul(A, x.unsqueeze(-1)). theta holds A row-major."""

    reg_params = None

    def _matrix(self, theta: Tensor) -> Tensor:
        return theta[..., :self.dim * self.dim].view(*theta.shape[:-1], self.dim, self.dim)

    def _bias(self, theta: Tensor) -> Optional[Tensor]:
        return None

    def apply(self, x, theta, out=None, expanded=None):
        torch = _torch()
        a, t = self._matrix(theta), self._bias(theta)
        if a.dim() == 3:  # one matrix per row
            y = torch.bmm(a, x.unsqueeze(-1)).squeeze(-1)
            if t is not None:
                y = y + t
            return y if out is None else out.copy_(y)
        if t is None:
            return torch.mm(x, a.t()) if out is None else torch.mm(x, a.t(), out=out)
        return torch.addmm(t, x, a.t()) if out is None else torch.addmm(t, x, a.t(), out=out)

    def apply_backward(self, x, theta, dy, dx_out=None, dtheta_out=None, expanded=None):
        torch = _torch()
        a = self._matrix(theta)
        d2 = self.dim * self.dim
        dtheta = theta.new_empty(theta.shape) if dtheta_out is None else dtheta_out
        if a.dim() == 3:
            dx = torch.bmm(dy.unsqueeze(1), a).squeeze(1)
            dx = dx if dx_out is None else dx_out.copy_(dx)
            torch.mul(dy.unsqueeze(-1), x.unsqueeze(-2), out=dtheta[:, :d2].view(-1, self.dim,
                                                                                 self.dim))
        else:
            dx = torch.mm(dy, a) if dx_out is None else torch.mm(dy, a, out=dx_out)
            torch.mm(dy.t(), x, out=dtheta[:d2].view(self.dim, self.dim))
        if self._bias(theta) is not None:
            _row_sum(dy, theta, dtheta[..., d2:])
        return dx, dtheta


@OPERATORS.register("linear")
class LinearOperator(_Linear):
    param_names = (("linear_transformation", "linear_transformations"),)

    def param_shapes(self):
        return ((self.dim, self.dim),)

    def init(self):
        return {"linear_transformation": np.eye(self.dim, dtype=np.float32)}


@OPERATORS.register("affine")
class AffineOperator(_Linear):
    param_names = (("linear_transformation", "linear_transformations"),
                   ("translation", "translations"))

    def param_shapes(self):
        return ((self.dim, self.dim), (self.dim,))

    def _bias(self, theta):
        return theta[..., self.dim * self.dim:]

    def init(self):
        return {"linear_transformation": np.eye(self.dim, dtype=np.float32),
                "translation": np.zeros(self.dim, np.float32)}


_operators = extension("_operators")


@OPERATORS.register("complex_diagonal")
class ComplexDiagonalOperator(Operator):
    """x = (re, im) halves times the complex diagonal (real, imag): per coordinate k the
    2x2 real matrix A_k = [[real, -imag], [imag, real]] maps (re_k, im_k). theta = (real,
    imag) [2, D/2] expands to A [2, 2, D/2] by one product with a fixed 4x2 matrix, and
    the forward, the backward and the parameters' gradient are each a product and a sum
    (on the CPU one C loop, _operators.c, for the relation's own parameters, which
    `forward` and `backward` hand it as stored, without packing them into theta)."""

    param_names = (("real", "real"), ("imag", "imag"))
    reg_params = ("real", "imag")
    complex_pairs = True

    def param_shapes(self):
        return ((self.dim // 2,), (self.dim // 2,))

    def init(self):
        half = self.dim // 2
        return {"real": np.ones(half, np.float32), "imag": np.zeros(half, np.float32)}

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self._expansions: Dict[Tuple[object, object], Tensor] = {}

    def _expansion(self, theta: Tensor) -> Tensor:
        """The fixed [4, 2] map from (real, imag) to A's entries (00, 01, 10, 11), made
        once per dtype and device."""
        key = (theta.dtype, theta.device)
        if key not in self._expansions:
            self._expansions[key] = _torch().tensor(
                [[1., 0.], [0., -1.], [0., 1.], [1., 0.]], dtype=theta.dtype, device=theta.device)
        return self._expansions[key]

    def expand(self, theta):
        """A [2, 2, h] (shared) or [M, 2, 2, h] (per row) of theta [2h] or [M, 2h]."""
        h = self.dim // 2
        ri = theta.view(*theta.shape[:-1], 2, h)
        return (self._expansion(theta) @ ri).view(*theta.shape[:-1], 2, 2, h)

    def apply(self, x, theta, out=None, expanded=None):
        h = self.dim // 2
        m = x.shape[0]
        if self._native(x, theta):
            return self._c_forward(x, theta[:h], theta[h:], out)
        a = self.expand(theta) if expanded is None else expanded
        prod = x.view(m, 1, 2, h) * a
        y = prod.sum(2) if out is None else _torch().sum(prod, 2, out=out.view(m, 2, h))
        return y.view(m, self.dim)

    def apply_backward(self, x, theta, dy, dx_out=None, dtheta_out=None, expanded=None):
        h = self.dim // 2
        m = x.shape[0]
        if self._native(x, theta, dy):
            dtheta = theta.new_empty(theta.shape) if dtheta_out is None else dtheta_out
            dx = self._c_backward(x, dy, theta[:h], theta[h:], dx_out, dtheta[:h], dtheta[h:])
            return dx, dtheta
        a = self.expand(theta) if expanded is None else expanded
        g = dy.view(m, 2, 1, h)
        prod = g * a
        dx = prod.sum(1) if dx_out is None else _torch().sum(prod, 1, out=dx_out.view(m, 2, h))
        da = _row_sum(g * x.view(m, 1, 2, h), theta, None).view(*theta.shape[:-1], 4, h)
        expansion_t = self._expansion(theta).t()
        if dtheta_out is None:
            dtheta = (expansion_t @ da).view(theta.shape)
        else:
            _torch().matmul(expansion_t, da, out=dtheta_out.view(*theta.shape[:-1], 2, h))
            dtheta = dtheta_out
        return dx.view(m, self.dim), dtheta

    def forward(self, x, p):
        rows = x.reshape(-1, x.shape[-1])
        re, im = p["real"], p["imag"]
        if not self._native(rows, re, im):
            return super().forward(x, p)
        return self._c_forward(rows, re, im, None).view(x.shape)  # (no packing)

    def backward(self, x, p, dy, dx_out=None):
        rows, grads = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        re, im = p["real"], p["imag"]
        if not self._native(rows, re, im, grads):
            return super().backward(x, p, dy, dx_out)
        d_re, d_im = re.new_empty(re.shape), im.new_empty(im.shape)
        dx = self._c_backward(rows, grads, re, im,
                              None if dx_out is None else dx_out.view(rows.shape), d_re, d_im)
        return dx.view(x.shape), {"real": d_re, "imag": d_im}

    def in_step(self, p):
        re, im = p["real"], p["imag"]
        if _operators is None or re.dim() != 1 or not c_ready((re, im)):
            return None
        return StepOperator(_operators.row_functions(), (re, im),
                            {"real": re.new_empty(re.shape), "imag": im.new_empty(im.shape)})

    def _c_forward(self, x: Tensor, re: Tensor, im: Tensor, out: Optional[Tensor]) -> Tensor:
        """_operators.c's forward of rows x [M, D] with the halves real and imag [D/2]."""
        y = x.new_empty(x.shape) if out is None else out
        _operators.forward(x.data_ptr(), x.shape[0], self.dim, re.data_ptr(), im.data_ptr(),
                           y.data_ptr())
        return y

    def _c_backward(self, x: Tensor, dy: Tensor, re: Tensor, im: Tensor,
                    dx_out: Optional[Tensor], d_re: Tensor, d_im: Tensor) -> Tensor:
        """_operators.c's backward: dx (into dx_out if given), and the halves' gradients
        written into d_re and d_im."""
        dx = x.new_empty(x.shape) if dx_out is None else dx_out
        _operators.backward(x.data_ptr(), dy.data_ptr(), x.shape[0], self.dim, re.data_ptr(),
                            im.data_ptr(), dx.data_ptr(), d_re.data_ptr(), d_im.data_ptr())
        return dx

    @staticmethod
    def _native(x: Tensor, theta: Tensor, *others: Tensor) -> bool:
        """Whether _operators.c serves rows x [M, D] with one parameter set theta [D] (or
        its halves, real and imag [D/2])."""
        return _operators is not None and theta.dim() == 1 and c_ready((x, theta, *others))
