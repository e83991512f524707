"""The C step of the dot comparator and the softmax loss (losses.dot_softmax_step, which
Embedder.forward(fuse=True) leaves a batch's scores to) against the batch-wide torch and
numpy path it stands in for, batch by batch, and where it must stand aside."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch

from pbg_ray.config import ConfigSchema
from pbg_ray.model import embedder as embedder_module
from pbg_ray.model.beyond import BeyondRows
from pbg_ray.model.blas import sgemm_address
from pbg_ray.model.kernel import EdgeTensors, KernelState, build_batch
from pbg_ray.model.operators import ComplexDiagonalOperator
from pbg_ray.model.params import init_params
from pbg_ray.types import Bucket, EdgeList

DIM = 16
NUM_BATCH_NEGS, NUM_UNIFORM_NEGS = 5, 7


def config(operator: str = "none", two_types: bool = False, **overrides: Any) -> ConfigSchema:
    entities = {"a": {"num_partitions": 1}, "b": {"num_partitions": 1}}
    data = dict(
        entities=entities if two_types else {"a": entities["a"]},
        relations=[{"name": "r", "lhs": "a", "rhs": "b" if two_types else "a",
                    "operator": operator}],
        dimension=DIM, comparator="dot", loss_fn="softmax", num_batch_negs=NUM_BATCH_NEGS,
        num_uniform_negs=NUM_UNIFORM_NEGS, batch_size=1000, global_emb=False, lr=0.1,
        entity_path="/unused", edge_paths=["/unused"], checkpoint_path="/unused")
    data.update(overrides)
    return ConfigSchema.from_dict(data)


def gradients(cfg: ConfigSchema, num_edges: int, fuse: bool, weighted: bool = False,
              beyond: bool = False) -> Dict[str, Any]:
    """One batch's Gradients (copied) with forward(fuse=...), and whether it fused, on
    random tables and parameters (the same ones for either value of fuse)."""
    rng = np.random.default_rng(num_edges)
    sizes = {"a": 40, "b": 30}
    partitions = {(e, 0): (rng.standard_normal((sizes[e], DIM), dtype=np.float32),
                           np.zeros(sizes[e], np.float32)) for e in cfg.entities}
    params = init_params(cfg, 1)
    for array in params.arrays.values():
        array[...] = rng.standard_normal(array.shape).astype(np.float32)
    rhs_size = sizes[cfg.relations[0].rhs]
    edges = EdgeList(rng.integers(0, 40, num_edges), rng.integers(0, rhs_size, num_edges),
                     np.zeros(num_edges, np.int64),
                     weight=rng.random(num_edges).astype(np.float32) if weighted else None)
    state = KernelState(cfg, partitions, params, writable=True)
    table_sizes = {k: t.shape[0] for k, t in state.tables.items()}
    extra = None
    if beyond:
        rows = rng.standard_normal((6, DIM), dtype=np.float32)
        extra = {("a", 0): BeyondRows(rows, 0.5, np.arange(6))}
    batch = build_batch(cfg, Bucket(0, 0), EdgeTensors(edges), np.arange(num_edges),
                        cfg.num_batch_negs, cfg.num_uniform_negs, table_sizes,
                        torch.Generator().manual_seed(1), extra)
    scores = state.embedder.forward(batch, fuse=fuse)
    grads = state.embedder.backward(batch, scores)
    return {"fused": scores.saved.get("fused", False),
            "op_in_step": scores.saved.get("step_op") is not None, "loss": grads.loss,
            "reg": grads.reg, "violators": grads.violators,
            "rows": {k: (ids.clone(), g.clone()) for k, (ids, g) in grads.rows.items()},
            "params": {k: g.clone() for k, g in grads.params.items()}}


def assert_same(fused: Dict[str, Any], unfused: Dict[str, Any]) -> None:
    assert fused["loss"] == pytest.approx(unfused["loss"], rel=1e-5)
    assert fused["reg"] == pytest.approx(unfused["reg"], rel=1e-5)
    assert fused["violators"] == unfused["violators"]
    assert fused["rows"].keys() == unfused["rows"].keys()
    for key, (ids, g) in unfused["rows"].items():
        assert torch.equal(fused["rows"][key][0], ids)
        torch.testing.assert_close(fused["rows"][key][1], g, rtol=1e-4, atol=1e-5)
    assert fused["params"].keys() == unfused["params"].keys()
    for key, g in unfused["params"].items():
        torch.testing.assert_close(fused["params"][key], g, rtol=1e-4, atol=1e-4)


def test_numpy_s_blas_is_reachable():
    # numpy's wheels carry an ILP64 OpenBLAS, as on every machine CI runs on: the C step
    # is what these tests and the kernel run, not the fallback.
    assert sgemm_address() is not None


@pytest.mark.parametrize("operator", ["none", "translation", "diagonal", "complex_diagonal",
                                      "linear"])
@pytest.mark.parametrize("num_edges", [20, 23, 3])  # whole chunks, a padded last one, one chunk
def test_the_c_step_matches_the_batch_wide_path(operator, num_edges):
    cfg = config(operator)
    fused, unfused = gradients(cfg, num_edges, True), gradients(cfg, num_edges, False)
    assert fused["fused"] and not unfused["fused"]
    assert_same(fused, unfused)
    assert sum(fused["violators"].values()) > 0


@pytest.mark.parametrize("overrides", [
    dict(two_types=True), dict(global_emb=True), dict(global_emb=True, operator="complex_diagonal"),
    dict(regularization_coef=1e-3, operator="diagonal"),
    dict(regularization_coef=1e-3, operator="complex_diagonal"), dict(max_norm=1.0)])
def test_the_c_step_matches_with_the_rest_of_the_model(overrides):
    cfg = config(**overrides)
    fused, unfused = gradients(cfg, 23, True), gradients(cfg, 23, False)
    assert fused["fused"]
    assert_same(fused, unfused)


@pytest.mark.parametrize("num_edges", [20, 23, 3])
def test_the_c_step_applies_complex_diagonal_itself_as_the_operator_does(num_edges, monkeypatch):
    """The step runs complex_diagonal's C loops on each chunk's rhs rows itself: the same
    gradients, bit for bit, as the operator applied to the whole batch before the step
    (the same loops, the parameters' sums in the same row order)."""
    cfg = config("complex_diagonal")
    inside = gradients(cfg, num_edges, True)
    monkeypatch.setattr(ComplexDiagonalOperator, "in_step", lambda self, p: None)
    outside = gradients(cfg, num_edges, True)
    assert inside["op_in_step"] and outside["fused"] and not outside["op_in_step"]
    assert (inside["loss"], inside["violators"]) == (outside["loss"], outside["violators"])
    for key, (ids, g) in outside["rows"].items():
        assert torch.equal(inside["rows"][key][0], ids) and torch.equal(inside["rows"][key][1], g)
    assert inside["params"].keys() == outside["params"].keys()
    for key, g in outside["params"].items():
        assert torch.equal(inside["params"][key], g), key


def test_the_c_step_weighs_edges():
    cfg = config("complex_diagonal")
    fused = gradients(cfg, 23, True, weighted=True)
    unfused = gradients(cfg, 23, False, weighted=True)
    assert fused["fused"]
    assert_same(fused, unfused)
    assert fused["loss"] != pytest.approx(gradients(cfg, 23, True)["loss"], rel=1e-3)


@pytest.mark.parametrize("overrides", [
    dict(comparator="cos"), dict(loss_fn="ranking"), dict(bias=True), dict(disable_lhs_negs=True),
    dict(num_uniform_negs=0), dict(num_batch_negs=0), dict(dynamic_relations=True)])
def test_batches_the_c_step_cannot_serve_take_the_batch_wide_path(overrides):
    if overrides.get("num_uniform_negs") == 0:
        overrides["num_batch_negs"] = NUM_BATCH_NEGS
    cfg = config(**overrides)
    assert not gradients(cfg, 23, True)["fused"]


def test_negatives_from_beyond_the_bucket_take_the_batch_wide_path():
    cfg = config()
    assert not gradients(cfg, 23, True, beyond=True)["fused"]
    assert gradients(cfg, 23, True)["fused"]


def test_without_numpy_s_openblas_the_batch_wide_path_serves(monkeypatch):
    cfg = config("complex_diagonal")
    expected = gradients(cfg, 23, False)
    monkeypatch.setattr(embedder_module, "dot_softmax_ready", lambda u, v: False)
    found = gradients(cfg, 23, True)
    assert not found["fused"]
    assert_same(found, expected)
