"""The device step (model.device_step), run on the CPU: one batch updates the tables, their
row-Adagrad sums and the shared parameters as the CPU kernel does from the same edges and
negatives, for every operator, comparator, loss and negative mode; a bucket's draws follow
its seed; and the batch loop reads nothing back to the host."""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import pytest
import torch

from pbg_ray.model.device_step import (BucketTrainer, DeviceParams, DeviceTables, KindStep,
                                       _fold_plan, train_bucket_on_device)
from pbg_ray.model.embedder import Batch
from pbg_ray.model.kernel import train_batch
from pbg_ray.model.negatives import Negatives
from pbg_ray.model.params import KnownRows
from pbg_ray.types import Bucket
from tests.model.pbg_oracle import Case, make_case, ours


def device_batch(case: Case, batch: Batch, known: KnownRows = None) -> Tuple[Dict, Dict]:
    """The device step's tables and parameters after the CPU kernel's `batch` (its ids and
    negatives) trained on copies of the case's state: (partitions, params arrays)."""
    parts, params = case.copy_state()
    on_device = {k: (torch.from_numpy(e), torch.from_numpy(s)) for k, (e, s) in parts.items()}
    tables = DeviceTables.join(on_device)
    shared = DeviceParams(case.config, params, torch.device("cpu"))
    trainer = BucketTrainer(case.config, case.bucket, tables, shared, known)
    trainer.edge_weights = batch.weight is not None
    (kind, _), = [k for k in trainer.kinds(case.edges) if k[0].relation == batch.relation]
    step = KindStep(trainer, kind)
    cap, n = kind.capacity, kind.num_chunks
    count = batch.num_pos
    off = [tables.offsets[key] for key in kind.keys]
    pos = torch.stack([_pad(batch.lhs.ids, cap) + off[0], _pad(batch.rhs.ids, cap) + off[1]])
    negatives = []
    for side, o, u in zip((batch.lhs, batch.rhs), off, kind.num_negatives):
        ids = side.neg_ids if side.neg_ids is not None else torch.zeros(n, 0, dtype=torch.long)
        rows = torch.zeros(n, ids.shape[1], dtype=torch.long)
        rows[:ids.shape[0]] = ids
        negatives.append((rows + o).unsqueeze(0))
    weight = torch.zeros(cap)
    weight[:count] = case.config.relations[batch.relation].weight
    if batch.weight is not None:
        weight[:count] *= batch.weight
    rel = _pad(batch.rel_ids, cap).unsqueeze(0)
    group = step.index_group(pos.unsqueeze(0), tuple(negatives), weight.unsqueeze(0), rel)
    step.step(group, 0, count)
    host = {k: (torch.from_numpy(e), torch.from_numpy(s)) for k, (e, s) in parts.items()}
    tables.split(host)
    shared.write_back(params)
    return parts, params.arrays, trainer, step


