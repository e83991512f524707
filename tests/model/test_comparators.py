"""Comparator edge cases the random oracle cases can't reach reliably."""

from __future__ import annotations

import warnings

import pytest
import torch

from pbg_ray.model.comparators import make_comparator

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchbiggraph.model import L2Comparator as TbgL2

pytestmark = pytest.mark.oracle


def test_l2_positive_has_no_gradient_at_zero_distance():
    """PBG clamps squared distances at 1e-30 before the square root, so a positive pair of
    identical vectors (a self-loop under the identity operator) scores -1e-15 and gets no
    gradient; so must ours. (For negatives PBG's all-pairs expansion rarely yields an exact
    zero, so there the clamp is a matter of rounding in both implementations.)"""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 4, generator=g)
    k = torch.cat([q[:, :1], torch.randn(1, 2, 4, generator=g)], dim=1)  # pair 0 identical
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    pos, _, _ = TbgL2()(qa, ka, qa[:, :0], ka[:, :0])
    g_pos = torch.randn(1, 3, generator=g)
    (pos * g_pos).sum().backward()

    cmp = make_comparator("l2", bias=False)
    torch.testing.assert_close(cmp.pos(q, k), pos.detach())
    dq, dk = cmp.pos_backward(q, k, g_pos)
    assert not dq[0, 0].any() and not dk[0, 0].any()
    torch.testing.assert_close(dq, qa.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dk, ka.grad, rtol=1e-5, atol=1e-6)
