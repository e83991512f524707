"""Connecting the driver to Ray: a local Ray started and shut down whole, or a cluster
joined; and whether a task's CPUs or GPUs fit a node of it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Callable, List, Optional

import psutil
import ray

from pbg_ray.config import RayConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.runtime.budget import (
    MemoryBudget, MemoryPlan, memory_budget, object_store_memory)
from pbg_ray.runtime.tasks import TASK_RETRIES

logger = logging.getLogger("pbg_ray")

# Ray's notice, each time ray.init() starts a local Ray, that it turned token authentication
# on: nothing the user of a local run can act on. Only the notice is dropped: authentication
# stays as Ray sets it, and joining a cluster (ray.address) is left as it is.
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
# A local Ray started here starts no plain workers ahead of need: Ray would start one per
# CPU as the driver connects, for tasks without a runtime_env, and pbg_ray's tasks run in
# their own (runtime.tasks.TASK_RUNTIME_ENV), whose workers start as the trainer asks for
# them; the actors start in workers of their own when created. A task that Ray's memory
# monitor kills is run again TASK_RETRIES times, not without end.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "task_oom_retries": TASK_RETRIES}
# The address of the local Ray that connect_ray started, on this machine: no autoscaler
# adds a node to it (see check_task_fits).
_local_gcs_address: Optional[str] = None
# How long shutdown_ray waits for the processes of the local Ray to end before it kills them.
RAY_EXIT_WAIT_S = 10.0
# prctl's option that makes a process the reaper of its orphaned descendants (Linux).
PR_SET_CHILD_SUBREAPER = 36


def not_token_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(TOKEN_NOTICE)


def connect_ray(ray_config: RayConfig) -> None:
    """Join ray.address (RAY_ADDRESS, as `ray job submit` sets it, when that is null), or
    start a local Ray, never joining one that `ray start` left on this machine; keep one
    already connected. The process's own handlers of SIGINT and SIGTERM are kept: ray.init
    would leave the core worker's native SIGTERM handler (a stack dump, then an abort)."""
    global _local_gcs_address
    if ray.is_initialized():
        return
    address = "local" if starts_local_ray(ray_config) else ray_config.address
    token_logger = logging.getLogger(TOKEN_LOGGER)
    token_logger.addFilter(not_token_notice)
    # Settings of the processes Ray starts: only for a Ray started here (joining one refuses
    # them), its object store sized to the memory budget.
    local = ({"_system_config": LOCAL_SYSTEM_CONFIG,
              "object_store_memory": object_store_memory(ray_config, memory_budget(ray_config))}
             if address == "local" else {})
    if address == "local":
        reap_orphans()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(address=address, num_cpus=ray_config.num_cpus,
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
                 **local)
    finally:
        token_logger.removeFilter(not_token_notice)
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
    if address == "local":
        _local_gcs_address = ray.get_runtime_context().gcs_address
        stop_unused_processes()


def reap_orphans() -> None:
    """Make this process the reaper of its orphaned descendants (Linux; elsewhere nothing):
    a local Ray's workers, agents and actors whose raylet died (a signal to the whole
    process group, an OOM kill) stay its descendants, for shutdown_ray and kill_local_ray
    to find, instead of running on under init."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def starts_local_ray(ray_config: RayConfig) -> bool:
    """Whether the run's Ray is a local one started by pbg_ray on this machine: connected to
    the one connect_ray started, or, not connected yet, with neither ray.address nor
    RAY_ADDRESS to join."""
    if ray.is_initialized():
        return local_ray()
    return ray_config.address is None and not os.environ.get("RAY_ADDRESS")


def local_task_slots(ray_config: RayConfig) -> int:
    """Tasks of ray.cpus_per_trainer CPUs each that the local Ray runs at once."""
    cpus = ray_config.num_cpus or os.cpu_count() or 1
    return max(1, int(cpus // ray_config.task_cpus()))


def check_plan_fits(ray_config: RayConfig, plan: MemoryPlan,
                    fix: Callable[[MemoryBudget], str]) -> None:
    """Refuse in one line (PbgRayError, with the plan's figures and what `fix` says would
    fit the budget) a command that starts a local Ray and whose plan exceeds the memory it
    may use. A command that joins a cluster is not checked: the budget is one machine's,
    and the cluster's nodes are others."""
    if not starts_local_ray(ray_config):
        return
    budget = memory_budget(ray_config)
    if plan.total > budget.bytes:
        raise plan.refuse(budget, fix(budget))


