"""A shard's search without Ray: approximate hits carry the exact scores of exact search."""


import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.serving.index import index_file
from pbg_ray.serving.shards import ShardTables
from tests.serving.util import build_all, served_config
from tests.util import commit_random_version


@pytest.mark.parametrize("comparator,kind", [("cos", "hnsw"), ("dot", "hnsw"), ("l2", "hnsw"),
                                             ("cos", "ivf"), ("dot", "ivf")])
def test_shard_search_approximate_hits_carry_exact_scores(tmp_path, comparator, kind):
    config = served_config(tmp_path, comparator=comparator, index=kind)
    build_all(config)
    shard = ShardTables(config, 1, 0)
    # follows' rhs candidates: translated. l2's query carries the translation with the
    # distances unchanged, so the relation has no set of its own; dot's carries it for the
    # ranking only, so its set is searched in the relation-free index with the adjoint
    # query and re-ranked by its own scores; cos has an index of its own.
    key = ("user", 0, None if comparator == "l2" else 0)
    assert (("user", 0, 0) in shard.sets) == (comparator != "l2")
    assert index_file(config, 1, ("user", 0, 0), kind).is_file() == (comparator == "cos")
    assert index_file(config, 1, ("user", 0, None), kind).is_file()
    queries = np.random.default_rng(0).normal(size=(6, config.dimension)).astype(np.float32)
    exact_scores, exact_ids = shard.search(key, queries, 5, True)
    scores, ids = shard.search(key, queries, 5, False)
    np.testing.assert_array_equal(ids, exact_ids)  # a 30-row HNSW graph finds them all
    np.testing.assert_allclose(scores, exact_scores, rtol=1e-5, atol=1e-5)
    cands = shard.sets[key].vectors
    direct = shard.scorer.matrix(torch.from_numpy(queries), cands)
    np.testing.assert_allclose(scores, direct.gather(1, torch.from_numpy(ids)).numpy(),
                               rtol=1e-5, atol=1e-5)
    # k beyond the set: every candidate once; the query's own entity (partition, offset)
    # leaves the answer and its place at the end is -inf and -1.
    skipped, skip_ids = shard.search(key, queries[:1], 100, False, None,
                                     np.array([[key[1], ids[0, 0]]]))
    assert skip_ids.shape == (1, len(cands)) and ids[0, 0] not in skip_ids[0]
    assert sorted(skip_ids[0][:-1]) == sorted(set(range(len(cands))) - {ids[0, 0]})
    assert np.isneginf(skipped[0][skip_ids[0] == -1]).all()




def test_a_version_kept_in_best_alone_is_indexed_and_searched(tmp_path):
    """Version 1, best on validation, superseded by version 2: its files are in best/ alone,
    and a shard builds its indexes and answers from them as from the checkpoint's own."""
    config = served_config(tmp_path)
    commit_random_version(config, 1, best=True)
    commit_random_version(config, 2)
    assert not CheckpointManager(config.checkpoint_path).has_model(1)
    assert all(f["kind"] == "hnsw" for f in build_all(config, 1))
    shard = ShardTables(config, 1, 0)
    best = CheckpointManager(config.checkpoint_path).holding(1)
    np.testing.assert_array_equal(shard.rows("user", 0, np.arange(3)),
                                  best.read_partition(1, "user", 0)[0][:3])
    queries = np.random.default_rng(0).normal(size=(2, config.dimension)).astype(np.float32)
    np.testing.assert_array_equal(shard.search(("user", 0, None), queries, 3)[1],
                                  shard.search(("user", 0, None), queries, 3, True)[1])
