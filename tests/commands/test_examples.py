"""The examples: their configs load, and their scripts run end to end on tiny stand-ins
for the real data written in the real files' formats (the real data isn't downloaded here)."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import load_pbg_config_file
from pbg_ray.io.edges import count_edges
from pbg_ray.types import Bucket
from tests.util import joining_the_session

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["fb15k", "livejournal"])
def test_example_configs_load_and_import_every_edge_path(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PBG_RAY_DATA", str(tmp_path))
    config = load_pbg_config_file(EXAMPLES / name / "config.py")
    assert config.checkpoint_path.startswith(str(tmp_path))
    # One raw file per output edge path, in the importer's order.
    assert len(config.importer.inputs) == len(config.edge_paths) + len(config.eval_edge_paths)


def test_example_scripts_are_executable_bash():
    scripts = sorted(EXAMPLES.rglob("*.sh"))
    assert {s.parent.name for s in scripts} >= {"demo", "fb15k", "livejournal"}
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
        assert os.access(script, os.X_OK), script


def run_script(args, data: Path, **env):
    return subprocess.run(args, env=dict(os.environ, PBG_RAY_DATA=str(data), **env), cwd=data,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_fb15k_example_runs_end_to_end_on_a_tiny_stand_in(tmp_path, ray_session):
    rng = np.random.default_rng(0)
    raw = tmp_path / "FB15k"
    raw.mkdir()
    for split, n in (("train", 400), ("valid", 40), ("test", 40)):
        # FB15k's layout: head<TAB>relation<TAB>tail, Freebase ids.
        rows = [f"/m/e{rng.integers(60)}\t/r/rel{rng.integers(5)}\t/m/e{rng.integers(60)}"
                for _ in range(n)]
        (raw / f"freebase_mtr100_mte100-{split}.txt").write_text("\n".join(rows) + "\n")
    proc = run_script([str(EXAMPLES / "fb15k" / "run.sh"), "num_epochs=1", "dimension=8",
                       "num_uniform_negs=10", "batch_size=100"], tmp_path,
                      **joining_the_session(ray_session))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FB15k is already in" in proc.stdout  # the download was skipped
    assert CheckpointStorage(tmp_path / "model").load_version() == 1
    report = json.loads([l for l in proc.stdout.splitlines() if l.startswith('{"')][-1])
    assert report["edge_paths"] == [str(tmp_path / "graph" / "test")]
    assert len(report["filter_paths"]) == 3  # train, valid and test edges filtered
    assert 0 < report["metrics"]["all"]["filtered"]["mrr"] <= 1


def test_livejournal_split_and_import_on_a_tiny_stand_in(tmp_path):
    rng = np.random.default_rng(0)
    with gzip.open(tmp_path / "soc-LiveJournal1.txt.gz", "wt") as f:
        f.write("# Directed graph (each unordered pair of nodes is saved once)\n"
                "# FromNodeId\tToNodeId\n")
        f.writelines(f"{rng.integers(50)}\t{rng.integers(50)}\n" for _ in range(400))
    assert run_script([sys.executable, str(EXAMPLES / "livejournal" / "split.py")],
                      tmp_path).returncode == 0
    train, test = (pd.read_parquet(tmp_path / f"{s}.parquet") for s in ("train", "test"))
    assert (len(train), len(test)) == (300, 100) and list(train.columns) == ["src", "dst"]
    proc = run_script([sys.executable, "-m", "pbg_ray.import_edges",
                       str(EXAMPLES / "livejournal" / "config.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert count_edges(tmp_path / "graph" / "train", Bucket(0, 0)) == 300
    assert count_edges(tmp_path / "graph" / "test", Bucket(0, 0)) <= 100