def _pad(ids: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.full((size,), int(ids[0]), dtype=torch.long)
    out[:len(ids)] = ids
    return out


def cpu_batch(case: Case, batch: Batch, state) -> Tuple[Dict, Dict]:
    sizes = {k: t.shape[0] for k, t in state.tables.items()}
    owners = {k: torch.empty(n, dtype=torch.long) for k, n in sizes.items()}
    loss, reg, vl, vr = train_batch(state, batch, owners)
    parts = {k: (state.tables[k].numpy(), state.sums[k].numpy()) for k in state.tables}
    params = {k: v.numpy() for k, v in state.params.items()}
    return parts, params, (loss, reg, vl, vr)


# Entities enough that no negative ties its positive: the two kernels round scores
# differently, which would decide a tie's violator either way.
SIZES = {"a": 3000, "b": 2900, "f": 9}

GRID = [
    dict(operator="complex_diagonal", loss_fn="softmax"),
    dict(operator="none", comparator="dot", loss_fn="softmax"),
    dict(operator="diagonal", comparator="cos", loss_fn="logistic"),
    dict(operator="translation", comparator="l2", loss_fn="ranking"),
    dict(operator="linear", comparator="squared_l2", loss_fn="softmax"),
    dict(operator="affine", comparator="dot", loss_fn="logistic", bias=True),
    dict(operator="complex_diagonal", comparator="cos", loss_fn="ranking", global_emb=True),
    dict(operator="translation", dynamic_relations=True, loss_fn="softmax"),
    dict(operator="complex_diagonal", dynamic_relations=True, comparator="l2", loss_fn="logistic"),
    dict(operator="diagonal", all_negs=True, loss_fn="softmax"),
    dict(operator="linear", all_negs=True, loss_fn="ranking", comparator="cos"),
    dict(operator="translation", num_batch_negs=0, num_uniform_negs=6, loss_fn="logistic"),
    dict(operator="diagonal", disable_lhs_negs=True, loss_fn="ranking"),
    dict(operator="complex_diagonal", disable_rhs_negs=True, loss_fn="softmax"),
    dict(operator="diagonal", regularization_coef=0.05, weights=True),
    dict(operator="complex_diagonal", regularization_coef=0.05, dynamic_relations=True,
         loss_fn="softmax"),
    dict(operator="translation", max_norm=1.0, loss_fn="softmax", comparator="squared_l2"),
    dict(operator="affine", bias=True, comparator="l2", loss_fn="ranking", weights=True),
]


def _name(overrides):
    return "-".join(f"{k}={v}" for k, v in overrides.items())


@pytest.mark.parametrize("num_edges", [30, 23])  # a full batch, and a padded one
@pytest.mark.parametrize("overrides", GRID, ids=_name)
def test_a_batch_updates_what_the_cpu_kernel_updates(overrides, num_edges):
    overrides = dict(overrides)
    weights = overrides.pop("weights", False)
    case = make_case(num_edges=num_edges, weights=weights, sizes=SIZES,
                     **overrides)
    state, batch = ours(case, seed=5)
    expected_parts, expected_params, (loss, reg, vl, vr) = cpu_batch(case, batch, state)
    parts, params, trainer, step = device_batch(case, batch)
    for key, (embs, sums) in expected_parts.items():
        np.testing.assert_allclose(parts[key][0], embs, rtol=2e-5, atol=2e-6, err_msg=str(key))
        np.testing.assert_allclose(parts[key][1], sums, rtol=2e-5, atol=1e-7, err_msg=str(key))
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    stats = trainer._read_stats([step])
    assert stats["loss"] == pytest.approx(loss, rel=1e-5)
    assert stats["reg"] == pytest.approx(reg, rel=1e-5, abs=1e-6)
    assert (stats["violators_lhs"], stats["violators_rhs"]) == (vl, vr)


def test_known_rows_step_at_their_scale_or_stay():
    for scale in (0.0, 0.3):
        case = make_case(num_edges=30, operator="diagonal", sizes=SIZES)
        known = KnownRows({("a", 0): 20, ("b", 0): 10}, {}, scale)
        state, batch = ours(case, seed=2)
        state.known_rows = dict(known.partitions)
        state.known_scale = scale
        expected, _, _ = cpu_batch(case, batch, state)
        parts, _, _, _ = device_batch(case, batch, known)
        for key, (embs, sums) in expected.items():
            np.testing.assert_allclose(parts[key][0], embs, rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(parts[key][1], sums, rtol=2e-5, atol=1e-7)


def test_the_fold_plan_gives_each_row_its_first_position():
    rng = np.random.default_rng(0)
    update = torch.from_numpy(rng.integers(0, 6, (3, 20)))
    positions = torch.arange(20)
    first, target = _fold_plan(update, positions, spare=99)
    for g in range(3):
        for p in range(20):
            same = (update[g] == update[g, p]).nonzero().min()
            assert first[g, p] == same
            assert target[g, p] == (update[g, p] if same == p else 99)
