"""cluster.yaml and the on-premises example pass Ray's own cluster-config validation, and the
on-premises setup gives the cluster's user a Python environment of its own."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["cluster.yaml", "examples/cluster-onprem.yaml"])
def test_cluster_config_is_valid_for_ray(path):
    config = yaml.safe_load((ROOT / path).read_text())
    prepared = prepare_config(config)  # fills Ray's defaults, then validates, as `ray up` does
    validate_config(prepared)
    assert any("pip install -e ~/pbg_ray" in c for c in prepared["setup_commands"])


def test_cluster_yaml_has_an_autoscaling_gpu_worker_type():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    worker = config["available_node_types"]["worker.gpu"]
    assert worker["min_workers"] == 0 < worker["max_workers"]
    assert worker["node_config"]["InstanceType"].startswith(("g", "p"))


def test_the_onprem_setup_gives_the_cluster_user_a_python_environment_of_its_own(tmp_path):
    """Run as Ray's launcher runs a node's commands (a login shell that sources ~/.bashrc),
    in a fresh home: the setup makes ~/pbg_ray-env and activates it, so `pip install -e
    ~/pbg_ray` and Ray's start commands use it, never a Python the user can't write to;
    a second `ray up` changes nothing."""
    setup = yaml.safe_load((ROOT / "examples/cluster-onprem.yaml").read_text())["setup_commands"]
    assert setup[-1] == "pip install -e ~/pbg_ray"
    (tmp_path / ".bashrc").write_text("export RAY_TMPDIR=/tmp/x\n")

    def on_the_node(command):  # Ray's command runner's shell, with the user's home
        shell = ["bash", "--login", "-c", "-i", f"source ~/.bashrc; ({command})"]
        env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}
        return subprocess.run(shell, env=env, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)

    for _ in range(2):
        for command in setup[:-1]:
            assert on_the_node(command).returncode == 0, command
    found = on_the_node("command -v pip python").stdout.split()
    assert found == [str(tmp_path / "pbg_ray-env" / "bin" / name) for name in ("pip", "python")]
    assert (tmp_path / ".bashrc").read_text().count("pbg_ray-env/bin/activate") == 1
