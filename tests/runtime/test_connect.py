"""runtime/connect.py: the local Ray that pbg_ray starts, and tasks that no node can run."""

import logging
import subprocess
import sys

from pbg_ray.config import RayConfig
from pbg_ray.runtime.connect import check_cpus_per_trainer, check_task_fits

# In a process of its own: the settings apply only to a Ray that connect_ray starts. One
# task in the train tasks' kind of worker (which starts after any worker Ray starts as the
# driver connects), then the plain workers the Ray holds: those started ahead of need
# (a train-kind worker carries KERNEL_ENV in its environment); and its autoscaler monitors.
START_LOCAL_RAY = """
import psutil, ray
from pbg_ray.config import RayConfig
from pbg_ray.runtime.tasks import TASK_RUNTIME_ENV
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.model.native import KERNEL_ENV

connect_ray(RayConfig(num_cpus=2))
assert ray.get(ray.remote(lambda: 1).options(runtime_env=TASK_RUNTIME_ENV).remote()) == 1
plain = [p for p in psutil.Process().children(recursive=True)
         if any(a.startswith("ray::IDLE") for a in p.cmdline())
         and not KERNEL_ENV.keys() & p.environ().keys()]
print("PLAIN_WORKERS", len(plain))
monitors = [p for p in psutil.Process().children(recursive=True)
            if any("autoscaler/_private/monitor.py" in a for a in p.cmdline())]
print("MONITORS", len(monitors))
ray.shutdown()
"""


def test_a_local_ray_starts_no_plain_workers_ahead_of_need_and_keeps_no_monitor():
    proc = subprocess.run([sys.executable, "-c", START_LOCAL_RAY], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "PLAIN_WORKERS 0" in lines and "MONITORS 0" in lines, proc.stdout


def test_tasks_larger_than_every_node_of_a_joined_cluster_are_a_warning(ray_session, caplog):
    """A cluster that the command joined may grow (an autoscaler adds nodes): tasks that
    no node of it can run now get a warning naming the key, not an error. (A local Ray
    that the command starts is refused: tests/commands/test_cli.py.)"""
    cpus = max(n["Resources"].get("CPU", 0) for n in ray_session.nodes() if n["Alive"])
    with caplog.at_level(logging.WARNING, logger="pbg_ray"):
        check_cpus_per_trainer(RayConfig(cpus_per_trainer=cpus))
        check_task_fits("ray.gpus_per_trainer", "GPU", 0.0)
        assert not caplog.records
        check_task_fits("ray.cpus_per_trainer", "CPU", cpus + 1)
    assert [r.getMessage() for r in caplog.records] == [
        f"ray.cpus_per_trainer={cpus + 1:g}: each task asks for {cpus + 1:g} CPUs, and no node "
        f"of the Ray cluster has that many (the largest has {cpus:g}): the tasks wait until a "
        "node that large joins the cluster."]
