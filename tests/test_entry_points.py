"""`python -m pbg_ray.train` as a user runs it: from any directory, errors as one line."""

import json
import os
import subprocess
import sys

from conftest import config_dict, write_random_graph
from pbg_ray.config import ConfigSchema


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


def test_train_a_pbg_config_module_from_another_directory(tmp_path):
    data = config_dict(tmp_path / "data", num_epochs=1, eval_fraction=0.0, dimension=4,
                       global_emb=False)
    write_random_graph(ConfigSchema.from_dict(data), num_edges=50)
    module = tmp_path / "pbg_config.py"
    module.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_train([str(module), "lr=0.05", "ray.num_cpus=1", "ray.cpus_per_trainer=1"],
                     cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["version"] == 1
    assert summary["checkpoint_path"] == data["checkpoint_path"]
    assert (tmp_path / "data" / "checkpoints" / "checkpoint_version.txt").read_text() == "1\n"
