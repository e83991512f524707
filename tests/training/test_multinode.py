"""Buckets with disjoint partitions train at once on different nodes of a real
two-node Ray cluster, and the checkpoint equals a single-node run's in shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.training.trainer import Trainer
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


def test_two_nodes_train_disjoint_buckets_concurrently(ray_session, tmp_path):
    data = config_dict(tmp_path, num_epochs=2, eval_fraction=0.0, comparator="dot",
                       loss_fn="softmax", ray={"num_trainers": 2, "cpus_per_trainer": 1})
    config = ConfigSchema.from_dict(data)
    write_random_graph(config, num_edges=3000)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("multinode_run.py")),
                           json.dumps(data)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["nodes"] == 2 and summary["version"] == 2
    assert summary["held"], "the two buckets held at once (multinode_run.py) never both waited"
    stats = summary["stats"]
    assert len({s["worker"]["node_id"] for s in stats}) == 2, "all buckets ran on one node"
    overlapping = [
        (a, b) for i, a in enumerate(stats) for b in stats[i + 1:]
        if a["worker"]["start"] < b["worker"]["end"] and b["worker"]["start"] < a["worker"]["end"]]
    assert overlapping, "no two buckets trained at the same time"
    for a, b in overlapping:
        parts_a = {a["lhs_partition"], a["rhs_partition"]}
        parts_b = {b["lhs_partition"], b["rhs_partition"]}
        assert not parts_a & parts_b, (a, b)
        assert a["worker"]["node_id"] != b["worker"]["node_id"]
    assert_valid_checkpoint(config, 2)

    # The same config on the single-node session Ray: the same checkpoint layout.
    single = ConfigSchema.from_dict(dict(data, checkpoint_path=str(tmp_path / "single")))
    assert Trainer(single).run().version == 2
    assert_valid_checkpoint(single, 2)
    names = lambda p: sorted(f.name for f in Path(p).iterdir())  # noqa: E731
    assert names(config.checkpoint_path) == names(single.checkpoint_path)
