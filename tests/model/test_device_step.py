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
                                       _fold_plan, read_back, train_bucket_on_device,
                                       with_spare_row)
from pbg_ray.model import operators
from pbg_ray.model.embedder import Batch
from pbg_ray.model.kernel import train_batch
from pbg_ray.model.params import KnownRows
from pbg_ray.types import Bucket
from pbg_ray.model.dispatch import DispatchCount
from tests.model.pbg_oracle import Case, make_case, ours

# The CPU kernel's cases and batches come from the oracle's helpers (which import
# torchbiggraph).
pytestmark = pytest.mark.oracle


def device_batch(case: Case, batch: Batch, known: KnownRows = None, device: str = "cpu"
                 ) -> Tuple[Dict, Dict, Dict]:
    """The device step's tables, parameters and stats after the CPU kernel's `batch` (its
    ids and negatives) trained on `device` from copies of the case's state: (partitions,
    params arrays, stats)."""
    dev = torch.device(device)
    parts, params = case.copy_state()
    on_device = {k: with_spare_row(e, s, dev) for k, (e, s) in parts.items()}
    tables = DeviceTables.join(on_device)
    shared = DeviceParams(case.config, params, dev)
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
        negatives.append((rows + o).unsqueeze(0).to(dev))
    weight = torch.zeros(cap)
    weight[:count] = case.config.relations[batch.relation].weight
    if batch.weight is not None:
        weight[:count] *= batch.weight
    rel = _pad(batch.rel_ids, cap).unsqueeze(0)
    group = step.index_group(pos.unsqueeze(0).to(dev), tuple(negatives),
                             weight.unsqueeze(0).to(dev), rel.to(dev))
    step.step(group, 0, count)
    tables.split(on_device)
    for key, (embs, sums) in parts.items():
        embs[...] = on_device[key][0][:-1].cpu().numpy()
        sums[...] = on_device[key][1][:-1].cpu().numpy()
    stats = read_back(trainer._stats([step]), shared, params)
    return parts, params.arrays, stats


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


