"""The service's math without Ray: candidate sets per relation operator, faiss indexes with
the comparator's metric (saved beside their version, rebuilt for a new one), a shard's
search against exact search and the Predictor's, and the router's merging of shards."""

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.serving.shards import (
    ServingModel, ShardTables, adjoint_queries, build_index, build_set_index, drop_old_indexes,
    in_process_shards, index_file, index_keys, index_kind, set_keys, shares_index)
from tests.util import config_dict, random_checkpoint, write_random_graph


def served_config(tmp_path, **serve):
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, comparator=serve.pop("comparator", "cos"),
        serve={"index": "hnsw", "shard_groups": 2, **serve}))
    write_random_graph(config, num_edges=80)
    random_checkpoint(config)
    return config


def build_all(config, version=1):
    return [build_set_index(config, version, key) for key in index_keys(config)]


def local_shards(config, version=1):
    """The shards as the router reaches them, called in this process."""
    return in_process_shards(config, version)


def test_candidate_sets_follow_the_operators(tmp_path):
    config = served_config(tmp_path)
    # follows (translation) and likes (diagonal) transform their rhs candidates; tagged (none)
    # shares the tag type's set; shard group 1 holds the partitions 1.
    assert set_keys(config, 1) == [("user", 1, None), ("user", 1, 0), ("item", 1, None),
                                   ("item", 1, 1)]
    assert ("tag", 0, None) in set_keys(config, 0) and ("tag", 0, 2) not in set_keys(config)
    dynamic = dataclasses.replace(config, dynamic_relations=True)
    assert all(relation is None for _, _, relation in set_keys(dynamic))


@pytest.mark.parametrize("comparator,metric", [("dot", 0), ("cos", 0), ("l2", 1),
                                               ("squared_l2", 1)])
