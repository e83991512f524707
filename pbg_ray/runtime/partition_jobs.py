"""Per-partition jobs (checkpoints/per_partition.py) as Ray tasks: export and predict's
batch queries over every partition of a table, each task reading its partition itself.

Results come back in the jobs' order, with at most `window` tasks submitted and not yet
consumed, so that memory (the object store's and the driver's) holds the results of a
few partitions per CPU, whatever the number of partitions. A failed task stops the map:
the tasks still in flight (the window's, a few per CPU) are waited for, so none writes
after the caller has cleaned up, and the task's PbgRayError is raised as itself. They are
not cancelled: ray.cancel interrupts a running task with KeyboardInterrupt, which can land
where Python only prints it ("Exception ignored in ..."), on the user's terminal through
the worker's log, beside the one error line.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable, Deque, Dict, Iterator, Optional, Sequence, Tuple

import ray

from pbg_ray.checkpoints.per_partition import MapPartitions
from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.connect import check_cpus_per_trainer, connect_ray
from pbg_ray.runtime.tasks import TASK_RUNTIME_ENV, discard, get_results


def run_job(threads: int, fn: Callable[..., Any], *job: Any) -> Any:
    """fn(*job) on `threads` torch and BLAS threads (see bucket_task.on_task_threads)."""
    from pbg_ray.model.blas import cpu_threads

    with cpu_threads(threads):
        return fn(*job)


class RayPartitionMap:
    """A MapPartitions running each job as a Ray task with `options` (num_cpus, ...), on as
    many torch and BLAS threads as it has CPUs."""

    def __init__(self, options: Dict[str, Any], window: int) -> None:
        self.options = options
        self.window = max(1, window)

    def __call__(self, fn: Callable[..., Any], jobs: Sequence[Tuple[Any, ...]]) -> Iterator[Any]:
        remote = ray.remote(run_job).options(**self.options)
        threads = max(1, int(self.options.get("num_cpus", 1)))
        pending: Deque[ray.ObjectRef] = collections.deque()
        try:
            for job in jobs:
                pending.append(remote.remote(threads, fn, *job))
                if len(pending) >= self.window:
                    yield get_results(pending.popleft())
            while pending:
                yield get_results(pending.popleft())
        finally:  # a failure, or a caller that stopped early
            if pending:
                discard(list(pending), timeout=None)


def partition_map(config: ConfigSchema, cpus: Optional[float] = None) -> MapPartitions:
    """Connect to Ray (config.ray) and return a map whose tasks take `cpus` CPUs each
    (None: ray.cpus_per_trainer), in train tasks' kind of worker, two tasks per such slot
    in flight (one running, one result waiting to be consumed)."""
    connect_ray(config.ray)
    check_cpus_per_trainer(config.ray)
    cpus = config.ray.task_cpus() if cpus is None else cpus
    slots = ray.cluster_resources().get("CPU", 1) / cpus
    return RayPartitionMap({"num_cpus": cpus, "runtime_env": TASK_RUNTIME_ENV},
                           2 * max(1, math.floor(slots)))


def predictor_map(config: ConfigSchema) -> MapPartitions:
    """partition_map for a Predictor of a checkpoint whose config is `config`: Ray's
    address is the environment's (RAY_ADDRESS), not the one training used. Each task
    takes the cluster's CPUs spread over the partitions of the largest entity type (at
    least 1), and never more than ray.cpus_per_trainer: where the partitions outnumber the
    CPUs, one task reads its partition while another scores."""
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, address=None))
    connect_ray(config.ray)
    partitions = max((e.num_partitions for e in config.entities.values()), default=1)
    spread = max(1, math.floor(ray.cluster_resources().get("CPU", 1) / partitions))
    return partition_map(config, min(config.ray.task_cpus(), spread))
