"""The storage layer: local paths and URIs, on a real S3-compatible server (moto)."""

import json
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.errors import PbgRayError
from pbg_ray.io import storage
from pbg_ray.io.edges import EdgeAppender, read_edges, write_edges
from pbg_ray.io.files import atomic_path, write_text_atomic
from pbg_ray.io.storage import ObjectLock, ObjectPath, append_text, join, open_h5, storage_path
from pbg_ray.types import Bucket, EdgeList


def test_paths_and_uris_resolve_and_join_keeping_the_query():
    assert storage_path("data/x") == Path("data/x")
    assert storage_path("file:///abs/x") == Path("/abs/x")
    uri = storage_path("s3://bucket/dir?endpoint_override=127.0.0.1:9000&scheme=http")
    assert isinstance(uri, ObjectPath)
    child = uri / "model" / "model.v1.h5"
    assert str(child) == "s3://bucket/dir/model/model.v1.h5?endpoint_override=127.0.0.1:9000&scheme=http"
    assert child.name == "model.v1.h5"
    assert storage_path(str(child)) == child  # survives the trip through config strings
    assert join("s3://b?region=x", "e") == "s3://b/e?region=x"
    assert join("file:///abs", "e") == "file:///abs/e" and join("rel", "e") == "rel/e"


def test_an_unknown_scheme_is_refused_naming_it():
    with pytest.raises(PbgRayError, match="nosuch://bucket.* is not a location pyarrow.fs can open"):
        storage_path("nosuch://bucket/x").exists()


def test_files_on_s3(s3_root):
    root = storage_path(s3_root)
    path = root / "dir" / "a.txt"
    assert not path.exists()
    write_text_atomic(path, "one\n")
    assert path.is_file() and (root / "dir").is_dir() and path.read_text() == "one\n"
    append_text(path, "two\n")
    append_text(root / "dir" / "b.txt", "new\n")
    assert path.read_text() == "one\ntwo\n"
    assert [p.name for p in (root / "dir").iterdir()] == ["a.txt", "b.txt"]
    assert [p.name for p in (root / "dir").glob("b*")] == ["b.txt"]
    storage.link_or_copy(path, root / "copy" / "a.txt")
    assert (root / "copy" / "a.txt").read_text() == "one\ntwo\n"
    path.unlink()
    path.unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError):
        path.read_text()
    with pytest.raises(FileNotFoundError):
        path.unlink()


def test_a_failed_write_uploads_nothing(s3_root):
    path = storage_path(s3_root) / "x.txt"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash while writing")
    assert path.read_text() == "old"
    assert not tmp.exists()


def test_a_missing_bucket_is_one_clear_error(s3_root):
    missing = storage_path(s3_root.replace("s3://test-", "s3://absent-")) / "x.txt"
    with pytest.raises(PbgRayError, match="can't write 's3://absent-.*Check that the bucket exists"):
        write_text_atomic(missing, "x")


def test_hdf5_is_read_in_place_with_the_uri_as_file_name(s3_root):
    path = storage_path(s3_root) / "f.h5"
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as hf:
        hf.create_dataset("x", data=np.arange(10**5))
    with open_h5(path) as hf:
        assert hf.filename == str(path)
        np.testing.assert_array_equal(hf["x"][5:8], [5, 6, 7])


def test_edges_on_s3(s3_root):
    edge_path = join(s3_root, "edges")
    edges = EdgeList(np.arange(10), np.arange(10)[::-1].copy(), np.zeros(10, np.int64),
                     np.linspace(0, 1, 10).astype(np.float32))
    write_edges(edge_path, Bucket(0, 1), edges)
    with EdgeAppender(edge_path, Bucket(1, 0)) as out:
        out.append(edges[:4])
        out.append(edges[4:])
    for bucket in (Bucket(0, 1), Bucket(1, 0)):
        chunk = read_edges(edge_path, bucket, chunk_idx=1, num_chunks=2)
        np.testing.assert_array_equal(chunk.rhs, edges.rhs[5:])
        np.testing.assert_array_equal(chunk.weight, edges.weight[5:])


def test_checkpoint_versions_and_snapshots_on_s3(s3_root, make_config):
    config = make_config(checkpoint_path=join(s3_root, "model"), checkpoint_preservation_interval=1)
    checkpoint = CheckpointStorage(config.checkpoint_path)
    embs = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    for version in (1, 2):
        for entity, econf in config.entities.items():
            for part in range(econf.num_partitions):
                checkpoint.save_entity_partition(version, entity, part, embs * version, None)
        checkpoint.save_model(version, {}, None)
        checkpoint.save_version(version)
        checkpoint.preserve_version(version, checkpoint.snapshot_path(version), config)
        if version > 1:
            checkpoint.drop_version(version - 1, config)
    assert checkpoint.load_version() == 2
    assert not checkpoint.model_file(1).exists()
    older, version = CheckpointManager(config.checkpoint_path).locate(config, 1, "eval.version")
    assert version == 1 and str(older.path) == str(checkpoint.path / "epoch_1")
    np.testing.assert_array_equal(older.read_partition(1, "user", 1)[0], embs)
    np.testing.assert_array_equal(checkpoint.load_entity_partition(2, "user", 1)[0], embs * 2)
    rows = np.array([4, 1, 2])  # read by range requests, without the rest of the file
    np.testing.assert_array_equal(older.read_partition_rows(1, "user", 1, rows), embs[rows])


def test_object_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(s3_root):
    path = storage_path(s3_root) / ".pbg_ray.lock"
    first, second = ObjectLock(path), ObjectLock(path)
    assert first.acquire() is None
    holder = second.acquire()
    assert holder.startswith(first.holder) and "heartbeat 0 s ago" in holder
    first.release()
    assert not path.exists()
    # A crashed run's lock: its heartbeat stopped LOCK_TTL_S ago.
    path.write_text(json.dumps({"holder": "pid 1 on gone", "token": "dead",
                                "heartbeat": time.time() - storage.LOCK_TTL_S - 1}))
    assert second.acquire() is None
    assert json.loads(path.read_text())["token"] == second.token
    second.release()
    assert not path.exists()
