"""python -m pbg_ray.export: the same TSV as torchbiggraph_export_to_tsv, and Parquet."""

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.checkpoints.exporter import export_checkpoint
from pbg_ray.errors import PbgRayError
from pbg_ray.io.entities import load_entity_names, save_dynamic_rel_count, save_relation_names
from tests.util import assert_streams_partitions, peak_growth, random_checkpoint, write_random_graph

# Operators whose parameters are vectors: torchbiggraph's export can't format matrices.
VECTOR_OPERATORS = ["translation", "diagonal", "complex_diagonal"]


def exported_tsv(config):
    config.export.format = "tsv"
    result = export_checkpoint(config)
    return [open(f).read() for f in result["files"]]


@pytest.mark.oracle
def test_tsv_matches_torchbiggraph(make_config):
    config = make_config(relations=[
        {"name": f"rel{i}", "lhs": "user", "rhs": lhs_rhs, "operator": op}
        for i, (op, lhs_rhs) in enumerate(zip(VECTOR_OPERATORS, ["user", "item", "tag"]))])
    write_random_graph(config)
    random_checkpoint(config)
    from tests.oracle import torchbiggraph_tsv

    assert exported_tsv(config) == torchbiggraph_tsv(config)


@pytest.mark.oracle
def test_dynamic_relations_tsv_matches_torchbiggraph(make_config):
    config = make_config(relations=[{"name": "any", "lhs": "user", "rhs": "item",
                                     "operator": "complex_diagonal"}],
                         dynamic_relations=True, global_emb=False)
    write_random_graph(config)
    save_relation_names(config.entity_path, ["r-a", "r-b", "r-c"])
    save_dynamic_rel_count(config.entity_path, 3)
    random_checkpoint(config)
    from tests.oracle import torchbiggraph_tsv

    ours = exported_tsv(config)
    assert ours == torchbiggraph_tsv(config)
    assert ours[1].count("\n") == 2 * 2 * 3  # sides x (real, imag) x relations


def test_the_model_exported_is_the_one_the_checkpoint_was_trained_with(make_config, caplog):
    """A config of the graph exports a checkpoint of another model of it (a Ray Tune trial's
    sampled dimension, another operator) as the config it was trained with does."""
    config = make_config()
    write_random_graph(config)
    trained = dataclasses.replace(config, dimension=12, relations=[
        dataclasses.replace(config.relations[0], operator="diagonal"), *config.relations[1:]])
    random_checkpoint(trained)
    with caplog.at_level("WARNING", logger="pbg_ray"):
        exported = exported_tsv(config)
    assert "trained with dimension=12 (this config: 8), relations.0.operator=diagonal" in caplog.text
    assert exported == exported_tsv(trained)


def test_parquet_and_older_versions(make_config, tmp_path):
    config = make_config(relations=[{"name": "likes", "lhs": "user", "rhs": "item",
                                     "operator": "affine"}])
    write_random_graph(config)
    random_checkpoint(config, version=1, seed=1)
    storage = CheckpointStorage(config.checkpoint_path)
    storage.preserve_version(1, storage.snapshot_path(0), config)
    storage.drop_version(1, config)
    random_checkpoint(config, version=2, seed=2)

    config.export.format = "parquet"
    config.export.output = str(tmp_path / "out")
    config.export.version = 1
    stale = tmp_path / "out" / "entities" / "user_7.parquet"  # an earlier export's partition
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    result = export_checkpoint(config)
    assert not stale.exists()
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["files"] == result["files"]
    assert sorted(p.name for p in (tmp_path / "out" / "entities").iterdir()) == [
        f"{e}_{p}.parquet" for e, p in [("item", 0), ("item", 1), ("tag", 0), ("user", 0), ("user", 1)]]
    assert result["version"] == 1 and result["checkpoint_path"].endswith("epoch_0")
    table = pq.read_table(tmp_path / "out" / "entities")  # a dataset: a file per partition
    assert table.schema.field("embedding").type.list_size == config.dimension
    params, _ = CheckpointStorage(result["checkpoint_path"]).load_model(1)
    embs, _ = CheckpointStorage(result["checkpoint_path"]).load_entity_partition(1, "item", 1)
    rows = table.to_pylist()
    item1 = [r for r in rows if r["type"] == "item" and r["partition"] == 1]
    assert [r["name"] for r in item1] == load_entity_names(config.entity_path, "item", 1)
    np.testing.assert_allclose(item1[3]["embedding"], embs[3] + params["entities/item/global_embedding"],
                               rtol=1e-6)
    relations = pq.read_table(tmp_path / "out" / "relation_types.parquet").to_pylist()
    assert [(r["param"], r["shape"]) for r in relations] == [
        ("linear_transformation", "8x8"), ("translation", "8")]
    np.testing.assert_array_equal(np.reshape(relations[0]["values"], (8, 8)),
                                  params["relations/0/operator/rhs/linear_transformation"])

    config.export.version = 5
    with pytest.raises(PbgRayError, match=r"version 5 is not in .*versions there: \[1, 2\]"):
        export_checkpoint(config)


def export_in_process(checkpoint_path, fmt, output):
    """Run by peak_memory: the library's export of a checkpoint, in this process."""
    config = CheckpointStorage(checkpoint_path).load_config()
    config.export.format, config.export.output = fmt, output
    export_checkpoint(config)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tsv", "parquet", "bundle"])
def test_export_memory_follows_the_partition_not_the_table(tmp_path, fmt):
    peaks, extra = peak_growth(tmp_path, "tests.checkpoints.test_exporter:export_in_process",
                               lambda config, name: [config.checkpoint_path, fmt,
                                                     str(tmp_path / "out" / name)])
    assert_streams_partitions(peaks, extra)
