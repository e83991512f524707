"""Storage paths as URIs end to end: import, train, resume, eval, export and predict with
entity_path, edge_paths, checkpoint_path and init_path on a real S3-compatible server
(moto, started by conftest's s3_endpoint) and as file:// URIs."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pyarrow.fs as pafs
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.checkpoints.exporter import export_checkpoint
from pbg_ray.cli import check_overrides
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import evaluate_checkpoint
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.importer.graph_import import import_graph
from pbg_ray.io.entities import load_entity_names
from pbg_ray.io.storage import ObjectPath, join, storage_path
from pbg_ray.plot import main as plot_main
from pbg_ray.training.bucket_sources import InitSource, ModelSource
from pbg_ray.training.trainer import Trainer
from tests.util import assert_valid_checkpoint, config_dict

NAMES = [f"n{i}" for i in range(40)]


def write_raw_edges(path, num_edges, seed):
    rng = np.random.default_rng(seed)
    rows = [f"{NAMES[rng.integers(40)]}\t{'ab'[rng.integers(2)]}\t{NAMES[rng.integers(40)]}"
            for _ in range(num_edges)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def uri_config(root, tmp_path, **overrides):
    """A two-partition graph whose every storage path lies under `root` (a URI)."""
    data = config_dict(
        tmp_path, entities={"node": {"num_partitions": 2}},
        relations=[{"name": r, "lhs": "node", "rhs": "node", "operator": "translation"} for r in "ab"],
        entity_path=join(root, "entities"), edge_paths=[join(root, "edges/train")],
        eval_edge_paths=[join(root, "edges/test")], checkpoint_path=join(root, "model"),
        num_epochs=1, eval_fraction=0.1, comparator="dot", loss_fn="softmax", lr=0.1,
        importer={"inputs": [write_raw_edges(tmp_path / "train.tsv", 600, 0),
                             write_raw_edges(tmp_path / "test.tsv", 100, 1)],
                  "lhs_col": 0, "rel_col": 1, "rhs_col": 2})
    data.update(overrides)
    return ConfigSchema.from_dict(data).with_absolute_paths()


@pytest.fixture(params=[pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow]), "file"])
def root(request, tmp_path):
    if request.param == "s3":
        return request.getfixturevalue("s3_root")
    return "file://" + str(tmp_path / "store")


@pytest.mark.oracle
def test_import_train_resume_eval_export_predict(ray_session, root, tmp_path):
    from tests.oracle import assert_torchbiggraph_loads

    config = uri_config(root, tmp_path)
    assert config.checkpoint_path.startswith(root.split("?")[0])  # URIs are kept as given
    stats = import_graph(config)
    assert stats["inputs"][0]["edges"] == 600
    names = load_entity_names(config.entity_path, "node", 0) + load_entity_names(config.entity_path, "node", 1)
    assert sorted(names) == sorted(set(names)) and len(names) > 30
    assert import_graph(config) == stats  # the manifest on the store says it is done

    # Train tasks read the edges and partition stores write the checkpoint on the store.
    storage = CheckpointStorage(config.checkpoint_path)
    first = Trainer(config).run()
    assert first.version == 1 and first.checkpoint_path == str(storage.path)
    assert storage.load_version() == 1
    before = storage.load_entity_partition(1, "node", 1)[0]
    resumed = Trainer(dataclasses.replace(config, num_epochs=2)).run()
    assert resumed.version == 2 and len(resumed.bucket_stats) == 4  # one more pass of 4 buckets
    assert not np.array_equal(before, storage.load_entity_partition(2, "node", 1)[0])
    assert not storage.model_file(1).exists(), "version 1 not dropped"
    assert [s["epoch_idx"] for s in storage.load_stats()] == [0] * 4 + [1] * 4
    if isinstance(storage.path, ObjectPath):  # the run's lock object is gone with the run
        assert not (storage.path / ".pbg_ray.lock").exists()
    plot_main([config.checkpoint_path])
    assert (storage.path / "training_stats.png").read_bytes()[:4] == b"\x89PNG"

    report = evaluate_checkpoint(config)
    assert report["version"] == 2 and report["metrics"]["all"]["count"] > 0
    assert 0 < report["metrics"]["all"]["filtered"]["mrr"] <= 1
    logged = (storage.path / "eval_stats.json").read_text().splitlines()
    assert [json.loads(line)["version"] for line in logged] == [2]

    exported = export_checkpoint(config)
    entities_tsv = storage_path(exported["files"][0])
    assert str(entities_tsv) == str(storage.path / "export" / "entities.tsv")
    lines = entities_tsv.read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in lines) == sorted(names)
    assert all(len(line.split("\t")) == 1 + config.dimension for line in lines)

    # Everything is where the URIs say, as the store itself lists it.
    fs, base = pafs.FileSystem.from_uri(root)
    stored = {info.path[len(base):].lstrip("/")
              for info in fs.get_file_info(pafs.FileSelector(base, recursive=True))}
    assert {"entities/entity_count_node_1.txt", "entities/entity_names_node_0.json",
            "edges/train/edges_1_0.h5", "edges/test/edges_0_1.h5", "model/checkpoint_version.txt",
            "model/model.v2.h5", "model/embeddings_node_0.v2.h5", "model/training_stats.json",
            "model/eval_stats.json", "model/export/relation_types.tsv"} <= stored

    # The checkpoint is PBG's: torchbiggraph 1.0.0 reads a local copy of it.
    local = tmp_path / "copy"
    source, source_path = pafs.FileSystem.from_uri(config.checkpoint_path)
    pafs.copy_files(source_path, str(local), source_filesystem=source,
                    destination_filesystem=pafs.LocalFileSystem())
    assert_valid_checkpoint(dataclasses.replace(config, checkpoint_path=str(local)), 2)
    assert_torchbiggraph_loads(dataclasses.replace(config, checkpoint_path=str(local)), 2)

    model = Predictor.load(config.checkpoint_path)
    top = model.top_rhs(names[0], "a", k=3, exclude=config.edge_paths)
    assert len(top) == 3 and all(name in names for name, _ in top)

    # init_path on the store: a new run's partition stores would load it (as the resume
    # above loaded checkpoint_path, through the same reader).
    fresh = Trainer(dataclasses.replace(config, checkpoint_path=join(root, "model2"),
                                        init_path=config.checkpoint_path))
    sources, model_source = fresh._sources()
    assert {(type(s), s.path, s.version) for s in sources.values()} == {
        (InitSource, str(storage.path), 2)}
    assert model_source == ModelSource(str(storage.path), 2, grow=True)


@pytest.mark.s3
def test_a_second_run_on_an_object_storage_checkpoint_is_refused(s3_root):
    storage = CheckpointStorage(join(s3_root, "model"))
    with storage.lock():
        with pytest.raises(PbgRayError, match=r"in use by another training run \(pid \d+ on .*heartbeat"):
            with storage.lock():
                pass
    with storage.lock():  # released: free again
        pass


def test_an_unquoted_uri_on_the_command_line_gets_the_fix():
    with pytest.raises(PbgRayError, match=r"Quote values that hold '=' or '&', such as storage URIs"):
        check_overrides(["checkpoint_path=s3://b/x?endpoint_override=127.0.0.1:9000&scheme=http"])


@pytest.mark.s3
def test_command_line_takes_quoted_uris(s3_root, tmp_path):
    """URIs hold '=' and '&', so on Hydra's command line they are quoted."""
    config = uri_config(s3_root, tmp_path)
    module = tmp_path / "pbg_config.py"
    graph = {k: v for k, v in config.to_dict().items() if k in ("entities", "relations", "dimension")}
    module.write_text(f"def get_torchbiggraph_config():\n    return {graph!r}\n")
    args = [f"entity_path='{config.entity_path}'", f"edge_paths=['{config.edge_paths[0]}']",
            f"eval_edge_paths=['{config.eval_edge_paths[0]}']",
            f"checkpoint_path='{config.checkpoint_path}'",
            f"importer.inputs=[{','.join(config.importer.inputs)}]",
            "importer.lhs_col=0", "importer.rel_col=1", "importer.rhs_col=2"]
    done = subprocess.run([sys.executable, "-m", "pbg_ray.import_edges", str(module), *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["inputs"][0]["edges"] == 600
    assert len(load_entity_names(config.entity_path, "node", 0)) > 10
