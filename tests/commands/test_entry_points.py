"""`python -m pbg_ray.train` as a user runs it: from any directory, errors as one line."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pbg_ray.config import ConfigSchema
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph


def run_train(args, cwd, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "pbg_ray.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_bad_override_is_one_clear_line(tmp_path):
    proc = run_train(["num_epocs=3"], cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert "unknown key 'num_epocs' (did you mean 'num_epochs'?)" in proc.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("args,fix", [(["--lr", "0.05"], "write lr=0.05"),
                                      (["--num-epochs=3"], "write num_epochs=3")])
def test_an_option_gets_the_key_value_form(tmp_path, args, fix):
    proc = run_train(args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pbg_ray: error: command line: {args[0]}: keys are set as key=value, not as options: "
        f"{fix} (--help lists the options)."]


def tiny_pbg_module(tmp_path):
    """(config dict, PBG config module) of a tiny random graph under tmp_path/data."""
    data = config_dict(tmp_path / "data", num_epochs=1, eval_fraction=0.2, dimension=4,
                       global_emb=False)
    write_random_graph(ConfigSchema.from_dict(data), num_edges=50)
    module = tmp_path / "pbg_config.py"
    module.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    return data, module


def test_train_a_pbg_config_module_from_another_directory(tmp_path):
    data, module = tiny_pbg_module(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_train([str(module), "lr=0.05", "ray.num_cpus=1", "ray.cpus_per_trainer=1"],
                     cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["version"] == 1
    assert summary["checkpoint_path"] == data["checkpoint_path"]
    # The summary's means are the edge-weighted means of training_stats.json's per-edge means.
    lines = [json.loads(l) for l in open(tmp_path / "data" / "checkpoints" / "training_stats.json")]
    for name, key, metric in (("train", "stats", "loss"), ("held_out", "eval_stats_after", "mrr")):
        counts = [l[key]["count"] for l in lines if l.get(key)]
        means = [l[key]["metrics"][metric] for l in lines if l.get(key)]
        assert summary[name][metric] == pytest.approx(np.average(means, weights=counts)), name
    assert 0 < summary["held_out"]["mrr"] <= 1
    assert (tmp_path / "data" / "checkpoints" / "checkpoint_version.txt").read_text() == "1\n"
    # Quiet by default: no warning a user cannot act on (Ray's token notice included), no
    # progress bar off a terminal, nothing written into the working directory.
    assert "WARNING" not in proc.stderr and "token" not in proc.stderr.lower(), proc.stderr
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_multirun_jobs_get_their_own_checkpoints_and_share_one_ray(tmp_path):
    data, module = tiny_pbg_module(tmp_path)
    sweep = tmp_path / "sweep"
    # Ray's sockets live under its temp dir, whose path must stay short.
    ray_tmp = Path(tempfile.mkdtemp(prefix="pbg-mr-", dir="/tmp"))
    proc = run_train([str(module), "-m", "lr=0.05,0.2", f"hydra.sweep.dir={sweep}",
                      "ray.num_cpus=1", f"tensorboard_dir={tmp_path / 'tb'}"],
                     cwd=tmp_path, env_extra={"RAY_TMPDIR": str(ray_tmp)})
    sessions = [p for p in (ray_tmp / "ray").glob("session_*") if not p.is_symlink()]
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    paths = [s["checkpoint_path"] for s in summaries]
    # Each job: beside the configured checkpoint_path, named after its swept value.
    assert paths == [f"{data['checkpoint_path']}-lr={lr}" for lr in (0.05, 0.2)]
    assert (sweep / "multirun.yaml").is_file() and not (sweep / "0").exists()
    for job, path in enumerate(paths):
        assert_valid_checkpoint(ConfigSchema.from_dict(dict(data, checkpoint_path=path)), 1)
        assert json.loads((Path(path) / "config.json").read_text())["lr"] == [0.05, 0.2][job]
        assert list((tmp_path / f"tb-lr={[0.05, 0.2][job]}").glob("events.out.tfevents.*"))
    # The basic launcher runs the jobs in one process: one Ray session served both.
    assert len(sessions) == 1
