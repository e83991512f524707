"""Writes the binary files of the bad-input corpus (HDF5, Parquet, and a config.json made
from the tests' graph); the text files beside them are written by hand. cases.json says
how each file is fed to pbg_ray and what the refusal must say.

    python tests/bad_inputs/make_corpus.py
"""

import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pbg_ray.checkpoints.directory import (
    CheckpointStorage, row_adagrad_state, serialize_optim_state)

HERE = Path(__file__).parent


def h5(path: Path, format_version=1, **datasets) -> None:
    with h5py.File(path, "w") as hf:
        if format_version is not None:
            hf.attrs["format_version"] = format_version
        for name, data in datasets.items():
            hf.create_dataset(name, data=data)


def edges() -> None:
    """Placed as edges_0_0.h5 of the tests' graph: bucket (0, 0), relations 0 follows
    user->user, 1 likes user->item, 2 tagged item->tag; user partition 0 has 30 entities."""
    d = HERE / "edges"
    ids = dict(lhs=np.arange(3), rhs=np.arange(3), rel=np.zeros(3, np.int64))
    (d / "not_hdf5.h5").write_text("0\tfollows\t1\n")
    h5(d / "no_format_version.h5", None, **ids)
    h5(d / "format_version_2.h5", 2, **ids)
    h5(d / "missing_rel.h5", lhs=ids["lhs"], rhs=ids["rhs"])
    h5(d / "float_lhs.h5", **dict(ids, lhs=np.arange(3.0)))
    h5(d / "lengths_differ.h5", **dict(ids, rel=np.zeros(2, np.int64)))
    h5(d / "weight_strings.h5", **ids, weight=np.array([b"1", b"2", b"x"]))
    h5(d / "lhs_out_of_range.h5", **dict(ids, lhs=np.array([0, 1, 30])))
    h5(d / "negative_rhs.h5", **dict(ids, rel=np.ones(3, np.int64), rhs=np.array([0, -1, 2])))
    h5(d / "relation_out_of_range.h5", **dict(ids, rel=np.array([0, 3, 0])))
    good = d / "cut_short.h5"
    h5(good, **dict(ids, lhs=np.arange(1000) % 30, rhs=np.arange(1000) % 30,
                    rel=np.zeros(1000, np.int64)))
    good.write_bytes(good.read_bytes()[:1500])


def checkpoints() -> None:
    """Placed into a checkpoint of the tests' graph (dimension 8) at version 1."""
    d = HERE / "checkpoints"
    embs = np.zeros((30, 8), np.float32)
    h5(d / "embeddings_1d.h5", embeddings=np.zeros(30, np.float32))
    h5(d / "embeddings_missing.h5", other=embs)
    h5(d / "embeddings_format_version_3.h5", 3, embeddings=embs)
    h5(d / "optimizer_state_garbage.h5", embeddings=np.zeros((21, 8), np.float32),
       **{"optimizer/state_dict": np.frombuffer(b"garbage", dtype="V1")})
    blob = serialize_optim_state(row_adagrad_state(np.zeros(3, np.float32), 0.1))
    h5(d / "optimizer_state_wrong_rows.h5", embeddings=np.zeros((7, 8), np.float32),
       **{"optimizer/state_dict": np.frombuffer(blob, dtype="V1")})
    storage = CheckpointStorage(d)
    storage.save_model(9, {"relations/0/operator/rhs/translation": np.zeros(8, np.float32)}, None)
    model = storage.model_file(9)
    (d / "model_cut_short.h5").write_bytes(model.read_bytes()[:1200])
    model.unlink()
    # A run's config.json with a typo ('dimensions').
    config = {"entities": {"user": {"num_partitions": 2}, "item": {"num_partitions": 2},
                           "tag": {"num_partitions": 1}},
              "relations": [{"name": "follows", "lhs": "user", "rhs": "user"}],
              "dimensions": 8, "entity_path": "data/entities", "edge_paths": ["data/edges"],
              "checkpoint_path": "model"}
    (d / "config_unknown_key.json").write_text(json.dumps(config, indent=4))


def raw() -> None:
    d = HERE / "raw"
    pq.write_table(pa.table({"src": ["a", "b"], "rel": ["follows", "likes"], "dst": ["b", "c"],
                             "w": ["1.5", "heavy"]}), d / "weight_not_a_number.parquet")
    pq.write_table(pa.table({"src": ["a"], "rel": ["follows"], "dst": ["b"]}),
                   d / "missing_column.parquet")


if __name__ == "__main__":
    edges()
    checkpoints()
    raw()
