"""Run by the node-loss test and benchmarks/fault_bench.py in their own process (a Ray
cluster needs a driver of its own): a three-node Ray cluster on this machine
(ray.cluster_utils.Cluster: a head with no CPU, two workers of one CPU each, so train
tasks run on the workers and partition stores sit on all three), training runs one after
the other, and a JSON list of their summaries written to SUMMARY_FILE (not stdout: Ray
prints a removed node's last log lines there as the driver ends).

    python tests/training/node_loss_run.py RUNS_JSON SUMMARY_FILE

RUNS_JSON: a list of [config dict, HIT]. HIT > 0: the HIT-th time a train task has read
its bucket (fault point train_task.after_read, armed to "hold": the task waits there), a
worker node is removed, as a machine of a cluster goes away, with the tasks and actors on
it: the node of the train task held there, so the loss always strikes with that bucket
in flight. A new worker node takes its place before the next run. HIT = 0: an
undisturbed run of the same cluster, for comparison.
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
from pbg_ray.training.trainer import Trainer  # noqa: E402

POINT = "train_task.after_read"

runs = json.loads(sys.argv[1])
summary = Path(sys.argv[2])
# The GCS declares a node dead after 3 missed health checks a second apart (Ray's default,
# 5 missed 3 s apart, leaves each loss unnoticed for most of the run's time).
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
cluster = Cluster(initialize_head=True,
                  head_node_args={"num_cpus": 0, "_system_config": HEALTH_CHECKS})
workers = [cluster.add_node(num_cpus=1) for _ in range(2)]


def remove_a_node_at_the_mark(fired, run_ended, removed) -> None:
    """Wait for the armed point to fire (not for a time), then remove the worker node
    whose train task is held there; it holds a partition store too (the trainer pins one
    to each node). The hold is released whatever happens, so no run waits forever; a run
    that ends without reaching the point ends the wait."""
    while not fired():
        if run_ended.is_set():
            return
        time.sleep(0.02)
    try:
        pid = int(next(FAULTS_DIR.glob(f"{POINT}.fired-*")).name.rsplit("-", 1)[1])
        ancestors = {p.pid for p in psutil.Process(pid).parents()}
        node = next(n for n in workers if n.all_processes[
            ray_constants.PROCESS_TYPE_RAYLET][0].process.pid in ancestors)
        cluster.remove_node(node, allow_graceful=False)
        workers.remove(node)
        removed["node_ran_the_task"] = True
    except Exception as err:  # noqa: BLE001  reported in the summary, for the test to show
        removed["watcher_error"] = repr(err)
    finally:
        release(POINT)


def train(config: ConfigSchema, hit: int) -> dict:
    """One run, losing a node at `hit` (0: none); its summary."""
    removed: dict = {}
    if hit:
        run_ended = threading.Event()
        with armed(POINT, hits=hit, action="hold") as fired:
            watcher = threading.Thread(target=remove_a_node_at_the_mark,
                                       args=(fired, run_ended, removed), daemon=True)
            watcher.start()
            try:
                result = Trainer(config).run()
            finally:
                run_ended.set()
            removed["node_removed"] = fired()
        watcher.join()
    else:
        result = Trainer(config).run()
    return {"version": result.version, "actor_restarts": result.actor_restarts,
            "node_removed": False, **removed,
            "nodes_alive": len([n for n in ray.nodes() if n["Alive"]]),
            "session_dir": ray._private.worker._global_node.get_session_dir_path(),
            "epoch_losses": epoch_losses(result.bucket_stats, config.num_epochs)}


try:
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    summaries = []
    for data, hit in runs:
        while len(workers) < 2:  # the lost node's successor joins before the next run
            workers.append(cluster.add_node(num_cpus=1))
        cluster.wait_for_nodes()
        summaries.append(train(ConfigSchema.from_dict(data), hit))
    summary.write_text(json.dumps(summaries))
finally:
    ray.shutdown()
    cluster.shutdown()
