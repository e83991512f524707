"""What a training run on one machine holds in memory, by its plan, against the memory it
may use (runtime/budget.py): a memory-placement run that cannot fit is refused before it
starts, with the figures and the fix; disk placement's partition buffer is fitted to it.

The figures are those footprint_bench and train_bench measure (docs/sizing.md): Ray's own
processes, the driver and the actors, a train worker each with torch loaded (and its CUDA
runtime where it trains on a GPU), and the partitions: in memory placement the whole table
with its row-Adagrad state in Ray's object store plus each train task's copies of its
bucket (the one it trains and the result it puts back), in disk placement only the
unpartitioned types' tables and each trainer's ray.partition_buffer + 4 partitions (the
buffer, the next bucket's read ahead, the last one's written behind). Disk placement's
buffer is the most partitions that fit the budget where the config leaves it null."""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List

from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.budget import (
    ACTOR, CUDA_RUNTIME, DRIVER, GIB, RAY_PROCESSES, TASK_WORKER, MemoryBudget, MemoryPlan,
    memory_budget)
from pbg_ray.runtime.connect import local_task_slots, starts_local_ray
from pbg_ray.training.bucket_task import gpus_per_trainer

logger = logging.getLogger("pbg_ray")

# Bytes a train task holds per byte of its bucket's partitions in memory placement: its
# writable copy, and the trained result put in the object store before the store lets the
# older go (train_bench's 1-partition run: 2.2 beyond the table itself).
BUCKET_COPIES = 2.2
# Disk placement: partitions a trainer holds besides its buffer (ray.partition_buffer).
DISK_EXTRA_PARTITIONS = 4
# The smallest buffer: a bucket's two partitions.
MIN_BUFFER = 2
# Plans within this factor of the smallest need about as much: a refusal names the one of
# the fewest settings among them.
NEAR = 1.05
MAX_SPLIT = 64  # the most times a refusal's fix multiplies the partitions


def partition_bytes(config: ConfigSchema, counts: Dict[str, List[int]], entity: str) -> int:
    """Bytes of the largest partition of a type: embeddings and row-Adagrad sums, float32."""
    return max(counts[entity], default=0) * (config.entity_dimension(entity) + 1) * 4


def memory_plan(config: ConfigSchema, counts: Dict[str, List[int]], trainers: int,
                stores: int, partition_buffer: int) -> MemoryPlan:
    """The plan of a run of `trainers` train tasks at once and `stores` partition stores,
    with `partition_buffer` partitions per trainer in disk placement."""
    used = sorted({getattr(r, side) for r in config.relations for side in ("lhs", "rhs")})
    partitioned = [e for e in used if config.entities[e].num_partitions > 1]
    whole = [e for e in used if e not in partitioned]
    table_of = lambda entities: sum(partition_bytes(config, counts, e)  # noqa: E731
                                    * config.entities[e].num_partitions for e in entities)
    # A bucket holds two partitions of each partitioned type at most, an unpartitioned
    # type whole.
    bucket = (sum(2 * partition_bytes(config, counts, e) for e in partitioned)
              + table_of(whole))
    worker = TASK_WORKER + (CUDA_RUNTIME if gpus_per_trainer(config) > 0 else 0)
    processes = RAY_PROCESSES + DRIVER + (stores + 2) * ACTOR + trainers * worker
    placement = config.ray.placement
    if placement == "memory":
        return MemoryPlan("this run", placement, table_of(used), int(BUCKET_COPIES * bucket),
                          trainers, processes)
    per_index = sum(partition_bytes(config, counts, e) for e in partitioned)
    held = (partition_buffer + DISK_EXTRA_PARTITIONS) * per_index
    return MemoryPlan("this run", placement, table_of(whole),
                      int(held + BUCKET_COPIES * table_of(whole)), trainers, processes)


def fit_to_budget(config: ConfigSchema, counts: Dict[str, List[int]], trainers: int,
                  stores: int, budget: MemoryBudget) -> ConfigSchema:
    """The config whose plan fits the budget, its ray.partition_buffer set: in disk
    placement, where the config leaves it null, the most partitions that fit, up to the
    partition count, and where it sets one, the largest up to it that fits (a warning
    says when that is fewer); in memory placement (whose plan holds the whole table) the
    one set, or MIN_BUFFER. Refused in one line, with the plan's figures and the fix,
    where nothing fits."""
    ray_config = config.ray
    wanted = ray_config.partition_buffer
    most = wanted or (max(MIN_BUFFER, config.num_partitions())
                      if ray_config.placement == "disk" else MIN_BUFFER)
    # Memory placement's plan holds the whole table, whatever the buffer: one try.
    least = MIN_BUFFER if ray_config.placement == "disk" else most
    for buffer in range(most, least - 1, -1):
        if memory_plan(config, counts, trainers, stores, buffer).total > budget.bytes:
            continue
        if wanted is None:
            if ray_config.placement == "disk":
                logger.info("disk placement keeps %d partitions per trainer, the most that "
                            "fit the memory budget of %s (ray.partition_buffer)", buffer, budget)
        elif buffer < wanted:
            logger.warning("ray.partition_buffer=%d does not fit the memory budget of %s; "
                           "training keeps %d partitions per trainer.", wanted, budget, buffer)
        return config if buffer == wanted else dataclasses.replace(
            config, ray=dataclasses.replace(ray_config, partition_buffer=buffer))
    plan = memory_plan(config, counts, trainers, stores, wanted or MIN_BUFFER)
    raise plan.refuse(budget, _fix(config, counts, trainers, stores, budget))


