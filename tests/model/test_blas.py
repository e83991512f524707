"""The kernel's batched products through numpy's BLAS, and its thread settings."""

from __future__ import annotations

import pytest
import torch
from threadpoolctl import threadpool_info

from pbg_ray.model.blas import bmm, cpu_threads


def operands(layout: str, dtype=torch.float32):
    """a [3, 5, 4] and b [3, 4, 6], each contiguous (N) or a transposed view (T)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 4, generator=g, dtype=dtype)
    b = torch.randn(3, 4, 6, generator=g, dtype=dtype)
    if layout[0] == "T":
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    if layout[1] == "T":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return a, b


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
def test_bmm_equals_torch_bmm_for_transposed_views(layout):
    a, b = operands(layout)
    expected = torch.bmm(a.contiguous(), b.contiguous())
    torch.testing.assert_close(bmm(a, b), expected)
    out = torch.full((3, 5, 6), float("nan"))
    assert bmm(a, b, out) is out
    torch.testing.assert_close(out, expected)


def test_bmm_leaves_other_dtypes_and_autograd_to_torch():
    a, b = operands("NT", torch.float64)
    torch.testing.assert_close(bmm(a, b), torch.bmm(a, b))
    a, b = operands("NN")
    a.requires_grad_()
    bmm(a, b).sum().backward()
    torch.testing.assert_close(a.grad, b.sum(-1).unsqueeze(1).expand(3, 5, 4))


def blas_threads():
    return {lib["internal_api"]: lib["num_threads"] for lib in threadpool_info()
            if lib["user_api"] == "blas"}


def test_cpu_threads_sets_torch_and_blas_threads_then_restores_them():
    torch_before, blas_before = torch.get_num_threads(), blas_threads()
    assert blas_before, "numpy's BLAS is not visible to threadpoolctl"
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
        assert set(blas_threads().values()) == {1}
    assert torch.get_num_threads() == torch_before and blas_threads() == blas_before
