"""Edge bucket files (PBG's edges_{lhs}_{rhs}.h5): round trips, chunk bounds as PBG
counts them, streamed and failed writes, and damaged files refused with their name."""

import h5py
import numpy as np
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.io.edges import (
    EdgeAppender, check_edges, chunk_bounds, count_edges, edges_file, read_edges, write_edges)
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.types import Bucket, EdgeList, FeatureList
from tests.util import write_random_graph


def random_edges(n, rng, weight=False, features=False):
    lhs, rhs, rel = (rng.integers(100, size=n) for _ in range(3))
    fl = None
    if features:
        lengths = rng.integers(0, 4, size=n)
        fl = FeatureList(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                         rng.integers(50, size=int(lengths.sum())))
    return EdgeList(lhs, rhs, rel, rng.random(n).astype(np.float32) if weight else None, fl, None)


def assert_edges_equal(a: EdgeList, b: EdgeList):
    for name in ("lhs", "rhs", "rel", "weight"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y)
    for name in ("lhs_features", "rhs_features"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x.offsets, y.offsets)
            np.testing.assert_array_equal(x.data, y.data)


@pytest.mark.parametrize("weight, features", [(False, False), (True, False), (False, True)])
def test_write_then_read_chunks(tmp_path, weight, features):
    edges = random_edges(1003, np.random.default_rng(0), weight, features)
    write_edges(tmp_path, Bucket(1, 2), edges)
    assert edges_file(tmp_path, Bucket(1, 2)).name == "edges_1_2.h5"
    assert count_edges(tmp_path, Bucket(1, 2)) == 1003
    assert_edges_equal(read_edges(tmp_path, Bucket(1, 2)), edges)
    chunks = [read_edges(tmp_path, Bucket(1, 2), i, 7) for i in range(7)]
    for i, chunk in enumerate(chunks):
        begin, end = chunk_bounds(1003, i, 7)
        assert_edges_equal(chunk, edges[begin:end])
    assert_edges_equal(EdgeList.cat(chunks), edges)


def test_chunk_bounds_match_pbg():
    for n, k in [(10, 3), (1003, 7), (0, 4), (5, 8)]:
        bounds = [chunk_bounds(n, i, k) for i in range(k)]
        assert bounds == [(int(i * n / k), int((i + 1) * n / k)) for i in range(k)]


def test_streamed_file_equals_whole_write(tmp_path):
    rng = np.random.default_rng(1)
    parts = [random_edges(n, rng, weight=(i == 1), features=(i == 2)) for i, n in enumerate([300, 0, 500, 77])]
    with EdgeAppender(tmp_path, Bucket(0, 0)) as out:
        assert not edges_file(tmp_path, Bucket(0, 0)).exists()  # appears only when complete
        for part in parts:
            out.append(part)
    assert_edges_equal(read_edges(tmp_path, Bucket(0, 0)), EdgeList.cat(parts))


def test_failed_append_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with EdgeAppender(tmp_path, Bucket(0, 1)) as out:
            out.append(random_edges(10, np.random.default_rng(0)))
            raise RuntimeError("importer crashed")
    assert list(tmp_path.iterdir()) == []


def test_files_are_compact(tmp_path):
    edges = random_edges(10, np.random.default_rng(0))
    write_edges(tmp_path, Bucket(0, 0), edges)
    with EdgeAppender(tmp_path, Bucket(0, 1)) as out:
        out.append(edges)
    # PBG 1.0.0 pads each dataset to a 50 MiB chunk (150 MB per file).
    assert edges_file(tmp_path, Bucket(0, 0)).stat().st_size < 10_000
    assert edges_file(tmp_path, Bucket(0, 1)).stat().st_size < 4 * 1024 * 1024


def write_raw(path, **datasets):
    with h5py.File(path, "w") as hf:
        for name, data in datasets.items():
            if name == "attrs":
                hf.attrs.update(data)
            else:
                hf.create_dataset(name, data=data)


GOOD = dict(lhs=np.arange(3), rhs=np.arange(3), rel=np.zeros(3, np.int64))


@pytest.mark.parametrize("datasets, message", [
    (dict(GOOD), "no format_version attribute"),
    (dict(GOOD, attrs={"format_version": 2}), "format_version=2"),
    (dict(GOOD, attrs={"format_version": 1}, rel=np.zeros(2, np.int64)), "different lengths"),
    (dict(lhs=np.arange(3), rhs=np.arange(3), attrs={"format_version": 1}), "lacks the dataset 'rel'"),
    (dict(GOOD, attrs={"format_version": 1}, lhs=np.arange(3.0)), "'lhs' must be 1-D integer"),
    (dict(GOOD, attrs={"format_version": 1}, rhs=np.zeros((3, 2), np.int64)), "'rhs' must be 1-D integer"),
])
def test_bad_edge_files_are_refused(tmp_path, datasets, message):
    write_raw(edges_file(tmp_path, Bucket(0, 0)), **datasets)
    with pytest.raises(PbgRayError, match=message) as info:
        read_edges(tmp_path, Bucket(0, 0))
    assert "edges_0_0.h5" in str(info.value)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(PbgRayError, match="edges_3_1.h5' is missing"):
        count_edges(tmp_path, Bucket(3, 1))
    edges_file(tmp_path, Bucket(0, 0)).write_bytes(b"not hdf5 at all")
    with pytest.raises(PbgRayError, match="not a readable HDF5 file"):
        read_edges(tmp_path, Bucket(0, 0))


def test_check_edges_against_counts(make_config):
    config = make_config()
    written = write_random_graph(config)
    counts = load_entity_counts(config)
    for bucket, edges in written.items():
        check_edges(edges, bucket, config, counts, 3, "x")  # in range: no error
    bucket = Bucket(1, 0)
    edges = written[bucket]
    bad = EdgeList(edges.lhs.copy(), edges.rhs.copy(), edges.rel.copy())
    i = int(np.flatnonzero(bad.rel == 1)[0])  # a 'likes' edge: user -> item
    bad.rhs[i] = counts["item"][0]  # one past the end of item partition 0
    with pytest.raises(PbgRayError, match=r"rhs index 20 is outside partition 0 of entity type 'item', which has 20"):
        check_edges(bad, bucket, config, counts, 3, "edges_1_0.h5")
    bad.rhs[i] = 0
    bad.rel[i] = 3
    with pytest.raises(PbgRayError, match="relation id 3 is outside the config's 3 relation types"):
        check_edges(bad, bucket, config, counts, 3, "edges_1_0.h5")


def test_index_with_positions_keeps_features_aligned():
    edges = random_edges(50, np.random.default_rng(3), weight=True, features=True)
    idx = np.array([7, 3, 3, 49, 0])
    taken = edges[idx]
    np.testing.assert_array_equal(taken.lhs, edges.lhs[idx])
    for i, j in enumerate(idx):
        f, g = taken.lhs_features, edges.lhs_features
        np.testing.assert_array_equal(f.data[f.offsets[i]:f.offsets[i + 1]],
                                      g.data[g.offsets[j]:g.offsets[j + 1]])