def fit_local_run(config: ConfigSchema, counts: Dict[str, List[int]]) -> ConfigSchema:
    """fit_to_budget for a run on the local Ray pbg_ray starts (or started) on this machine,
    whose CPUs say how many trainers run; a run that joins a cluster is left as it is (the
    budget is one machine's, and the cluster's nodes are not this one), with a buffer of
    MIN_BUFFER partitions where the config leaves it to the budget."""
    ray_config = config.ray
    if not starts_local_ray(ray_config):
        return config if ray_config.partition_buffer else dataclasses.replace(
            config, ray=dataclasses.replace(ray_config, partition_buffer=MIN_BUFFER))
    trainers = ray_config.num_trainers or min(local_task_slots(ray_config),
                                              config.num_partitions())
    return fit_to_budget(config, counts, trainers, ray_config.num_partition_stores or 1,
                         memory_budget(ray_config))


def _fix(config: ConfigSchema, counts: Dict[str, List[int]], trainers: int, stores: int,
         budget: MemoryBudget) -> str:
    """What would fit: disk placement, one train task; where neither does, more partitions
    or more memory, with the smallest limit the run works in as it is partitioned (and the
    fewest settings that need at most NEAR times the least); where one train task's
    processes alone exceed the budget, that floor: no partitioning or placement helps."""
    one_task = "ray.num_trainers=1" + (" ray.cpus_per_trainer=null"
                                       if config.ray.cpus_per_trainer else "")
    disk = dataclasses.replace(config, ray=dataclasses.replace(config.ray, placement="disk"))
    options = {"": memory_plan(config, counts, trainers, stores, MIN_BUFFER)}
    if trainers > 1:
        options[one_task] = memory_plan(config, counts, 1, stores, MIN_BUFFER)
    if config.ray.placement == "memory":
        options["ray.placement=disk"] = memory_plan(disk, counts, trainers, stores, MIN_BUFFER)
        if trainers > 1:
            options[f"ray.placement=disk {one_task}"] = memory_plan(
                disk, counts, 1, stores, MIN_BUFFER)
    fits = [way for way in options if way and options[way].total <= budget.bytes]
    fits = [way for way in fits if not any(set(o.split()) < set(way.split()) for o in fits)]
    if fits:
        return "; or ".join(f"set {way}" for way in fits)
    lowest = min(plan.total for plan in options.values())
    least = min(options, key=lambda way: (options[way].total > NEAR * lowest, len(way.split()),
                                          options[way].total))
    smallest = (f"the smallest limit it runs in is {options[least].total / GIB:.2f} GiB"
                f"{f' with {least}' if least else ''}: give it that (a larger container or "
                "cgroup, or ray.memory_budget where the detected limit is wrong)")
    floor = options[one_task if trainers > 1 else ""].processes
    if floor > budget.bytes:
        return (f"nothing but more memory: Ray's processes, the driver, the actors and one "
                f"train worker alone need {floor / GIB:.2f} GiB, so neither more partitions "
                f"nor ray.placement=disk can fit it; {smallest}")
    on_disk = " with ray.placement=disk" if config.ray.placement == "memory" else ""
    split = (_split_that_fits(config, counts, trainers, stores, budget)
             or "entities.<type>.num_partitions")
    return (f"split the entities into more partitions ({split}, importing again){on_disk}; "
            f"or {smallest}")


def _split_that_fits(config: ConfigSchema, counts: Dict[str, List[int]], trainers: int,
                     stores: int, budget: MemoryBudget) -> str:
    """The settings of the fewest partitions (each partitioned type's count doubled, up to
    MAX_SPLIT times) whose plan, with the same names spread evenly, fits the budget; ''
    where none does."""
    partitioned = [e for e, spec in config.entities.items() if spec.num_partitions > 1]
    factor = 2
    while partitioned and factor <= MAX_SPLIT:
        entities = {e: dataclasses.replace(spec, num_partitions=spec.num_partitions * factor)
                    if e in partitioned else spec for e, spec in config.entities.items()}
        split = dataclasses.replace(config, entities=entities)
        spread = {e: [-(-sum(c) // (len(c) * factor))] * (len(c) * factor)
                  if e in partitioned else c for e, c in counts.items()}
        if memory_plan(split, spread, trainers, stores, MIN_BUFFER).total <= budget.bytes:
            return " ".join(f"entities.{e}.num_partitions={entities[e].num_partitions}"
                            for e in partitioned)
        factor *= 2
    return ""
