"""cluster.yaml and the on-premises example pass Ray's own cluster-config validation."""

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
