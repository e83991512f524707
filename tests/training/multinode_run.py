"""Run by test_multinode.py in its own process: a two-node Ray cluster on this
machine (ray.cluster_utils.Cluster, one CPU a node), one training run, a JSON summary on
stdout.

Two buckets are made to be in flight at once, at named fault points rather than by
chance (a bucket of the test's graph trains in milliseconds): the first train task to
read its bucket waits there (train_task.after_read, "hold") and keeps its node's CPU, so
the next bucket the engine hands out, which must not share a partition with it, can only
train on the other node; it waits when it has trained (train_task.before_return). Once
both wait, both go on.
"""

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

from tests.fault_injection import armed, release  # noqa: E402  (sets the faults directory first)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pbg_ray.config import ConfigSchema  # noqa: E402
from pbg_ray.training.trainer import Trainer  # noqa: E402

FIRST, SECOND = "train_task.after_read", "train_task.before_return"


def release_when_both_wait(first_waits, second_waits) -> None:
    while not (first_waits() and second_waits()):
        time.sleep(0.02)
    release(FIRST)
    release(SECOND)


config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
cluster.add_node(num_cpus=1)
try:
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    with armed(FIRST, action="hold") as first_waits, \
            armed(SECOND, action="hold") as second_waits:
        threading.Thread(target=release_when_both_wait, args=(first_waits, second_waits),
                         daemon=True).start()
        result = Trainer(config).run()
        held = first_waits() and second_waits()
    print(json.dumps({"version": result.version, "stats": result.bucket_stats, "held": held,
                      "nodes": len([n for n in ray.nodes() if n["Alive"]])}))
finally:
    ray.shutdown()
    cluster.shutdown()
