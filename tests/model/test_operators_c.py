"""The C complex_diagonal operator (pbg_ray/model/_operators.c) against the torch ops it
stands in for."""

from __future__ import annotations

import importlib

import pytest
import torch

from pbg_ray.model import operators

OP = operators.ComplexDiagonalOperator(16)


def test_the_extension_is_built():
    # pip builds it wherever a C compiler is found, as on every machine CI runs on.
    importlib.import_module("pbg_ray.model._operators")
    assert operators._operators is not None


def inputs(rows_shape, dim: int = 16, seed: int = 0):
    """x and dy [*rows_shape, dim] and a relation's parameters away from the identity."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows_shape, dim, generator=gen)
    dy = torch.randn(*rows_shape, dim, generator=gen)
    params = {"real": torch.randn(dim // 2, generator=gen),
              "imag": torch.randn(dim // 2, generator=gen)}
    return x, dy, params


def run(monkeypatch, c_code: bool, op, x, dy, params):
    """(y, dx, parameter gradients) of the C code or of the torch ops."""
    with monkeypatch.context() as m:
        if not c_code:
            m.setattr(operators, "_operators", None)
        y = op.forward(x, params)
        dx, dp = op.backward(x, params, dy)
    return y, dx, dp


@pytest.mark.parametrize("rows_shape,dim", [((3, 7), 16), ((50,), 100), ((2, 5, 9), 6)])
def test_complex_diagonal_matches_the_torch_ops(monkeypatch, rows_shape, dim):
    op = operators.ComplexDiagonalOperator(dim)
    x, dy, params = inputs(rows_shape, dim)
    c_y, c_dx, c_dp = run(monkeypatch, True, op, x, dy, params)
    t_y, t_dx, t_dp = run(monkeypatch, False, op, x, dy, params)
    # The same products; torch's addcmul_ rounds its multiply-add once, the C loop twice.
    torch.testing.assert_close(c_y, t_y, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c_dx, t_dx, rtol=1e-6, atol=1e-7)
    assert c_y.shape == x.shape and c_dx.shape == x.shape
    assert set(c_dp) == {"real", "imag"}
    for name in c_dp:  # sums over rows, in another order (and in double precision)
        assert c_dp[name].shape == params[name].shape
        torch.testing.assert_close(c_dp[name], t_dp[name], rtol=1e-5, atol=1e-5)


def test_the_c_gradients_are_the_derivatives_of_the_forward():
    op = operators.ComplexDiagonalOperator(8)
    x, dy, params = inputs((4, 3), 8, seed=1)
    assert op._native(x.view(-1, 8), op.pack(params), dy.view(-1, 8))
    x64 = x.double().requires_grad_()
    p64 = {k: v.double().requires_grad_() for k, v in params.items()}
    re, im = x64[..., :4], x64[..., 4:]
    y64 = torch.cat([re * p64["real"] - im * p64["imag"], re * p64["imag"] + im * p64["real"]], -1)
    (y64 * dy.double()).sum().backward()
    dx, dp = op.backward(x, params, dy)
    torch.testing.assert_close(op.forward(x, params).double(), y64.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-5, atol=1e-6)
    for name in ("real", "imag"):
        torch.testing.assert_close(dp[name].double(), p64[name].grad, rtol=1e-5, atol=1e-5)


def test_inputs_the_c_code_does_not_take_go_to_the_torch_ops():
    x, dy, params = inputs((6,))
    per_row = {k: v.expand(6, -1).contiguous() for k, v in params.items()}  # dynamic relations
    float64 = {k: v.double() for k, v in params.items()}
    transposed = torch.randn(16, 6).t()
    assert OP._native(x, OP.pack(params), dy)
    assert not OP._native(x, OP.pack(per_row), dy)
    assert not OP._native(x.double(), OP.pack(float64), dy.double())
    assert not OP._native(transposed, OP.pack(params))
    # Per-row parameters still give each row its own transformation.
    y = OP.forward(x, per_row)
    torch.testing.assert_close(y, OP.forward(x, params))
    dx, dp = OP.backward(x, per_row, dy)
    assert dp["real"].shape == (6, 8)
    torch.testing.assert_close(dp["real"].sum(0), OP.backward(x, params, dy)[1]["real"],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(OP.forward(transposed, params),
                               OP.forward(transposed.contiguous(), params))