def test_the_index_searches_with_the_comparators_metric(comparator, metric):
    """faiss's METRIC_INNER_PRODUCT is 0, METRIC_L2 1; an IVF index probing every list
    finds exact search's top 10 under that metric."""
    import faiss
    from pbg_ray.config import ServeConfig

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(2000, 16)).astype(np.float32)
    serve = ServeConfig(ivf_lists=8)
    index = build_index(vectors, "ivf", comparator, serve)
    assert index.metric_type == metric
    index.nprobe = 8
    query = rng.normal(size=(5, 16)).astype(np.float32)
    _, hits = index.search(query, 10)
    exact = query @ vectors.T if metric == 0 else -((query[:, None] - vectors[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(np.sort(hits, 1), np.sort(np.argsort(-exact, 1)[:, :10], 1))
    assert isinstance(build_index(vectors, "hnsw", comparator, serve), faiss.IndexHNSWFlat)


def test_index_kind_by_size(tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, serve={
        "index": "auto", "index_min_rows": 100, "ivf_min_rows": 1000}))
    assert [index_kind(config, n) for n in (99, 100, 999, 1000)] == ["exact", "hnsw", "hnsw", "ivf"]
    assert index_kind(dataclasses.replace(config, bias=True), 5000) == "exact"
    with pytest.raises(PbgRayError, match="serve.index: hnsw can't search a biased"):
        ConfigSchema.from_dict(config_dict(tmp_path, bias=True, serve={"index": "hnsw"}))


def test_indexes_are_saved_beside_their_version_and_rebuilt_for_a_new_one(tmp_path):
    config = served_config(tmp_path)
    first = build_all(config)
    assert all(f["seconds"] > 0 for f in first)
    key = set_keys(config)[0]
    assert index_file(config, 1, key, "hnsw").is_file()
    assert all(f["seconds"] == 0 for f in build_all(config))  # found saved
    random_checkpoint(config, version=2, seed=1)
    assert all(f["seconds"] > 0 for f in build_all(config, 2))
    drop_old_indexes(config, [2])
    assert not index_file(config, 1, key, "hnsw").exists()
    assert index_file(config, 2, key, "hnsw").is_file()
    # Other build settings: another file, built anew.
    other = dataclasses.replace(config, serve=dataclasses.replace(config.serve, hnsw_m=8))
    assert index_file(other, 2, key, "hnsw") != index_file(config, 2, key, "hnsw")


@pytest.mark.parametrize("comparator,kind", [("cos", "hnsw"), ("dot", "hnsw"), ("l2", "hnsw"),
                                             ("cos", "ivf"), ("dot", "ivf")])
def test_shard_search_approximate_hits_carry_exact_scores(tmp_path, comparator, kind):
    config = served_config(tmp_path, comparator=comparator, index=kind)
    build_all(config)
    shard = ShardTables(config, 1, 0)
    key = ("user", 0, 0)  # follows' rhs candidates: translated
    # dot and l2 search the relation-free index with the adjoint query; cos has its own.
    assert index_file(config, 1, key, kind).is_file() == (comparator == "cos")
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
    # k beyond the set: every candidate once; a skipped offset leaves the answer and its
    # place at the end is -inf and -1.
    skipped, skip_ids = shard.search(key, queries[:1], 100, False, None, np.array([ids[0, 0]]))
    assert skip_ids.shape == (1, len(cands)) and ids[0, 0] not in skip_ids[0]
    assert sorted(skip_ids[0][:-1]) == sorted(set(range(len(cands))) - {ids[0, 0]})
    assert np.isneginf(skipped[0][skip_ids[0] == -1]).all()


def assert_same_ranked(got, want):
    """Two answers of (name, score) pairs: the same names in the same order, the same
    scores within float32 rounding."""
    assert [name for name, _ in got] == [name for name, _ in want]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-5)


def test_the_router_answers_as_the_predictor(tmp_path):
    config = served_config(tmp_path, comparator="dot")
    build_all(config)
    model = ServingModel(config, None)
    predictor = Predictor.load(config.checkpoint_path)
    rows, search = local_shards(config)
    got = asyncio.run(model.top(rows, search, "rhs", [("user-1-3", "likes"),
                                                       ("user-0-2", "follows")], 7,
                                ["edges"], exact=True))
    assert_same_ranked(got[0], predictor.top_rhs("user-1-3", "likes", 7, [config.edge_paths[0]]))
    assert_same_ranked(got[1], predictor.top_rhs("user-0-2", "follows", 7, [config.edge_paths[0]]))
    scores = asyncio.run(model.score(rows, [("user-1-3", "likes", "item-0-4")]))
    np.testing.assert_allclose(scores, predictor.score([("user-1-3", "likes", "item-0-4")]),
                               rtol=1e-5)
    near = asyncio.run(model.neighbors(rows, search, [{"entity": "tag-0-3"}], 3))[0]
    assert_same_ranked(near, predictor.neighbors("tag-0-3", k=3))
    with pytest.raises(PbgRayError, match="k=0 is out of range"):
        asyncio.run(model.top(rows, search, "rhs", [("user-1-3", "likes")], 0))


def test_a_batch_answers_each_query_or_its_error(tmp_path):
    """A query naming an unknown entity or relation (or wrong on its own otherwise) gets its
    PbgRayError in its answer's place; the others are answered as they are alone."""
    config = served_config(tmp_path, index="exact")
    model = ServingModel(config, None)
    rows, search = local_shards(config)
    top = asyncio.run(model.top(rows, search, "rhs", [("user-1-3", "likes"), ("usr-1-3", "likes"),
                                                       ("user-1-3", "lkes"), ("item-0-1", "likes"),
                                                       ("user-0-2", "follows")], 4))
    alone = asyncio.run(model.top(rows, search, "rhs", [("user-1-3", "likes"),
                                                         ("user-0-2", "follows")], 4))
    assert [top[0], top[4]] == alone
    assert [str(e) for e in top[1:4]] == [
        "unknown user entity 'usr-1-3' (did you mean 'user-1-3'?).",
        "unknown relation 'lkes' (did you mean 'likes'?). Relations: follows, likes, tagged.",
        "'item-0-1' is an entity of type 'item', not of type 'user': check the relation and "
        "which side the name is on."]
    assert all(isinstance(e, PbgRayError) for e in top[1:4])
    scores = asyncio.run(model.score(rows, [("user-1-3", "likes", "item-0-4"),
                                            ("user-1-3", "likes", "itme-0-4")]))
    assert scores[0] == asyncio.run(model.score(rows, [("user-1-3", "likes", "item-0-4")]))[0]
    assert str(scores[1]).startswith("unknown item entity 'itme-0-4'")
    near = asyncio.run(model.neighbors(rows, search, [
        {"entity": "tag-0-3"}, {"vector": [1.0, 2.0], "entity_type": "item"},
        {"entity": "tag-0-3", "entity_type": "tga"}], 3))
    assert near[0] == asyncio.run(model.neighbors(rows, search, [{"entity": "tag-0-3"}], 3))[0]
    assert [str(e) for e in near[1:]] == [
        f"vector has 2 values; item embeddings have {config.dimension}, all finite.",
        "unknown entity type 'tga' (did you mean 'tag'?)."]
    with pytest.raises(PbgRayError, match="'edgez' is not an edge path"):  # the whole request
        asyncio.run(model.top(rows, search, "rhs", [("user-1-3", "likes")], 4, ["edgez"]))


@pytest.mark.parametrize("comparator,operators", [
    ("dot", ["none", "translation", "diagonal", "linear", "affine", "complex_diagonal"]),
    ("l2", ["none", "translation"]), ("squared_l2", ["translation"])])
def test_adjoint_queries_rank_the_relation_free_set_as_the_relations_candidates(
        tmp_path, comparator, operators):
    """Per query, the score of a relation's candidate op(x) and the adjoint query's score of
    x differ by a constant (dot) or are the same distance (L2): the same ranking."""
    relations = [{"name": f"r{i}", "lhs": "user", "rhs": "user", "operator": op}
                 for i, op in enumerate(operators)]
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, comparator=comparator, relations=relations,
        entities={"user": {"num_partitions": 1}}))
    write_random_graph(config, num_edges=20, counts={"user": 40})
    random_checkpoint(config)
    model = ServingModel(config, None)
    scorer = model.scorer
    rows = torch.from_numpy(Predictor.load(config.checkpoint_path).embedding_source.read("user", 0))
    base = scorer.comparator.prepare(scorer.entity_vectors("user", rows))[0]
    queries = torch.randn(5, config.dimension)
    for relation in range(len(operators)):
        assert shares_index(config, ("user", 0, relation))
        true = scorer.matrix(queries, scorer.candidates("rhs", relation,
                                                        scorer.entity_vectors("user", rows)))
        adjoint = scorer.matrix(adjoint_queries(scorer, relation, queries), base)
        difference = (true - adjoint).numpy()
        np.testing.assert_allclose(difference, difference[:, :1].repeat(40, 1), atol=1e-4,
                                   err_msg=operators[relation])


def test_cos_and_biased_models_index_each_relations_set(tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, comparator="cos"))
    assert not shares_index(config, ("user", 0, 0))
    biased = ConfigSchema.from_dict(config_dict(tmp_path, comparator="dot", bias=True))
    assert not shares_index(biased, ("user", 0, 0)) and ("user", 0, 0) in index_keys(biased)
