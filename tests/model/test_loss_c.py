"""The C softmax loss and violators count (pbg_ray/model/_loss.c) against the torch ops
they stand in for."""

from __future__ import annotations

import importlib

import pytest
import torch

from pbg_ray.config import ConfigSchema
from pbg_ray.model import losses
from pbg_ray.model.embedder import Batch, Embedder, SideBatch
from pbg_ray.model.negatives import Negatives

SOFTMAX = losses.SoftmaxLoss(margin=0.1)


def test_the_extension_is_built():
    # pip builds it wherever a C compiler is found, as on every machine CI runs on.
    importlib.import_module("pbg_ray.model._loss")


def side(columns, transposed_first: bool, chunks: int = 3, rows: int = 5):
    """pos [chunks, rows], blocks [chunks, rows, N] (the first one transposed in memory, as
    the lhs side's share of the batch block is), weights with the last chunk's two last
    rows as padding (weight 0)."""
    gen = torch.Generator().manual_seed(sum(columns))
    pos = torch.randn(chunks, rows, generator=gen) * 3
    blocks = [torch.randn(chunks, rows, n, generator=gen) * 3 for n in columns]
    if transposed_first:
        blocks[0] = blocks[0].transpose(1, 2).contiguous().transpose(1, 2)
    weight = torch.rand(chunks, rows, generator=gen) + 0.5
    weight[-1, -2:] = 0
    return pos, blocks, weight


def forward_backward(monkeypatch, c_code: bool, pos, blocks, weight):
    """(loss, dpos, grads) of the C code or of the torch ops, on copies of the inputs."""
    blocks = [b.clone() for b in blocks]  # clone keeps a transposed layout
    with monkeypatch.context() as m:
        if not c_code:
            m.setattr(losses, "_loss", None)
        return SOFTMAX.forward_backward(pos, blocks, weight, sum(b.shape[-1] for b in blocks),
                                        blocks)


@pytest.mark.parametrize("columns", [[5, 17], [16], [1, 33, 40], [0, 7]])
@pytest.mark.parametrize("transposed_first", [False, True])
def test_softmax_matches_the_torch_ops(monkeypatch, columns, transposed_first):
    pos, blocks, weight = side(columns, transposed_first)
    c_loss, c_dpos, c_grads = forward_backward(monkeypatch, True, pos, blocks, weight)
    t_loss, t_dpos, t_grads = forward_backward(monkeypatch, False, pos, blocks, weight)
    torch.testing.assert_close(c_loss, t_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c_dpos, t_dpos, rtol=1e-5, atol=1e-7)
    for c, t in zip(c_grads, t_grads):
        torch.testing.assert_close(c, t, rtol=1e-5, atol=1e-7)
    assert not c_dpos[-1, -2:].any() and not c_grads[-1][-1, -2:].any()  # padding rows


def test_softmax_of_far_apart_scores_stays_finite_and_a_nan_score_makes_the_loss_nan(monkeypatch):
    pos, blocks, weight = side([20], False)
    blocks[0][0, 0, :10] = -1e4  # e^(x - max) underflows to 0
    loss, dpos, grads = forward_backward(monkeypatch, True, pos, blocks, weight)
    assert torch.isfinite(loss) and torch.isfinite(dpos).all() and torch.isfinite(grads[0]).all()
    assert not grads[0][0, 0, :10].any()
    blocks[0][1, 2, 3] = float("nan")
    loss, _, _ = forward_backward(monkeypatch, True, pos, blocks, weight)
    assert torch.isnan(loss)  # the trainer stops on it


def embedder_violators(monkeypatch, c_code: bool, pos, blocks, num_pos: int) -> int:
    """The Embedder's violators count of a side, by the C pass or by torch's ops."""
    config = ConfigSchema.from_dict(dict(
        entities={"node": {"num_partitions": 1}},
        relations=[{"name": "r", "lhs": "node", "rhs": "node"}], dimension=4,
        entity_path="/unused", edge_paths=["/unused"], checkpoint_path="/unused"))
    embedder = Embedder(config, {}, {})
    side = SideBatch(("node", 0), "node", Negatives.UNIFORM)
    _, rows = pos.shape
    batch = Batch(num_pos, rows, 0, torch.zeros(num_pos, dtype=torch.long), side, side, None)
    with monkeypatch.context() as m:
        if not c_code:
            m.setattr(losses, "_loss", None)
        return embedder._violators(batch, "lhs", pos, blocks, [b.clone() for b in blocks])


@pytest.mark.parametrize("columns", [[5, 17], [16], [1, 33, 40], [0, 7]])
@pytest.mark.parametrize("transposed_first", [False, True])
@pytest.mark.parametrize("rows", [5, 21])  # under and past a 16-lane block
def test_violators_count_matches_the_torch_ops(monkeypatch, columns, transposed_first, rows):
    pos, blocks, _ = side(columns, transposed_first, rows=rows)
    blocks[-1][0, 1, :3] = pos[0, 1]  # ties are not above
    blocks[-1][1, 0, 0] = float("nan")  # nor is a NaN
    total = pos.numel()
    for num_pos in (total, total - 2, rows + 1):  # full, the last chunk padded, mostly padding
        c_count = embedder_violators(monkeypatch, True, pos, blocks, num_pos)
        t_count = embedder_violators(monkeypatch, False, pos, blocks, num_pos)
        expected = sum(int((b > pos.unsqueeze(-1)).sum(-1).view(-1)[:num_pos].sum())
                       for b in blocks)
        assert c_count == t_count == expected
        assert 0 < expected  # (each case has violators to count)