ON_A_GPU = [pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
@pytest.mark.parametrize("num_edges", [30, 23])  # a full batch, and a padded one
@pytest.mark.parametrize("overrides", GRID, ids=_name)
def test_a_batch_updates_what_the_cpu_kernel_updates(overrides, num_edges, device):
    overrides = dict(overrides)
    weights = overrides.pop("weights", False)
    case = make_case(num_edges=num_edges, weights=weights, sizes=SIZES,
                     **overrides)
    state, batch = ours(case, seed=5)
    expected_parts, expected_params, (loss, reg, vl, vr) = cpu_batch(case, batch, state)
    parts, params, stats = device_batch(case, batch, device=device)
    rtol = 2e-5 if device == "cpu" else 1e-4  # a GPU's products sum in other orders
    for key, (embs, sums) in expected_parts.items():
        np.testing.assert_allclose(parts[key][0], embs, rtol=rtol, atol=rtol / 10, err_msg=str(key))
        np.testing.assert_allclose(parts[key][1], sums, rtol=rtol, atol=1e-7, err_msg=str(key))
    for name, value in expected_params.items():
        np.testing.assert_allclose(params[name], value, rtol=rtol, atol=rtol / 10, err_msg=name)
    assert stats["loss"] == pytest.approx(loss, rel=rtol / 2)
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
        parts, _, _ = device_batch(case, batch, known)
        for key, (embs, sums) in expected.items():
            np.testing.assert_allclose(parts[key][0], embs, rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(parts[key][1], sums, rtol=2e-5, atol=1e-7)


def test_the_fold_plan_adds_each_position_to_its_rows_first():
    rng = np.random.default_rng(0)
    update = torch.from_numpy(rng.integers(0, 6, (3, 20)))
    positions = torch.arange(20)
    fold, target = _fold_plan(update, positions, spare=99)
    for g in range(3):
        for p in range(20):
            first = (update[g] == update[g, p]).nonzero().min()
            assert fold[g, p] == (20 if first == p else first)
            assert target[g, p] == (update[g, p] if first == p else 99)


# --- the batch loop's cost: operations and host reads --------------------------------


def kernel_bench_a(num_edges: int, num_entities: int = 10_000):
    """kernel_bench's setting A (PBG's CPU defaults) on a generated bucket: (config, edges,
    partitions, params)."""
    from pbg_ray.config import ConfigSchema
    from pbg_ray.model.params import init_params
    from pbg_ray.types import EdgeList
    config = ConfigSchema.from_dict(dict(
        entities={"node": {"num_partitions": 1}},
        relations=[{"name": "link", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}],
        dimension=100, comparator="dot", loss_fn="softmax", num_batch_negs=50,
        num_uniform_negs=100, batch_size=1000, global_emb=False, lr=0.1,
        entity_path="/unused", edge_paths=["/unused"], checkpoint_path="/unused"))
    rng = np.random.default_rng(0)
    edges = EdgeList(rng.integers(0, num_entities, num_edges),
                     rng.integers(0, num_entities, num_edges), np.zeros(num_edges, np.int64))
    parts = {("node", 0): (rng.standard_normal((num_entities, 100), dtype=np.float32) * 1e-3,
                           np.zeros(num_entities, np.float32))}
    return config, edges, parts, init_params(config, 1)


def counted_bucket(monkeypatch, config, edges, parts, params, seed=0):
    """Train the bucket on the CPU under a DispatchCount: (the count, host reads inside
    the batch steps)."""
    reads_in_steps = []
    step = KindStep.step

    def watched(self, *args):
        before = count.num_host_reads
        step(self, *args)
        reads_in_steps.append(count.num_host_reads - before)

    monkeypatch.setattr(KindStep, "step", watched)
    count = DispatchCount()
    with count.watching_reads():
        train_bucket_on_device(config, Bucket(0, 0), edges, parts, params, device="cpu",
                               seed=seed)
    return count, reads_in_steps


def test_setting_a_dispatches_at_most_30_operations_a_batch_and_reads_once(monkeypatch):
    # As on a GPU, every operation goes through torch (no C loop on the CPU).
    monkeypatch.setattr(operators, "_operators", None)
    config, edges, parts, params = kernel_bench_a(num_edges=128_000)
    count, reads_in_steps = counted_bucket(monkeypatch, config, edges, parts, params)
    assert len(reads_in_steps) == 128
    per_batch = count.num_ops / 128
    assert per_batch <= 30, f"{per_batch:.2f} operations a batch: {count.ops.most_common()}"
    assert sum(reads_in_steps) == 0
    # The stats and parameters, read back at the bucket's end in one copy.
    assert count.num_host_reads == 1, count.host_reads


@pytest.mark.parametrize("overrides", GRID, ids=_name)
def test_no_setting_reads_the_host_inside_the_batch_loop(monkeypatch, overrides):
    overrides = dict(overrides)
    case = make_case(num_edges=95, weights=overrides.pop("weights", False), sizes=SIZES,
                     **overrides)
    parts, params = case.copy_state()
    count, reads_in_steps = counted_bucket(monkeypatch, case.config, case.edges, parts, params)
    assert len(reads_in_steps) >= 3 and sum(reads_in_steps) == 0
    # The batch plan (per-relation mode: two relations; a padded batch) and the stats.
    assert count.num_host_reads <= 2, count.host_reads


def test_a_bucket_follows_its_seed():
    case = make_case(num_edges=200, operator="complex_diagonal", loss_fn="softmax", sizes=SIZES)
    results = []
    for seed in (7, 7, 8):
        parts, params = case.copy_state()
        stats = train_bucket_on_device(case.config, case.bucket, case.edges, parts, params,
                                       device="cpu", seed=seed)
        results.append((parts, params.arrays, stats["metrics"]))
    (a, pa, sa), (b, pb, sb), (c, _, sc) = results
    for key in a:
        np.testing.assert_array_equal(a[key][0], b[key][0])
        np.testing.assert_array_equal(a[key][1], b[key][1])
    for name in pa:
        np.testing.assert_array_equal(pa[name], pb[name])
    assert sa == sb
    assert not np.array_equal(a[("a", 0)][0], c[("a", 0)][0]) and sa != sc


# --- what it learns ------------------------------------------------------------------


def planted_graph(num_nodes=300, groups=6, num_train=3000, num_test=400, seed=0):
    """Edges of two relations between nodes of the same planted group: (train, test)."""
    from pbg_ray.types import EdgeList
    rng = np.random.default_rng(seed)
    group = rng.integers(0, groups, num_nodes)
    members = [np.flatnonzero(group == g) for g in range(groups)]
    n = num_train + num_test
    lhs = rng.integers(0, num_nodes, n)
    rhs = np.array([rng.choice(members[g]) for g in group[lhs]])
    rel = rng.integers(0, 2, n)
    return (EdgeList(lhs[:num_train], rhs[:num_train], rel[:num_train]),
            EdgeList(lhs[num_train:], rhs[num_train:], rel[num_train:]))


def trained_mrr(train_fn, overrides, epochs=6, **kwargs) -> float:
    """Sampled MRR (100 uniform negatives) on the planted graph's test edges after
    `epochs` passes of train_fn (kernel.train_bucket or train_bucket_on_device)."""
    from pbg_ray.config import ConfigSchema
    from pbg_ray.model.kernel import evaluate_bucket
    from pbg_ray.model.params import init_params, init_partition
    dynamic = overrides.get("dynamic_relations", False)
    relations = [{"name": f"r{i}", "lhs": "node", "rhs": "node",
                  "operator": overrides["operator"]} for i in range(1 if dynamic else 2)]
    config = ConfigSchema.from_dict(dict(
        entities={"node": {}}, relations=relations, dimension=16, batch_size=100,
        num_batch_negs=10, num_uniform_negs=10, lr=0.1, init_scale=0.1, global_emb=not dynamic,
        entity_path="/unused", edge_paths=["/unused"], checkpoint_path="/unused",
        **{k: v for k, v in overrides.items() if k != "operator"}))
    train, test = planted_graph()
    parts = {("node", 0): init_partition(config, "node", 300, np.random.default_rng(0))}
    params = init_params(config, 2)
    for epoch in range(epochs):
        seed = int(np.random.SeedSequence([epoch]).generate_state(1, np.uint64)[0])
        train_fn(config, Bucket(0, 0), train, parts, params, seed=seed, **kwargs)
    stats = evaluate_bucket(config, Bucket(0, 0), test, parts, params, num_batch_negs=0,
                            num_uniform_negs=100, seed=1)
    return stats["metrics"]["mrr"] / stats["count"]


# Every operator, comparator and loss at least once, and dynamic relations.
LEARNING = [
    dict(operator="none", comparator="dot", loss_fn="softmax"),
    dict(operator="diagonal", comparator="cos", loss_fn="logistic"),
    dict(operator="translation", comparator="l2", loss_fn="ranking"),
    dict(operator="linear", comparator="squared_l2", loss_fn="softmax"),
    dict(operator="affine", comparator="dot", loss_fn="ranking"),
    dict(operator="complex_diagonal", comparator="cos", loss_fn="softmax"),
    dict(operator="complex_diagonal", comparator="l2", loss_fn="logistic", dynamic_relations=True),
]


@pytest.mark.parametrize("overrides", LEARNING, ids=_name)
def test_the_device_step_learns_what_the_cpu_kernel_learns(overrides):
    from pbg_ray.model.kernel import train_bucket
    cpu = trained_mrr(train_bucket, overrides)
    device = trained_mrr(train_bucket_on_device, overrides, device="cpu")
    # Random ranking scores about 0.05; between seeds either kernel's MRR moves by up to 0.025.
    assert cpu > 0.15 and device > 0.15
    assert abs(device - cpu) <= 0.04, (cpu, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bucket_on_a_gpu_follows_its_seed():
    """On a GPU the draws follow the seed; a row's gradients fold by atomic adds, whose
    order may round their sums differently."""
    case = make_case(num_edges=300, operator="complex_diagonal", loss_fn="softmax", sizes=SIZES)
    results = []
    for seed in (7, 7):
        parts, params = case.copy_state()
        stats = train_bucket_on_device(case.config, case.bucket, case.edges, parts, params,
                                       device="cuda", seed=seed)
        results.append((parts, stats["metrics"]))
    (a, sa), (b, sb) = results
    for key in a:
        np.testing.assert_allclose(a[key][0], b[key][0], rtol=1e-5, atol=1e-6)
    assert (sa["violators_lhs"], sa["violators_rhs"]) == (sb["violators_lhs"], sb["violators_rhs"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_train_as_the_kernels_launched_one_by_one():
    """A bucket of 4 groups and a short batch: the first group runs as it is, the second
    is captured, the rest replayed; the same draws, the tables equal to rounding."""
    from pbg_ray.model.device_step import GROUP_BATCHES
    case = make_case(num_edges=30 * (4 * GROUP_BATCHES) + 17, operator="complex_diagonal",
                     loss_fn="softmax", sizes=SIZES, dynamic_relations=True)
    results = []
    for graphs in (False, True):
        parts, params = case.copy_state()
        stats = train_bucket_on_device(case.config, case.bucket, case.edges, parts, params,
                                       device="cuda", seed=4, cuda_graphs=graphs)
        results.append((parts, stats["metrics"]))
    (eager, eager_stats), (graphs, graph_stats) = results
    for key in eager:
        np.testing.assert_allclose(graphs[key][0], eager[key][0], rtol=1e-4, atol=1e-5)
    assert graph_stats["loss"] == pytest.approx(eager_stats["loss"], rel=1e-4)
