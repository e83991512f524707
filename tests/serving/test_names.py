"""Requests by names: the router's answers equal the Predictor's; a batch answers each query or
its error."""

import asyncio

import numpy as np
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.evaluation.questions import NeighborQuery
from pbg_ray.serving.names import ServingModel
from tests.serving.util import build_all, local_shards, served_config


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
    near = asyncio.run(model.neighbors(rows, search, [NeighborQuery("tag-0-3")], 3))[0]
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
        NeighborQuery("tag-0-3"), NeighborQuery(vector=[1.0, 2.0], entity_type="item"),
        NeighborQuery("tag-0-3", entity_type="tga")], 3))
    assert near[0] == asyncio.run(model.neighbors(rows, search, [NeighborQuery("tag-0-3")], 3))[0]
    assert [str(e) for e in near[1:]] == [
        f"vector has 2 values; item embeddings have {config.dimension}, all finite.",
        "unknown entity type 'tga' (did you mean 'tag'?)."]
    with pytest.raises(PbgRayError, match="'edgez' is not an edge path"):  # the whole request
        asyncio.run(model.top(rows, search, "rhs", [("user-1-3", "likes")], 4, ["edgez"]))
