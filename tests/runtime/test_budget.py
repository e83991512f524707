"""The memory budget: the limit of the cgroup a process runs in (v1 and v2 layouts, the
smallest along its path; a real cgroup where this machine lets the tests make one),
ray.memory_budget over it, the object store of a local Ray sized to it; and training's
plan against it: refused up front where memory placement cannot fit, disk placement's
buffer fitted."""

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pbg_ray.config import ConfigSchema, RayConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.runtime.budget import (
    CUDA_RUNTIME, GIB, MIB, OBJECT_STORE_SHARE, MemoryBudget, cgroup_limit, memory_budget,
    object_store_memory)
from pbg_ray.training.memory_plan import fit_local_run, fit_to_budget, memory_plan
from tests.util import REPO, config_dict, run_in


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v1_limit_is_the_smallest_along_the_process_path(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/job/step\n1:cpu:/\n0::/\n")
    root = tmp_path / "fs"
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # none
    write(root / "memory" / "job" / "memory.limit_in_bytes", str(3 * GIB))
    write(root / "memory" / "job" / "step" / "memory.limit_in_bytes", str(5 * GIB))
    assert cgroup_limit(proc, root) == (3 * GIB, root / "memory" / "job" / "memory.limit_in_bytes")


def test_a_cgroup_v2_limit_is_read_from_memory_max(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/container\n")
    root = tmp_path / "fs"
    write(root / "memory.max", "max\n")
    write(root / "pod" / "memory.max", "max\n")
    write(root / "pod" / "container" / "memory.max", f"{2 * GIB}\n")
    assert cgroup_limit(proc, root) == (2 * GIB, root / "pod" / "container" / "memory.max")
    write(root / "pod" / "container" / "memory.max", "max\n")
    assert cgroup_limit(proc, root) is None
    assert cgroup_limit(tmp_path / "no such file", root) is None


def test_the_config_states_the_budget_and_the_local_object_store_follows_it():
    stated = RayConfig(memory_budget=2 * GIB)
    assert memory_budget(stated) == MemoryBudget(2 * GIB, "ray.memory_budget")
    assert object_store_memory(stated, memory_budget(stated)) == int(OBJECT_STORE_SHARE * 2 * GIB)
    assert object_store_memory(RayConfig(memory_budget=2 * GIB, object_store_memory=300 * MIB),
                               memory_budget(stated)) == 300 * MIB
    machine = MemoryBudget(psutil.virtual_memory().total, "the machine's RAM")
    assert object_store_memory(RayConfig(), machine) is None  # Ray's own choice


def test_a_local_ray_started_under_a_budget_has_an_object_store_that_fits_it(tmp_path):
    """A local Ray that connect_ray starts (in a process of its own: the tests share
    another) under ray.memory_budget of 1 GiB gets OBJECT_STORE_SHARE of it."""
    script = ("import ray\n"
              "from pbg_ray.config import RayConfig\n"
              "from pbg_ray.runtime.connect import connect_ray, shutdown_ray\n"
              f"connect_ray(RayConfig(num_cpus=1, memory_budget={GIB}))\n"
              "print(int(ray.cluster_resources()['object_store_memory']))\n"
              "shutdown_ray()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == pytest.approx(OBJECT_STORE_SHARE * GIB, rel=0.01)


def sized_config(tmp_path, placement, num_partitions, rows, dimension=100, buffer=2):
    """A config of one type of `rows` rows in `num_partitions` partitions, and its counts."""
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, dimension=dimension, entities={"node": {"num_partitions": num_partitions}},
        relations=[{"name": "to", "lhs": "node", "rhs": "node"}],
        ray={"placement": placement, "partition_buffer": buffer}))
    return config, {"node": [rows // num_partitions] * num_partitions}


def test_a_memory_placement_run_that_cannot_fit_is_refused_with_the_figures_and_the_fix(
        tmp_path):
    config, counts = sized_config(tmp_path, "memory", 16, 8_000_000)  # 3.0 GiB with its sums
    plan = memory_plan(config, counts, trainers=2, stores=1, partition_buffer=2)
    assert plan.table == 8_000_000 * 101 * 4
    budget = MemoryBudget(4 * GIB, "the limit of this process's cgroup, /x/memory.max")
    with pytest.raises(PbgRayError) as refused:
        fit_to_budget(config, counts, 2, 1, budget)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"this run in memory placement needs about "
                              f"{plan.total / GIB:.2f} GiB: table "
                              f"{plan.table / GIB:.2f} GiB")
    assert "may use 4.00 GiB (the limit of this process's cgroup, /x/memory.max)" in message
    assert "set ray.placement=disk" in message  # which fits: two trainers of 6 partitions
    assert "ray.num_trainers=1" not in message  # which does not: the table alone is 3 GiB
    roomy = MemoryBudget(plan.total, "ray.memory_budget")
    assert fit_to_budget(config, counts, 2, 1, roomy) is config


def test_a_run_whose_processes_alone_exceed_the_budget_is_told_the_floor_and_the_least(
        tmp_path):
    """The demo's size (a table of 0.02 GiB) in 1 GiB: the processes of a run of one train
    task need more, so neither partitions nor disk placement are named, but that floor and
    the smallest limit the run works in, with the setting that gets it there, which fits."""
    config, counts = sized_config(tmp_path, "memory", 4, 60_000, dimension=64)
    with pytest.raises(PbgRayError) as refused:
        fit_to_budget(config, counts, 2, 1, MemoryBudget(GIB, "ray.memory_budget"))
    one_task = memory_plan(config, counts, 1, 1, 2)
    fix = str(refused.value).split(" To fit: ")[1]
    assert fix == (
        f"nothing but more memory: Ray's processes, the driver, the actors and one train worker "
        f"alone need {one_task.processes / GIB:.2f} GiB, so neither more partitions nor "
        f"ray.placement=disk can fit it; the smallest limit it runs in is "
        f"{one_task.total / GIB:.2f} GiB with ray.num_trainers=1: give it that (a larger "
        "container or cgroup, or ray.memory_budget where the detected limit is wrong).")
    assert one_task.processes > GIB
    at_least = MemoryBudget(one_task.total, "ray.memory_budget")
    assert fit_to_budget(config, counts, 1, 1, at_least) is config
    with pytest.raises(PbgRayError, match=r"To fit: set ray.num_trainers=1\.$"):
        fit_to_budget(config, counts, 2, 1, at_least)


def test_disk_placement_keeps_the_largest_buffer_that_fits(tmp_path, caplog):
    config, counts = sized_config(tmp_path, "disk", 16, 16_000_000, buffer=8)
    at = lambda buffer: memory_plan(config, counts, 1, 1, buffer).total  # noqa: E731
    budget = MemoryBudget((at(4) + at(5)) // 2, "ray.memory_budget")
    with caplog.at_level(logging.WARNING, logger="pbg_ray"):
        fitted = fit_to_budget(config, counts, 1, 1, budget)
    assert fitted.ray.partition_buffer == 4
    assert "ray.partition_buffer=8 does not fit the memory budget" in caplog.text
    assert dataclasses.replace(fitted, ray=config.ray) == config  # nothing else changed
    too_small = MemoryBudget(at(2) - 1, "ray.memory_budget")
    with pytest.raises(PbgRayError, match="split the entities into more partitions") as refused:
        fit_to_budget(config, counts, 1, 1, too_small)
    # The fix names the fewest partitions that fit: 32, where 16 do not.
    assert "(entities.node.num_partitions=32, importing again)" in str(refused.value)
    split, spread = sized_config(tmp_path, "disk", 32, 16_000_000, buffer=None)
    assert fit_to_budget(split, spread, 1, 1, too_small).ray.partition_buffer >= 2


def test_disk_placement_left_to_the_budget_keeps_the_most_partitions_that_fit(tmp_path,
                                                                              caplog):
    config, counts = sized_config(tmp_path, "disk", 16, 16_000_000, buffer=None)
    at = lambda buffer: memory_plan(config, counts, 1, 1, buffer).total  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="pbg_ray"):
        fitted = fit_to_budget(config, counts, 1, 1, MemoryBudget((at(6) + at(7)) // 2, "x"))
        assert fitted.ray.partition_buffer == 6
        assert fit_to_budget(config, counts, 1, 1, MemoryBudget(at(40), "x")).ray \
            .partition_buffer == 16  # the partition count: more would hold nothing more
    assert not caplog.text  # nothing the config asked for was lowered
    with pytest.raises(PbgRayError, match=f"needs about {at(2) / GIB:.2f} GiB"):
        fit_to_budget(config, counts, 1, 1, MemoryBudget(at(2) - 1, "ray.memory_budget"))


def test_memory_placement_left_to_the_budget_keeps_a_buffer_of_two(tmp_path):
    config, counts = sized_config(tmp_path, "memory", 4, 100_000, buffer=None)
    roomy = MemoryBudget(memory_plan(config, counts, 2, 1, 2).total, "ray.memory_budget")
    assert fit_to_budget(config, counts, 2, 1, roomy).ray.partition_buffer == 2


def test_a_run_joining_a_cluster_keeps_a_buffer_of_two_where_left_to_the_budget(tmp_path):
    config, counts = sized_config(tmp_path, "disk", 16, 16_000_000, buffer=None)
    joining = dataclasses.replace(config, ray=dataclasses.replace(config.ray, address="auto"))
    assert fit_local_run(joining, counts).ray.partition_buffer == 2


def test_a_train_task_on_a_gpu_plans_the_host_memory_of_its_cuda_runtime(tmp_path):
    config, counts = sized_config(tmp_path, "disk", 16, 1_000_000)
    on_gpu = dataclasses.replace(config, ray=dataclasses.replace(config.ray, gpus_per_trainer=1))
    pbg_gpu_key = dataclasses.replace(config, num_gpus=1)  # PBG's key: one GPU per task
    plan = lambda c, trainers: memory_plan(c, counts, trainers, 1, 2)  # noqa: E731
    for gpu_config in (on_gpu, pbg_gpu_key):
        for trainers in (1, 2):
            assert (plan(gpu_config, trainers).processes - plan(config, trainers).processes
                    == trainers * CUDA_RUNTIME)


def test_the_demo_in_a_container_too_small_for_it_is_refused_in_one_line(tmp_path,
                                                                          memory_cgroup):
    """`python -m pbg_ray.train num_epochs=2` in a cgroup of 1.2 GiB (where it used to stall
    at the limit for minutes) reads the cgroup's limit and stops before Ray starts, in one
    line (after the demo's notice) naming the limit and a fix that fits: one train task. In
    1 GiB none fits, its processes alone need more: the line says so, and names the
    smallest limit that works, with that setting."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PBG_RAY_CACHE": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", "from pbg_ray.importer.demo import demo_graph_path; "
                    "demo_graph_path()"], check=True, timeout=300, cwd=tmp_path, env=env)
    limit = 1228 * MIB  # 1.2 GiB, in whole pages
    out = run_in(memory_cgroup, limit, [sys.executable, "-m", "pbg_ray.train", "num_epochs=2"],
                 tmp_path, env)
    assert out.returncode == 2, out.stderr
    demo, line = out.stderr.strip().splitlines()
    assert demo.startswith("pbg_ray: no config file given")
    assert line.startswith("pbg_ray: error: this run in memory placement needs about ")
    assert f"may use 1.20 GiB (the limit of this process's cgroup, {memory_cgroup}" in line
    assert line.endswith(" To fit: set ray.num_trainers=1.")
    out = run_in(memory_cgroup, 1024 * MIB, [sys.executable, "-m", "pbg_ray.train"], tmp_path,
                 env)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert re.search(r" To fit: nothing but more memory: Ray's processes, the driver, the "
                     r"actors and one train worker alone need 1\.\d\d GiB, so neither more "
                     r"partitions nor ray\.placement=disk can fit it; the smallest limit it runs "
                     r"in is 1\.\d\d GiB with ray\.num_trainers=1: give it that", line), line
    budget = run_in(memory_cgroup, limit, [
        sys.executable, "-c", "from pbg_ray.config import RayConfig; from pbg_ray.runtime."
        "budget import memory_budget; print(memory_budget(RayConfig()).bytes)"], tmp_path, env)
    assert int(budget.stdout) == limit