def stop_unused_processes() -> None:
    """Stop the processes of the local Ray this process started that no command of
    pbg_ray uses: the autoscaler monitor (one machine has nothing to scale) and the
    dashboard's API server (with include_dashboard=False Ray still starts it, for its usage
    statistics alone; the state API and job submission would need it). `ray start
    --no-monitor` leaves the monitor out, ray.init has no such switch for either: Ray's
    node object, which holds the processes, stops them (and ray.shutdown then has nothing
    left to stop there). A Ray whose node object lacks these keeps them. (The raylet's
    dashboard and runtime env agents stay: the raylet ends when one of them does.)"""
    node = getattr(ray._private.worker, "_global_node", None)
    for name in ("kill_monitor", "kill_dashboard"):
        kill = getattr(node, name, None)
        if kill is not None:
            kill(check_alive=False)


def local_ray() -> bool:
    """Whether the connected Ray is the local one that connect_ray started on this machine
    (no autoscaler adds a node to it; shutdown_ray ends it). Read from the worker's own
    GCS client, without ray.get_runtime_context(), whose lock a signal handler (the
    command's stop) could find taken by the very code it interrupted."""
    worker = ray._private.worker.global_worker
    client = getattr(worker, "gcs_client", None)  # (gone once Ray shuts down)
    return worker.connected and client is not None and client.address == _local_gcs_address


def descendants() -> List[psutil.Process]:
    """Every process this one started, and theirs (with reap_orphans: orphans too)."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def shutdown_ray() -> None:
    """Disconnect from Ray. The local Ray that connect_ray started is shut down, and this
    returns once every process of it has ended: ray.shutdown() ends those that ray.init
    started (raylet, GCS, ...), killing the raylet if it takes more than a second to end,
    and leaves the raylet's own (workers, agents) to the raylet; an agent whose raylet was
    killed waits minutes for the GCS, gone by then. Those still running RAY_EXIT_WAIT_S
    after ray.shutdown() are killed."""
    processes = descendants() if local_ray() else []
    ray.shutdown()
    _, alive = psutil.wait_procs(processes, timeout=RAY_EXIT_WAIT_S)
    _kill(alive)


def kill_local_ray() -> None:
    """End the local Ray that connect_ray started at once, for a command that was asked to
    stop: its spilled objects removed (as ray.shutdown() does), then every process this
    one started killed and reaped. (A signal to the command's whole process group, or to
    every process of its cgroup, reaches the GCS and the raylet too: they linger half shut
    down, and ray.shutdown() would wait a minute for the GCS.) The caller then exits
    without Ray's exit handler, which would wait the same."""
    node = getattr(ray._private.worker, "_global_node", None)
    try:
        if local_ray() and node is not None:
            node.destroy_external_storage()
    except OSError:
        pass  # nothing spilled, or already gone
    finally:  # (whatever the removal raised)
        _kill(descendants())


def _kill(processes: List[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=RAY_EXIT_WAIT_S)


def largest_node(resource: str) -> float:
    """The most of `resource` (CPU, GPU) that one alive node of the Ray cluster has."""
    return max((n["Resources"].get(resource, 0) for n in ray.nodes() if n["Alive"]), default=0)


def check_task_fits(key: str, resource: str, amount: float) -> None:
    """A task that asks for `amount` of `resource` (config `key`) runs only on a node
    that has that much. With no such node alive it would wait: on the local Ray started
    here, for ever (refused, naming the key), on a cluster until its autoscaler adds
    one (a warning)."""
    if amount <= 0:
        return
    largest = largest_node(resource)
    if largest >= amount:
        return
    problem = (f"{key}={amount:g}: each task asks for {amount:g} {resource}s, and no node of "
               f"the Ray cluster has that many (the largest has {largest:g})")
    if local_ray():
        more = " or start the local Ray with more (ray.num_cpus)" if resource == "CPU" else ""
        raise PbgRayError(f"{problem}. Set {key} to at most {largest:g}{more}.")
    logger.warning("%s: the tasks wait until a node that large joins the cluster.", problem)


def check_cpus_per_trainer(ray_config: RayConfig) -> None:
    """check_task_fits for the tasks that ask for ray.cpus_per_trainer CPUs (training,
    evaluation, predict and export)."""
    check_task_fits("ray.cpus_per_trainer", "CPU", ray_config.task_cpus())
