"""Negatives from beyond the bucket (beyond_bucket_negs): the draw reaches every partition
of the type, uniformly; a side scores only the other partitions' rows, with the sampled
softmax's correction; its gradients, the drawn rows' included, are those of a softmax over
its own partition with those rows appended (each repeated as often as the correction
counts it); the rows themselves are never written by the bucket, their gradients come back
per partition, summed over its batches, and applied later as RowAdagrad steps; with
beyond_batch_negs each batch scores a sample of its own of them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pbg_ray.model.kernel import EdgeTensors, KernelState, build_batch, train_bucket
from pbg_ray.model.beyond import BeyondBucket, BeyondRows, RowGradients, draw_beyond
from pbg_ray.model.optim import row_adagrad_
from pbg_ray.types import Bucket
from tests.model.pbg_oracle import SIZES, Case, dense_row_grads, make_case

pytestmark = pytest.mark.oracle  # the kernel's cases come from the oracle's helpers


def test_draws_reach_every_partition_in_proportion_to_its_rows():
    sizes = {0: 100, 1: 300, 2: 50, 3: 550}
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    for _ in range(400):
        drawn = draw_beyond(sizes, 20, rng)
        assert sum(len(o) for o in drawn.values()) == 20
        for part, offsets in drawn.items():
            assert np.all(np.diff(offsets) > 0) and 0 <= offsets.min() \
                and offsets.max() < sizes[part]
            counts[part] += len(offsets)
    expected = np.array([sizes[p] for p in range(4)]) / 1000 * 8000
    assert np.all(counts > 0)
    assert np.abs(counts - expected).max() < 0.1 * expected.max()
    assert sum(len(o) for o in draw_beyond({0: 3, 1: 2}, 10, rng).values()) == 5


def test_a_side_scores_the_other_partitions_rows_at_their_rate():
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    drawn = BeyondBucket(rows, np.array([0, 0, 1, 2, 2, 2]), np.array([3, 7, 0, 1, 5, 9]),
                         {0: 10, 1: 20, 2: 30})
    side = drawn.for_side(2)
    assert side.rows.tolist() == rows[:3].tolist() and side.index.tolist() == [0, 1, 2]
    assert side.log_weight == pytest.approx(math.log(30 / 3))
    assert drawn.for_side(1).log_weight == pytest.approx(math.log(40 / 5))
    assert drawn.for_side(1).index.tolist() == [0, 1, 3, 4, 5]
    assert BeyondBucket(rows[:1], np.array([1]), np.array([0]), {0: 5, 1: 5}).for_side(1) is None
    # Gradients come back per partition, at the rows' offsets there; rows no side
    # scored (zero squares) are left out.
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    back = drawn.gradients(grads, np.array([1, 1, 0, 2, 2, 2], np.float32))
    assert sorted(back) == [0, 2]
    assert back[0].offsets.tolist() == [3, 7] and back[0].grads.tolist() == grads[:2].tolist()
    assert back[2].offsets.tolist() == [1, 5, 9] and back[2].squares.tolist() == [2, 2, 2]


def _with_rows(case: Case, extra: dict) -> Case:
    """The case with `extra[entity]` rows appended to that entity's partition."""
    parts = dict(case.partitions)
    for entity, rows in extra.items():
        embs, sums = parts[entity, 0]
        parts[entity, 0] = (np.concatenate([embs, rows]),
                            np.concatenate([sums, np.ones(len(rows), np.float32)]))
    return Case(case.config, case.num_rel_ids, parts, case.params, case.edges)


def _gradients(case: Case, beyond=None):
    parts, params = case.copy_state()
    state = KernelState(case.config, parts, params, writable=True)
    sizes = {k: t.shape[0] for k, t in state.tables.items()}
    batch = build_batch(case.config, case.bucket, EdgeTensors(case.edges),
                        np.arange(len(case.edges)), 0, 0, sizes, torch.Generator(), beyond)
    grads = state.embedder.backward(batch, state.embedder.forward(batch))
    return grads, dense_row_grads(state, grads.rows)


