"""Run by the node-loss test and benchmarks/fault_bench.py in their own process (a Ray
cluster needs a driver of its own): a three-node Ray cluster on this machine
(ray.cluster_utils.Cluster: a head with no CPU, two workers of one CPU each, so train
tasks run on the workers and partition stores sit on all three), one training run, and a
JSON summary written to SUMMARY_FILE (not stdout: Ray prints a removed node's last log
lines there as the driver ends).

    python tests/engine/node_loss_run.py CONFIG_JSON HIT SUMMARY_FILE

HIT > 0: the HIT-th time a train task has read its bucket (fault point
train_task.after_read, armed to "hold": the task waits there), a worker node is
removed, as a machine of a cluster goes away, with the tasks and actors on it: the node
of the train task held there, so the loss always strikes with that bucket in flight.
HIT = 0: an undisturbed run of the same cluster, for comparison.
"""

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

from tests.fault_injection import FAULTS_DIR, armed, epoch_losses, release  # noqa: E402  (sets the faults directory first)

import psutil  # noqa: E402
import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pbg_ray.config import ConfigSchema  # noqa: E402
from pbg_ray.engine.trainer import Trainer  # noqa: E402

POINT = "train_task.after_read"

config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
hit = int(sys.argv[2])
summary = Path(sys.argv[3])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
removed = {}


def remove_a_node_at_the_mark(fired) -> None:
    """Wait for the armed point to fire (not for a time), then remove the worker node
    whose train task is held there; it holds a partition store too (the trainer places
    one on each node). The hold is released whatever happens, so no run waits forever."""
    while not fired():
        time.sleep(0.02)
    try:
        pid = int(next(FAULTS_DIR.glob(f"{POINT}.fired-*")).name.rsplit("-", 1)[1])
        ancestors = {p.pid for p in psutil.Process(pid).parents()}
        node = next(n for n in workers if n.all_processes[
            ray_constants.PROCESS_TYPE_RAYLET][0].process.pid in ancestors)
        cluster.remove_node(node, allow_graceful=False)
        removed["node_ran_the_task"] = True
    except Exception as err:  # noqa: BLE001  reported in the summary, for the test to show
        removed["watcher_error"] = repr(err)
    finally:
        release(POINT)


try:
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    cluster.wait_for_nodes()
    with armed(POINT, hits=max(hit, 1), action="hold") as fired:
        if hit:
            threading.Thread(target=remove_a_node_at_the_mark, args=(fired,), daemon=True).start()
        result = Trainer(config).run()
        marked = fired()
    summary.write_text(json.dumps({
        "version": result.version, "actor_restarts": result.actor_restarts,
        "node_removed": bool(hit) and marked, **removed,
        "nodes_alive": len([n for n in ray.nodes() if n["Alive"]]),
        "epoch_losses": epoch_losses(result.bucket_stats, config.num_epochs)}))
finally:
    ray.shutdown()
    cluster.shutdown()
