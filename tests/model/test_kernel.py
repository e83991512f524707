"""The engine-facing API: train_bucket / evaluate_bucket / init_* / checkpoint conversion."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.directory import state_dict_key
from pbg_ray.model.kernel import PartitionRows, evaluate_bucket, train_bucket
from pbg_ray.model.params import (
    APPROX_RAND_BLOCK, init_params, init_partition, params_from_checkpoint, params_to_checkpoint)
from pbg_ray.types import Bucket
from tests.model.pbg_oracle import make_case, oracle, ours, pbg_model

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchbiggraph.edgelist import EdgeList as TbgEdgeList
    from torchbiggraph.entitylist import EntityList
    from torchbiggraph.eval import RankingEvaluator

pytestmark = pytest.mark.oracle


def edges_of_two_relations(case, rng):
    case.edges.rel[:] = rng.integers(0, 2, len(case.edges))
    return case


@pytest.mark.parametrize("overrides", [
    dict(operator="complex_diagonal", loss_fn="softmax"),
    dict(operator="translation", comparator="l2", dynamic_relations=True),
    dict(lhs="f", operator="diagonal", comparator="cos", loss_fn="logistic"),
    dict(regularization_coef=0.01, operator="diagonal", weights=True),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_train_bucket_learns_in_place(overrides, threads):
    case = make_case(num_edges=300, **overrides)
    if not case.config.dynamic_relations:
        edges_of_two_relations(case, np.random.default_rng(1))
    parts, params = case.copy_state()
    before = {k: e.copy() for k, (e, _) in parts.items()}
    losses = []
    for epoch in range(4):
        stats = train_bucket(case.config, Bucket(0, 0), case.edges, parts, params,
                             num_threads=threads, seed=epoch)
        assert stats["count"] == 300 and stats["edges_per_s"] > 0
        assert set(stats["metrics"]) == {"loss", "reg", "violators_lhs", "violators_rhs"}
        losses.append(stats["metrics"]["loss"])
    assert losses[-1] < losses[0]
    assert (stats["metrics"]["reg"] > 0) == (case.config.regularization_coef > 0)
    rel = case.config.relations[0]
    changed = [not np.array_equal(before[k], parts[k][0]) for k in ((rel.lhs, 0), (rel.rhs, 0))]
    assert all(changed)
    assert all(parts[k][1].max() > case.partitions[k][1].max() for k in ((rel.rhs, 0),))


def test_train_bucket_per_partition_keys():
    """Partitioned types use (type, bucket side's partition); unpartitioned ones (type, 0)."""
    case = make_case(entities={"a": {"num_partitions": 2}, "b": {}, "f": {"featurized": True}})
    parts, params = case.copy_state()
    parts[("a", 1)] = parts.pop(("a", 0))
    before = parts[("b", 0)][0].copy()
    train_bucket(case.config, Bucket(1, 0), case.edges, parts, params)
    assert not np.array_equal(before, parts[("b", 0)][0])


def test_evaluate_matches_ranking_evaluator():
    # Many entities: ranks count ties (a negative equal to the positive), which duplicate
    # entities would create and rounding could break either way.
    case = make_case(eval_num_batch_negs=5, eval_num_uniform_negs=7, comparator="cos",
                     operator="diagonal", sizes={"a": 1000, "b": 1000, "f": 10})
    _, batch = ours(case, seed=3, eval_negs=True)
    o = oracle(case, batch, eval_negs=True)
    edges = TbgEdgeList(EntityList.from_tensor(torch.tensor(case.edges.lhs)),
                        EntityList.from_tensor(torch.tensor(case.edges.rhs)),
                        torch.tensor(case.edges.rel[0]))
    with torch.no_grad():
        expected = RankingEvaluator().eval(o.scores, edges)
    parts, params = case.copy_state()
    for arrays in parts.values():  # evaluation must work on read-only (Ray store) arrays
        for a in arrays:
            a.flags.writeable = False
    got = evaluate_bucket(case.config, Bucket(0, 0), case.edges, parts, params, seed=3,
                          num_batch_negs=5, num_uniform_negs=7)
    assert got["count"] == len(case.edges) == expected.count
    for key in ("pos_rank", "mrr", "r1", "r10", "r50"):
        assert got["metrics"][key] == pytest.approx(expected.metrics[key], rel=1e-5), key
    assert 0 <= got["metrics"]["auc"] <= len(case.edges)


def test_evaluate_reads_only_the_rows_its_batches_name():
    """Partitions given as PartitionRows: only the rows of the positives and of their
    uniform negatives are read, and the metrics are those of the whole partitions."""
    case = make_case(eval_num_batch_negs=5, eval_num_uniform_negs=7, comparator="cos",
                     operator="diagonal", sizes={"a": 1000, "b": 1000, "f": 10})
    parts, params = case.copy_state()
    reads = []

    def by_rows(embeddings):
        def read(offsets):
            reads.append(offsets)
            return embeddings if offsets is None else embeddings[offsets]
        return PartitionRows(len(embeddings), read)

    counts = dict(seed=3, num_batch_negs=5, num_uniform_negs=7)
    whole = evaluate_bucket(case.config, Bucket(0, 0), case.edges, parts, params, **counts)
    rows = {key: by_rows(embeddings) for key, (embeddings, _) in parts.items()}
    assert evaluate_bucket(case.config, Bucket(0, 0), case.edges, rows, params, **counts) == whole
    # Per table of the relation: 23 positives and 7 uniform negatives for each of 5 chunks
    # at most; none of the featurized type's, which no edge of the bucket names.
    assert sorted(len(o) > 0 for o in reads) == [False, True, True]
    assert all(len(o) <= 23 + 5 * 7 for o in reads)
    assert all(np.array_equal(o, np.unique(o)) for o in reads)


def test_init_partition():
    case = make_case(init_scale=0.01)
    embs, sums = init_partition(case.config, "a", 5000, np.random.default_rng(0))
    assert embs.shape == (5000, 8) and embs.dtype == np.float32
    assert sums.shape == (5000,) and not sums.any()
    assert embs.std() == pytest.approx(0.01, rel=0.05)


def test_init_partition_of_a_large_table_repeats_one_block_of_draws_as_pbg_does():
    case = make_case(init_scale=0.01)
    count = APPROX_RAND_BLOCK // 8 + 1000  # 8 columns: a little over one block of values
    embs, _ = init_partition(case.config, "a", count, np.random.default_rng(0))
    assert embs.shape == (count, 8) and embs.flags.c_contiguous
    flat = embs.reshape(-1)
    np.testing.assert_array_equal(flat[APPROX_RAND_BLOCK:], flat[:len(flat) - APPROX_RAND_BLOCK])
    assert len(np.unique(embs, axis=0)) == count  # the block's prime length shifts each repeat
    assert embs.std() == pytest.approx(0.01, rel=0.05)


@pytest.mark.parametrize("overrides", [
    dict(operator="affine"),
    dict(operator="complex_diagonal", dynamic_relations=True),
    dict(operator="none"),
])
def test_checkpoint_layout_is_torchbiggraphs(overrides):
    """Our optimizer state is what torchbiggraph's global Adagrad writes for its
    model.parameters(), and our public names map to its state dict keys in that order."""
    case = make_case(**overrides)
    model = pbg_model(case.config, case.num_rel_ids, 5, 4)
    arrays, state = params_to_checkpoint(case.config, case.params)
    names = [n for n, _ in model.named_parameters()]
    assert [state_dict_key(k) for k in arrays] == names
    for key, value in arrays.items():
        assert value.shape == tuple(model.state_dict()[state_dict_key(key)].shape)
    if not names:
        assert state == {}
        return
    theirs = torch.optim.Adagrad(model.parameters(), lr=case.config.relation_lr).state_dict()
    assert state["param_groups"] == theirs["param_groups"]
    assert sorted(state["state"]) == sorted(theirs["state"])
    loaded = params_from_checkpoint(case.config, case.num_rel_ids, arrays, state)
    for key in case.params.arrays:
        np.testing.assert_array_equal(loaded.arrays[key], case.params.arrays[key])
        np.testing.assert_array_equal(loaded.sums[key], case.params.sums[key])


def test_params_from_checkpoint_defaults_and_errors():
    from pbg_ray.errors import PbgRayError
    case = make_case(operator="diagonal")
    fresh = params_from_checkpoint(case.config, 2, {}, None)
    init = init_params(case.config, 2)
    assert fresh.arrays.keys() == init.arrays.keys()
    with pytest.raises(PbgRayError, match="does not belong"):
        params_from_checkpoint(case.config, 2, {"relations/0/operator/rhs/linear": np.eye(8)}, None)
    with pytest.raises(PbgRayError, match="shape"):
        params_from_checkpoint(case.config, 2, {"relations/0/operator/rhs/diagonal": np.ones(3)},
                               None)
