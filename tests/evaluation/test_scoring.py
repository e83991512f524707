"""pbg_ray.evaluation.scoring factors the Embedder's scores by side: its positive scores are the
Embedder's, for every operator family, comparator and mode."""

import numpy as np
import pytest
import torch

from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.model.kernel import EdgeTensors, KernelState, build_batch
from pbg_ray.model.params import init_params
from pbg_ray.types import Bucket, EdgeList


def case(operator, comparator, dynamic=False, **overrides):
    data = dict(entities={"a": {}, "b": {}},
                relations=[{"name": "r0", "lhs": "a", "rhs": "b", "operator": operator}],
                dimension=8, comparator=comparator, global_emb=not dynamic,
                dynamic_relations=dynamic, batch_size=30, num_batch_negs=5, num_uniform_negs=4,
                entity_path="/unused", edge_paths=["/unused"], checkpoint_path="/unused")
    data.update(overrides)
    config = ConfigSchema.from_dict(data)
    rng = np.random.default_rng(0)
    num_rel = 3 if dynamic else 1
    params = init_params(config, num_rel)
    for value in params.arrays.values():
        value += rng.normal(0, 0.3, value.shape).astype(np.float32)
    parts = {(e, 0): (rng.normal(0, 0.5, (13, 8)).astype(np.float32), np.zeros(13, np.float32))
             for e in ("a", "b")}
    edges = EdgeList(rng.integers(0, 13, 20), rng.integers(0, 13, 20),
                     rng.integers(0, num_rel, 20))
    return config, parts, params, edges


@pytest.mark.parametrize("operator,comparator,dynamic,extra", [
    ("translation", "dot", False, {}),
    ("diagonal", "cos", False, {"max_norm": 1.0}),
    ("linear", "l2", False, {"bias": True}),
    ("complex_diagonal", "squared_l2", False, {}),
    ("affine", "cos", True, {}),
    ("complex_diagonal", "dot", True, {"max_norm": 0.8}),
    # The operator moved onto the rhs queries (the candidates relation-free):
    ("complex_diagonal", "dot", False, {}),
    ("linear", "dot", False, {"max_norm": 1.0}),
    ("diagonal", "dot", False, {}),
    ("translation", "l2", False, {}),
])
def test_side_scores_are_the_embedders(operator, comparator, dynamic, extra):
    config, parts, params, edges = case(operator, comparator, dynamic, **extra)
    state = KernelState(config, parts, params, writable=False)
    sizes = {k: len(t) for k, t in state.tables.items()}
    batch = build_batch(config, Bucket(0, 0), EdgeTensors(edges),
                        np.arange(len(edges)), 5, 4, sizes, torch.Generator().manual_seed(0))
    expected = state.embedder.forward(batch).pos
    scorer = Scorer(config, params.arrays)
    vectors = {side: scorer.entity_vectors(e, state.tables[(e, 0)][torch.from_numpy(getattr(edges, side))])
               for side, e in (("lhs", "a"), ("rhs", "b"))}
    rel_ids = torch.from_numpy(edges.rel)
    moved = not dynamic and (comparator, operator) in {
        ("dot", "complex_diagonal"), ("dot", "linear"), ("dot", "diagonal"), ("l2", "translation")}
    assert scorer.relation_specific("rhs", 0) is (not dynamic and not moved)
    for side, other in (("lhs", "rhs"), ("rhs", "lhs")):
        got = scorer.pos(scorer.queries(side, 0, rel_ids, vectors[other]),
                         scorer.candidates(side, 0, vectors[side]))
        want = expected[side].reshape(-1)[:len(edges)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