@pytest.mark.parametrize("comparator", ["dot", "cos", "l2"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_gradients_are_a_softmax_over_the_rows_appended(comparator, dynamic):
    case = make_case(all_negs=True, loss_fn="softmax", comparator=comparator,
                     operator="complex_diagonal", dynamic_relations=dynamic)
    rng = np.random.default_rng(1)
    extra = {e: rng.normal(0, 0.5, (5, case.config.dimension)).astype(np.float32)
             for e in ("a", "b")}
    repeat = 3  # the correction log(3): each row counts three times
    beyond = {(e, 0): BeyondRows(rows, math.log(repeat), np.arange(len(rows)))
              for e, rows in extra.items()}
    mine, mine_rows = _gradients(case, beyond)
    theirs, theirs_rows = _gradients(
        _with_rows(case, {e: np.tile(rows, (repeat, 1)) for e, rows in extra.items()}))
    assert mine.loss == pytest.approx(theirs.loss, rel=1e-5)
    for key, g in mine_rows.items():
        assert g.shape[0] == SIZES[key[0]]
        torch.testing.assert_close(g, theirs_rows[key][:SIZES[key[0]]], rtol=1e-4, atol=1e-5)
    # A drawn row's gradient: its copies' together.
    for name in ("lhs", "rhs"):
        entity = getattr(case.config.relations[0], name)
        copies = theirs_rows[entity, 0][SIZES[entity]:].reshape(repeat, 5, -1)
        torch.testing.assert_close(mine.beyond[name], copies.sum(0), rtol=1e-4, atol=1e-5)
    assert set(mine.params) == set(theirs.params)
    for name, g in theirs.params.items():
        torch.testing.assert_close(mine.params[name], g, rtol=1e-4, atol=1e-5)


def test_training_writes_only_the_buckets_partitions():
    case = make_case(num_edges=60, all_negs=True, loss_fn="softmax", dynamic_relations=True,
                     operator="complex_diagonal")
    rows = np.random.default_rng(2).normal(0, 0.5, (7, case.config.dimension)).astype(np.float32)
    rows.setflags(write=False)  # a write into them would raise
    drawn = BeyondBucket(rows, np.array([1, 1, 1, 2, 2, 2, 2]), np.array([0, 4, 9, 2, 3, 5, 8]),
                         {0: 13, 1: 20, 2: 20})
    parts, params = case.copy_state()
    before = {k: e.copy() for k, (e, _) in parts.items()}
    trained = train_bucket(case.config, Bucket(0, 0), case.edges, parts, params, num_threads=2,
                           beyond={"a": drawn, "b": drawn})
    assert np.array_equal(rows, drawn.rows)
    assert not np.array_equal(parts["a", 0][0], before["a", 0])
    # Their gradients come back for their own partitions, every drawn row's.
    back = trained["drawn"]
    assert sorted(back) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert back["a", 1].offsets.tolist() == [0, 4, 9]
    assert back["b", 2].offsets.tolist() == [2, 3, 5, 8]
    assert all(np.all(g.squares > 0) and g.grads.shape == (len(g.offsets), case.config.dimension)
               for g in back.values())


def test_each_batch_scores_its_own_sample_of_the_bucket_s_rows():
    """beyond_batch_negs: a batch's sample is that many of a side's rows, in their order,
    with the correction for the smaller sample; over many batches every row is met, about
    equally often."""
    rows = np.arange(40, dtype=np.float32).reshape(20, 2)
    side = BeyondRows(rows, math.log(3.0), np.arange(5, 25))
    rng = np.random.default_rng(4)
    met = np.zeros(20)
    for _ in range(500):
        got = side.sample(4, rng)
        assert len(got.index) == 4 and np.all(np.diff(got.index) > 0)
        assert got.rows.tolist() == rows[got.index - 5].tolist()
        assert got.log_weight == pytest.approx(math.log(3.0 * 20 / 4))
        met[got.index - 5] += 1
    assert np.all(np.abs(met - 100) < 40)  # 100 expected a row, standard deviation 9
    assert side.sample(20, rng) is side and side.sample(30, rng) is side


@pytest.mark.parametrize("batch_size, reached", [(60, 2), (5, 7)])
def test_a_bucket_s_batches_sample_the_drawn_rows_anew(batch_size, reached):
    """With beyond_batch_negs=2 one batch's gradients reach 2 of a type's 7 drawn rows;
    the twelve batches of a bucket reach all of them."""
    case = make_case(num_edges=60, all_negs=True, loss_fn="softmax", dynamic_relations=True,
                     operator="complex_diagonal", batch_size=batch_size, num_batch_negs=5,
                     beyond_bucket_negs=7, beyond_batch_negs=2)
    rows = np.random.default_rng(2).normal(0, 0.5, (7, case.config.dimension)).astype(np.float32)
    drawn = BeyondBucket(rows, np.array([1, 1, 1, 2, 2, 2, 2]), np.array([0, 4, 9, 2, 3, 5, 8]),
                         {0: 13, 1: 20, 2: 20})
    parts, params = case.copy_state()
    back = train_bucket(case.config, Bucket(0, 0), case.edges, parts, params,
                        beyond={"a": drawn, "b": drawn})["drawn"]
    assert sum(len(g.offsets) for (e, _), g in back.items() if e == "a") == reached
    assert sum(len(g.offsets) for (e, _), g in back.items() if e == "b") == reached


@pytest.mark.parametrize("known, known_scale", [(0, 1.0), (4, 0.5), (4, 0.0)])
def test_applied_later_a_batch_s_gradients_are_its_row_adagrad_step(known, known_scale):
    """One batch's gradients of drawn rows, applied later, step those rows as RowAdagrad
    would have in the batch (rows init_path trained at their own rate)."""
    rng = np.random.default_rng(3)
    embs = rng.normal(0, 0.5, (10, 6)).astype(np.float32)
    sums = rng.uniform(0.1, 1, 10).astype(np.float32)
    offsets = np.array([1, 3, 4, 8])
    grads = rng.normal(0, 1, (4, 6)).astype(np.float32)
    mine = (embs.copy(), sums.copy())
    RowGradients(offsets, grads, np.square(grads).mean(1)).apply(*mine, 0.1, known, known_scale)
    theirs = (torch.from_numpy(embs.copy()), torch.from_numpy(sums.copy()))
    row_adagrad_(*theirs, torch.from_numpy(offsets), torch.from_numpy(grads.copy()), 0.1,
                 torch.empty(10, dtype=torch.long), known, known_scale)
    np.testing.assert_allclose(mine[1], theirs[1].numpy(), rtol=1e-6)
    np.testing.assert_allclose(mine[0], theirs[0].numpy(), rtol=1e-5, atol=1e-7)
    assert not np.array_equal(mine[0], embs)
