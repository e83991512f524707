"""The import's memory plan: what an import holds at its peak on one machine, against the
memory it may use (runtime/budget.py: ray.memory_budget, the cgroup's limit, the RAM), made
before anything starts, for both engines; the settings that keep it within it; and the
one-line refusal, naming the smallest limit that would do, where even the least does not.

The Ray engine (importer/ray_engine.py) on a local Ray holds, during its reads:

    Ray's own processes and the driver        RAY_PROCESSES + IMPORT_DRIVER
    each read task (`reads` at once)          IMPORT_WORKER + READ_WORKING: two raw
                                              batches of its shard and its block's ids
    each dictionary shard                     IMPORT_WORKER + its names (`names_bytes`)
    Ray's object store (`object_store`)       the blocks, the shards' answers; what it
                                              cannot hold, Ray spills to disk

The reads are as many as the CPUs allow while the names keep NAMES_SHARE of the budget;
fewer where they would not, and then a smaller object store (down to STORE_SHARES[-1] of
the budget: more of the blocks spilled to disk). A dictionary shard whose names reach
`names_bytes` takes no new names for the rest of the pass: their edges stay unresolved,
it spills its names to disk once the reads end, and the reads run again (a pass) over
the shards whose edges stay unresolved, each pass taking the names the last one left.
After the reads, the shards hand their keys over and hold their names alone, and the
dictionary, route and write tasks hold a block's edges each.

The local engine (importer/graph_import.py) is this process alone: its imports, two raw
batches, and its names (its NameIndex, then the names as Python strings while it writes
the entity files), which stop the import in one line where they outgrow `names_bytes`
(the Ray engine spills them).

A run that joins a cluster (ray.address) is not planned here: the budget is one machine's,
and each node is its own. The figures are measured (docs/sizing.md, "Import")."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.runtime.budget import GIB, MIB, RAY_PROCESSES, MemoryBudget

# Proportional set sizes measured on big_bench's import (docs/sizing.md), rounded up.
IMPORT_DRIVER = 160 * MIB  # the import command with Ray and the readers loaded
IMPORT_WORKER = 150 * MIB  # a Ray worker that ran the import's tasks, between them
READ_WORKING = 200 * MIB  # a read task's batches (a reader thread parses the next) and block
LOCAL_WORKING = 250 * MIB  # the local engine's batches, its spill file's chunk and buckets
# The shards' names may take this share of the budget before the reads go fewer.
NAMES_SHARE = 0.35
# Shares of the budget the local Ray's object store is tried at, in order, where the user
# leaves ray.object_store_memory null: Ray's own share of a machine first.
STORE_SHARES = (0.3, 0.2, 0.1)
# The least a dictionary shard's names may hold: each pass parses every input shard with
# edges still unresolved, so a smaller share is mostly parsing again.
MIN_NAMES_BYTES = 128 * MIB
CPUS_PER_SHARD = 2  # dictionary shards: one per this many of the cluster's CPUs
BLOCK_ROWS = 1 << 20  # edges of a shard read into one block at most


@dataclasses.dataclass(frozen=True)
class ImportPlan:
    """How an import runs within its budget, and what it holds at its peak."""

    engine: str  # "ray" or "local"
    reads: int  # read tasks at once (the local engine: 1)
    shards: int  # dictionary shards (the local engine: 0)
    names_bytes: Optional[int]  # what each shard's names (or the local reader's) may hold
    object_store: Optional[int]  # the local Ray's object store; None: Ray's or the user's
    fixed: int  # the processes
    budget: Optional[MemoryBudget]  # None: joining a cluster, not planned
    block_rows: int = BLOCK_ROWS

    @property
    def total(self) -> int:
        """What it holds at its peak: all of the budget it plans with."""
        return (self.fixed + self.reads * (READ_WORKING if self.engine == "ray" else 0)
                + (self.object_store or 0) + max(self.shards, 1) * (self.names_bytes or 0))

    def describe(self) -> str:
        gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        if self.budget is None:
            return f"{self.reads} read task(s) at once, {self.shards} dictionary shard(s)"
        if self.engine == "local":
            return f"this process {gib(self.fixed)}, names up to {gib(self.names_bytes)}"
        return (f"{self.reads} read task(s) at once, {self.shards} dictionary shard(s) of "
                f"names up to {gib(self.names_bytes)} each, object store "
                f"{gib(self.object_store)}, processes {gib(self.fixed)}")


def ray_fixed(reads: int, shards: int) -> int:
    """The Ray engine's processes: Ray's own, the driver, the read and shard workers."""
    return RAY_PROCESSES + IMPORT_DRIVER + (reads + shards) * IMPORT_WORKER


def _cpus(config: ConfigSchema, cpus: Optional[int]) -> int:
    return max(1, int(cpus or config.ray.num_cpus or os.cpu_count() or 1))


def smallest_limit(engine: str, cpus: int) -> int:
    """The least memory an import of `engine` plans with on `cpus` CPUs: one read at a
    time, dictionary shards of MIN_NAMES_BYTES, the smallest object store."""
    if engine == "local":
        return IMPORT_DRIVER + LOCAL_WORKING + MIN_NAMES_BYTES
    shards = max(1, cpus // CPUS_PER_SHARD)
    held = ray_fixed(1, shards) + READ_WORKING + shards * MIN_NAMES_BYTES
    return -(-held * 100 // (100 - int(100 * STORE_SHARES[-1])))


def import_plan(config: ConfigSchema, engine: str, budget: Optional[MemoryBudget],
                cpus: Optional[int] = None) -> ImportPlan:
    """The plan of an import of `engine` with `budget` (None: joining a cluster, not
    planned) on `cpus` CPUs (default: ray.num_cpus or this machine's); refused in one line
    where even the least does not fit."""
    cpus = _cpus(config, cpus)
    shards = max(1, cpus // CPUS_PER_SHARD)
    if budget is None:
        return ImportPlan("ray", cpus, shards, None, None, 0, None)
    if engine == "local":
        fixed = IMPORT_DRIVER + LOCAL_WORKING
        plan = ImportPlan("local", 1, 0, budget.bytes - fixed, None, fixed, budget)
        return plan if plan.names_bytes >= MIN_NAMES_BYTES else _refuse(plan, cpus)
    stores = ((config.ray.object_store_memory,) if config.ray.object_store_memory is not None
              else tuple(int(share * budget.bytes) for share in STORE_SHARES))
    tried = [(reads, stores[0]) for reads in range(cpus, 0, -1)]
    tried += [(1, store) for store in stores[1:]]
    least = None
    for reads, store in tried:
        fixed = ray_fixed(reads, shards)
        names = (budget.bytes - fixed - reads * READ_WORKING - store) // shards
        plan = ImportPlan("ray", reads, shards, names, store, fixed, budget)
        if names * shards >= NAMES_SHARE * budget.bytes:
            return plan
        if names >= MIN_NAMES_BYTES:
            least = plan
    return least or _refuse(ImportPlan("ray", 1, shards, MIN_NAMES_BYTES, stores[-1],
                                       ray_fixed(1, shards), budget), cpus)


def _refuse(plan: ImportPlan, cpus: int) -> ImportPlan:
    least = smallest_limit(plan.engine, cpus)
    raise PbgRayError(
        f"this import (the {plan.engine} engine) needs at least {least / GIB:.2f} GiB "
        f"({plan.describe()}), and may use {plan.budget}. Give it {least / GIB:.2f} GiB or "
        "more (ray.memory_budget states it in bytes where the detected limit is wrong).")
