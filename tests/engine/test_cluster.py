"""engine/cluster.py: the local Ray that pbg_ray starts."""

import subprocess
import sys

# In a process of its own: the settings apply only to a Ray that connect_ray starts. One
# task in the train tasks' kind of worker (which starts after any worker Ray starts as the
# driver connects), then the idle workers the Ray holds: the one that ran it, and any that
# Ray started ahead of need.
START_LOCAL_RAY = """
import psutil, ray
from pbg_ray.config import RayConfig
from pbg_ray.engine.bucket_task import TASK_RUNTIME_ENV
from pbg_ray.engine.cluster import connect_ray

connect_ray(RayConfig(num_cpus=2))
assert ray.get(ray.remote(lambda: 1).options(runtime_env=TASK_RUNTIME_ENV).remote()) == 1
workers = [p for p in psutil.Process().children(recursive=True)
           if any(a.startswith("ray::IDLE") for a in p.cmdline())]
print("IDLE_WORKERS", len(workers))
ray.shutdown()
"""


def test_a_local_ray_starts_workers_only_when_a_task_needs_one():
    proc = subprocess.run([sys.executable, "-c", START_LOCAL_RAY], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IDLE_WORKERS 1" in proc.stdout.splitlines(), proc.stdout
