"""The memory a run may use: ray.memory_budget where the config states it, else the limit of
the memory cgroup this process runs in (a container's, a Kubernetes pod's, a Slurm job's),
else the machine's RAM; the object store of a local Ray sized to fit it; and a command's
plan (MemoryPlan: what it holds at its peak) checked against it before the command starts.

Ray sizes a local object store from the host's RAM, or from the limit of the root cgroup
only (/sys/fs/cgroup/memory.max), not from the cgroup a process actually runs in; a run
that does not fit is then found out by the kernel's OOM killer. The cgroup's limit is the
smallest along its path: a parent's limit holds for its children."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Optional, Tuple

import psutil

from pbg_ray.config import RayConfig
from pbg_ray.errors import PbgRayError

GIB = 2 ** 30
MIB = 2 ** 20
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large is none.
UNLIMITED = 2 ** 62
# The share of the budget a local Ray's object store gets when the budget is smaller than
# the machine (Ray's own default share of the machine's RAM), and the least Ray accepts.
OBJECT_STORE_SHARE = 0.3
OBJECT_STORE_MIN = 80 * MIB

# Proportional set sizes measured by footprint_bench (docs/sizing.md), rounded up.
RAY_PROCESSES = 360 * MIB  # raylet, GCS, agents, log monitor
DRIVER = 120 * MIB
ACTOR = 100 * MIB  # a partition store, the parameter server, the scheduler
TASK_WORKER = 380 * MIB  # a task's process with torch and the kernel loaded, between tasks
# What torch's CUDA runtime adds to a task's process that trains on a GPU (its host memory;
# big_bench on an H200: the train phase's peak 0.58 GiB above the CPU run's).
CUDA_RUNTIME = 600 * MIB


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """How many bytes a run may use, and where that figure comes from (for messages)."""

    bytes: int
    source: str

    def __str__(self) -> str:
        return f"{self.bytes / GIB:.2f} GiB ({self.source})"


def _cgroup_dirs(proc_cgroup: Path, root: Path) -> Iterator[Tuple[Path, str]]:
    """(directory, limit file name) of this process's memory cgroup and of each of its
    ancestors: cgroup v1's memory hierarchy where it is mounted, else cgroup v2's."""
    lines = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines() if line]
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    v2 = [path for hierarchy, controllers, path in lines if hierarchy == "0" and not controllers]
    if v1 and (root / "memory").is_dir():
        base, path, name = root / "memory", v1[0], "memory.limit_in_bytes"
    elif v2:
        base, path, name = root, v2[0], "memory.max"
    else:
        return
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        yield base.joinpath(*parts[:depth]), name


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                 root: Path = Path("/sys/fs/cgroup")) -> Optional[Tuple[int, Path]]:
    """(bytes, the file that sets them) of the memory limit of the cgroup this process runs
    in, the smallest along its path; None where no cgroup limits memory (or none is
    readable: not Linux, no cgroup file system)."""
    try:
        dirs = list(_cgroup_dirs(proc_cgroup, root))
    except OSError:
        return None
    found: Optional[Tuple[int, Path]] = None
    for directory, name in dirs:
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue  # not mounted in this namespace, or a hierarchy we may not read
        if text.isdigit() and int(text) < UNLIMITED and (found is None or int(text) < found[0]):
            found = (int(text), directory / name)
    return found


def memory_budget(ray_config: RayConfig) -> MemoryBudget:
    """ray.memory_budget, else the cgroup's limit where it is below the machine's RAM, else
    the machine's RAM."""
    if ray_config.memory_budget is not None:
        return MemoryBudget(ray_config.memory_budget, "ray.memory_budget")
    ram = psutil.virtual_memory().total
    limit = cgroup_limit()
    if limit is not None and limit[0] < ram:
        return MemoryBudget(limit[0], f"the limit of this process's cgroup, {limit[1]}")
    return MemoryBudget(ram, "the machine's RAM")


def object_store_memory(ray_config: RayConfig, budget: MemoryBudget) -> Optional[int]:
    """The object store of a local Ray: ray.object_store_memory where set; else, when the
    budget is smaller than the machine, OBJECT_STORE_SHARE of the budget (what Ray gives
    itself of a machine); else None, Ray's own choice."""
    if ray_config.object_store_memory is not None:
        return ray_config.object_store_memory
    if budget.bytes >= psutil.virtual_memory().total:
        return None
    return max(OBJECT_STORE_MIN, int(OBJECT_STORE_SHARE * budget.bytes))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The bytes a command holds at its peak on one machine: what it keeps for its whole
    length (`table`: a table in Ray's object store, the indexes a service holds), each of
    its tasks' working set, and the processes."""

    command: str  # what holds it, for messages: "this run", "this evaluation", ...
    placement: Optional[str]  # where a run's table lives (ray.placement), None: no choice
    table: int
    per_task: int
    tasks: int
    processes: int

    @property
    def total(self) -> int:
        return self.table + self.tasks * self.per_task + self.processes

    def __str__(self) -> str:
        gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        tasks = f", {self.tasks} task(s) x {gib(self.per_task)}" if self.tasks else ""
        return f"{gib(self.total)}: table {gib(self.table)}{tasks}, processes {gib(self.processes)}"

    def refuse(self, budget: MemoryBudget, fix: str) -> PbgRayError:
        """The one-line refusal of a plan over the budget, with what would fit."""
        where = f" in {self.placement} placement" if self.placement else ""
        return PbgRayError(f"{self.command}{where} needs about {self}, and may use {budget}. "
                           f"To fit: {fix}.")
