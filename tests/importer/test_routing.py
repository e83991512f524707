"""The routing phase: spill records -> the right bucket, in input order, previous edges first."""

import numpy as np
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import routing
from pbg_ray.importer.dictionaries import Dictionaries, Dictionary
from pbg_ray.importer.read import EntityTypes, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.io.edges import read_edges, write_edges
from pbg_ray.types import Bucket, EdgeList
from tests.importer.util import make

# node: 2 partitions, id 3 dropped as too rare; tag: unpartitioned.
NODE = Dictionary(np.array([0, 1, 1, -1]), np.array([0, 0, 1, -1]), [["a"], ["b", "c"]])
TAG = Dictionary(np.array([0, 0]), np.array([0, 1]), [["t0", "t1"]])
# (lhs id, rhs id, relation id): relation 0 is follows (node, node), 1 tagged (node, tag).
RECORDS = [(0, 1, 0), (1, 2, 0), (3, 0, 0), (2, 0, 0), (0, 2, 0), (1, 1, 1), (2, 0, 1),
           (1, 0, 1), (0, 0, 0)]


def router_for(tmp_path, weighted=False):
    config = make(tmp_path, [], entities={"node": {"num_partitions": 2}, "tag": {}},
                  relations=[{"name": "follows", "lhs": "node", "rhs": "node"},
                             {"name": "tagged", "lhs": "node", "rhs": "tag"}])
    dictionaries = Dictionaries({"node": NODE, "tag": TAG}, np.arange(2), ["follows", "tagged"])
    return BucketRouter(config, EntityTypes.of(config), spill_dtype(weighted), dictionaries)


def spill(path, router, weights=None):
    records = np.empty(len(RECORDS), router.spill_dtype)
    for i, name in enumerate(("lhs", "rhs", "rel")):
        records[name] = [r[i] for r in RECORDS]
    if weights is not None:
        records["weight"] = weights
    records.tofile(path)
    return path


def expected_buckets(router):
    """Each bucket's (lhs offset, rhs offset, rel), edge by edge in input order; the
    unpartitioned tag side goes to the partition the router spreads that edge to."""
    buckets = {Bucket(lhs, rhs): [] for lhs in range(2) for rhs in range(2)}
    dictionary = (NODE, TAG)
    for lhs, rhs, rel in RECORDS:
        if NODE.part[lhs] < 0 or dictionary[rel].part[rhs] < 0:
            continue
        edge = (NODE.offset[lhs], dictionary[rel].offset[rhs], rel)
        index, = router.buckets(np.array([rel]), NODE.part[[lhs]], np.array([edge[0]]),
                                dictionary[rel].part[[rhs]], np.array([edge[1]]))
        assert rel or index == 2 * NODE.part[lhs] + NODE.part[rhs]
        buckets[router.bucket(index)].append(edge)
    return buckets


def test_unpartitioned_sides_spread_by_the_edge_alone(tmp_path):
    router = router_for(tmp_path)
    n = 1000
    rel, lhs = np.ones(n, np.int64), np.arange(n) % 7
    rhs, parts = np.arange(n) // 7, np.zeros(n, np.int64)
    buckets = router.buckets(rel, parts, lhs, parts, rhs)
    assert set(buckets.tolist()) == {0, 1}  # lhs partition 0, the tag side spread over both
    assert abs(int((buckets == 1).sum()) - n // 2) < n // 10
    # The same edge in another batch, at another position: the same bucket.
    again = router.buckets(rel[::-1], parts, lhs[::-1], parts, rhs[::-1])
    assert again.tolist() == buckets[::-1].tolist()
    dropped = router.buckets(rel, parts - 1, lhs, parts, rhs)
    assert (dropped == -1).all()


def written(directory):
    out = {}
    for lhs in range(2):
        for rhs in range(2):
            edges = read_edges(directory, Bucket(lhs, rhs))
            out[Bucket(lhs, rhs)] = list(zip(edges.lhs.tolist(), edges.rhs.tolist(),
                                             edges.rel.tolist()))
    return out


@pytest.mark.parametrize("chunk, open_buckets", [(1 << 20, 256), (2, 1), (3, 3)])
def test_edges_land_in_their_bucket_in_input_order(tmp_path, monkeypatch, chunk, open_buckets):
    # Small chunks and few open files give the same buckets as one pass.
    monkeypatch.setattr(routing, "SPILL_CHUNK", chunk)
    monkeypatch.setattr(routing, "MAX_OPEN_BUCKETS", open_buckets)
    router = router_for(tmp_path)
    stats = router.write_buckets(spill(tmp_path / "spill.bin", router), tmp_path, None)
    expected = expected_buckets(router)
    assert written(tmp_path) == expected
    assert stats == {"edges": sum(map(len, expected.values())), "dropped_rare": 1}
    assert len(expected[Bucket(1, 0)]) > 1 and len(expected[Bucket(0, 1)]) > 1


def test_a_previous_import_s_edges_come_first(tmp_path):
    previous = tmp_path / "previous"
    old = {}
    for lhs in range(2):
        for rhs in range(2):
            old[Bucket(lhs, rhs)] = [(9, lhs, 0), (8, rhs, 1)] if lhs == rhs else []
            edges = np.array(old[Bucket(lhs, rhs)], np.int64).reshape(-1, 3)
            write_edges(previous, Bucket(lhs, rhs), EdgeList(*edges.T))
    router = router_for(tmp_path, weighted=True)
    weights = np.arange(len(RECORDS), dtype=np.float32)
    out = tmp_path / "out"
    out.mkdir()
    stats = router.write_buckets(spill(tmp_path / "spill.bin", router, weights), out,
                                 str(previous))
    assert stats["previous_edges"] == 4
    expected = expected_buckets(router)
    assert written(out) == {b: old[b] + expected[b] for b in expected}
    # The previous edges had no weights: they weigh 1.
    assert read_edges(out, Bucket(0, 0)).weight[:2].tolist() == [1.0, 1.0]

    write_edges(previous, Bucket(1, 1), EdgeList(*np.array([[1, 1, 0]]).T, weight=np.ones(1)))
    router = router_for(tmp_path)
    with pytest.raises(PbgRayError, match="holds edge weights; set importer.weight_col"):
        router.write_buckets(spill(tmp_path / "spill.bin", router), out, str(previous))
