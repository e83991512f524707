"""A version's candidate sets and their faiss indexes: sets per relation operator, the
comparator's metric, the kind by size, indexes saved beside their version and rebuilt for a
new one, the adjoint query."""

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.serving import index
from pbg_ray.serving.index import (
    build_index, drop_old_indexes, index_file, index_keys, index_kind, set_keys,
    shares_index)
from pbg_ray.serving.names import ServingModel
from tests.serving.util import build_all, served_config
from tests.util import config_dict, random_checkpoint, write_random_graph


def test_candidate_sets_follow_the_operators(tmp_path):
    config = served_config(tmp_path)
    # follows (translation) and likes (diagonal) transform their rhs candidates; tagged (none)
    # shares the tag type's set; shard group 1 holds the partitions 1.
    assert set_keys(config, 1) == [("user", 1, None), ("user", 1, 0), ("item", 1, None),
                                   ("item", 1, 1)]
    assert ("tag", 0, None) in set_keys(config, 0) and ("tag", 0, 2) not in set_keys(config)
    dynamic = dataclasses.replace(config, dynamic_relations=True, global_emb=False,
                                  relations=config.relations[1:2])
    assert all(relation is None for _, _, relation in set_keys(dynamic))


@pytest.mark.parametrize("comparator,metric", [("dot", 0), ("cos", 0), ("l2", 1),
                                               ("squared_l2", 1)])
def test_the_index_searches_with_the_comparators_metric(tmp_path, comparator, metric):
    """faiss's METRIC_INNER_PRODUCT is 0, METRIC_L2 1; an IVF index probing every list
    finds exact search's top 10 under that metric."""
    import faiss

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(2000, 16)).astype(np.float32)
    config = ConfigSchema.from_dict(config_dict(tmp_path, comparator=comparator,
                                                serve={"ivf_lists": 8}))
    index = build_index(vectors, "ivf", config)
    assert index.metric_type == metric
    index.nprobe = 8
    query = rng.normal(size=(5, 16)).astype(np.float32)
    _, hits = index.search(query, 10)
    exact = query @ vectors.T if metric == 0 else -((query[:, None] - vectors[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(np.sort(hits, 1), np.sort(np.argsort(-exact, 1)[:, :10], 1))
    assert isinstance(build_index(vectors, "hnsw", config), faiss.IndexHNSWFlat)


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


def test_only_sets_with_an_index_start_a_build_task(ray_session, tmp_path, monkeypatch):
    """A set searched exactly needs no index: no task (a worker's start) for it, its
    figures from the entity counts."""
    config = served_config(tmp_path, index="auto", index_min_rows=1)
    counts = load_entity_counts(config)
    smallest = min(counts[e][p] for e, p, _ in index_keys(config))
    mixed = dataclasses.replace(config, serve=dataclasses.replace(
        config.serve, index_min_rows=smallest + 1))
    launched = []
    real = index.build_index_task

    class NotedTask:
        """build_index_task, the sets it is launched for noted."""

        def options(self, **options):
            task = real.options(**options)

            class Launch:
                def remote(self, *args):
                    launched.append(tuple(args[2]))
                    return task.remote(*args)
            return Launch()

    monkeypatch.setattr(index, "build_index_task", NotedTask())
    figures = asyncio.run(index.build_indexes(mixed, 1))
    exact = {k for k in index_keys(mixed) if counts[k[0]][k[1]] <= smallest}
    assert exact and len(exact) < len(index_keys(mixed))
    assert len(launched) == len(set(launched))
    assert set(launched) == set(index_keys(mixed)) - exact
    assert figures["kinds"] == ["exact", "hnsw"]
    assert len(figures["built"]) == len(launched)


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
        op, params = scorer._operator("rhs", relation, None)
        true = scorer.matrix(queries, scorer.comparator.prepare(
            op.forward(scorer.entity_vectors("user", rows), params))[0])
        adjoint = scorer.matrix(scorer.adjoint_queries(relation, queries), base)
        difference = (true - adjoint).numpy()
        np.testing.assert_allclose(difference, difference[:, :1].repeat(40, 1), atol=1e-4,
                                   err_msg=operators[relation])


def test_cos_and_biased_models_index_each_relations_set(tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, comparator="cos"))
    assert not shares_index(config, ("user", 0, 0))
    biased = ConfigSchema.from_dict(config_dict(tmp_path, comparator="dot", bias=True))
    assert not shares_index(biased, ("user", 0, 0)) and ("user", 0, 0) in index_keys(biased)
