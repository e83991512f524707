"""The import's memory plan: reads, dictionary shards, what their names may hold and the
object store fitted to the budget before anything starts, for both engines; refused in one
line naming the smallest limit that would do; and under a real memory cgroup, names past
their plan spilled to disk over passes with no OOM kill, or the import refused up front."""

import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import import_graph as local_import
from pbg_ray.importer import plan as plan_module
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.plan import NAMES_SHARE, ImportPlan, import_plan, smallest_limit
from pbg_ray.runtime.budget import GIB, MIB, MemoryBudget
from tests.importer.test_ray_engine import assert_same_import
from tests.importer.util import make
from tests.util import REPO, oom_kills, run_in


def budget(gib: float) -> MemoryBudget:
    return MemoryBudget(int(gib * GIB), "the limit of this process's cgroup, /x/memory.max")


def test_a_roomy_budget_reads_a_shard_per_cpu_and_leaves_the_store_its_share(tmp_path):
    config = make(tmp_path, [])
    plan = import_plan(config, "ray", budget(4), cpus=2)
    assert (plan.reads, plan.shards, plan.object_store) == (2, 1, int(0.3 * 4 * GIB))
    assert plan.names_bytes * plan.shards >= NAMES_SHARE * 4 * GIB
    assert plan.total <= 4 * GIB
    wide = import_plan(config, "ray", budget(16), cpus=8)
    assert (wide.reads, wide.shards) == (8, 4)


def test_a_tight_budget_reads_fewer_shards_at_once_and_shrinks_the_store(tmp_path):
    """Where the names would keep less than their share, fewer reads at once, then a
    smaller object store (Ray spills more of the blocks), and what is left to the names."""
    config = make(tmp_path, [])
    loose = import_plan(config, "ray", budget(4), cpus=2)
    tight = import_plan(config, "ray", budget(1.5), cpus=2)
    assert tight.reads == 1 and tight.object_store < loose.object_store
    assert plan_module.MIN_NAMES_BYTES <= tight.names_bytes < loose.names_bytes
    assert tight.total <= 1.5 * GIB
    stated = import_plan(make(tmp_path, [], ray={"object_store_memory": 200 * MIB}), "ray",
                         budget(1.5), cpus=2)
    assert stated.object_store == 200 * MIB  # the user's store is kept


def test_a_budget_below_the_least_an_import_needs_is_refused_naming_the_smallest(tmp_path):
    config = make(tmp_path, [])
    for engine in ("ray", "local"):
        least = smallest_limit(engine, cpus=2)
        import_plan(config, engine, MemoryBudget(least, "ray.memory_budget"), cpus=2)
        with pytest.raises(PbgRayError) as caught:
            import_plan(config, engine, MemoryBudget(least - MIB, "ray.memory_budget"), cpus=2)
        message = str(caught.value)
        assert message.startswith(f"this import (the {engine} engine) needs at least "
                                  f"{least / GIB:.2f} GiB (")
        assert "may use " in message and "(ray.memory_budget)" in message
        assert f"Give it {least / GIB:.2f} GiB or more" in message and "\n" not in message


def test_joining_a_cluster_plans_no_memory(tmp_path):
    plan = import_plan(make(tmp_path, []), "ray", None, cpus=6)
    assert (plan.reads, plan.shards, plan.names_bytes, plan.object_store) == (6, 3, None, None)


def names_graph(path, edges: int, length: int = 40) -> str:
    """Parquet edges whose every name is new: 2 x `edges` names of `length` characters."""
    pad = "x" * (length - 12)
    table = pa.table({"src": [f"{pad}l{i:011d}" for i in range(edges)],
                      "rel": ["follows"] * edges,
                      "dst": [f"{pad}r{i:011d}" for i in range(edges)]})
    pq.write_table(table, path, row_group_size=edges // 4)
    return str(path)


def import_in(group, limit: int, config, tmp_path, *overrides: str):
    """`python -m pbg_ray.import_edges` of `config` inside memory cgroup `group` limited to
    `limit` bytes, with a Ray of its own (RAY_TMPDIR, short for Ray's socket paths): the
    finished process and that Ray's directory."""
    path = tmp_path / "config.py"
    path.write_text(f"def get_torchbiggraph_config():\n    return {config.to_dict()!r}\n")
    ray_tmp = Path(tempfile.mkdtemp(prefix="pbg-im-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(ray_tmp)}
    try:
        return run_in(group, limit, [sys.executable, "-m", "pbg_ray.import_edges", str(path),
                                     *overrides], tmp_path, env), list(ray_tmp.iterdir())
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_names_past_their_plan_spill_to_disk_within_a_real_cgroup(tmp_path, memory_cgroup):
    """`python -m pbg_ray.import_edges` in a memory cgroup whose plan leaves the dictionary
    shard less than the names' index needs: the import spills its names to disk and reads
    again (more than one pass), no process is OOM-killed, and the graph is the one the
    local engine imports without a limit."""
    limit = smallest_limit("ray", cpus=2) + 24 * MIB
    source = names_graph(tmp_path / "edges.parquet", 600_000, length=100)
    columns = dict(lhs_col="src", rel_col="rel", rhs_col="dst")
    local = make(tmp_path / "local", [source], engine="local", **columns)
    on_ray = make(tmp_path / "ray", [source], engine="ray", **columns, ray={"num_cpus": 2})
    planned = import_plan(on_ray, "ray", MemoryBudget(limit, "the cgroup"))
    # A NameIndex holds about 150 bytes a name of 100 characters: more than the plan leaves.
    assert planned.names_bytes < 1_200_000 * 150
    out, _ = import_in(memory_cgroup, limit, on_ray, tmp_path, "verbose=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "import: pass 1 left the names of " in out.stderr, out.stderr[-3000:]
    assert oom_kills(memory_cgroup) == 0
    assert_same_import(local, on_ray, local_import(local), json.loads(out.stdout.splitlines()[-1]))


def test_an_import_below_its_smallest_limit_is_refused_before_ray_starts(tmp_path,
                                                                        memory_cgroup):
    """In a cgroup below the least the Ray engine plans with, the command stops in one
    line naming the smallest limit that would do, before Ray starts and writing nothing."""
    source = names_graph(tmp_path / "edges.parquet", 1000)
    on_ray = make(tmp_path / "out", [source], engine="ray", lhs_col="src", rel_col="rel",
                  rhs_col="dst", ray={"num_cpus": 2})
    least = smallest_limit("ray", cpus=2)
    out, ray_files = import_in(memory_cgroup, least - 64 * MIB, on_ray, tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    line, = out.stderr.strip().splitlines()
    assert line.startswith("pbg_ray: error: this import (the ray engine) needs at least "
                           f"{least / GIB:.2f} GiB"), line
    assert f"(the limit of this process's cgroup, {memory_cgroup}" in line
    assert not ray_files  # no Ray was started
    assert not (tmp_path / "out" / "train").exists() or not list(
        (tmp_path / "out" / "train").iterdir())


def test_the_local_engine_stops_in_one_line_where_its_names_outgrow_its_plan(tmp_path):
    source = names_graph(tmp_path / "edges.parquet", 2000)
    config = make(tmp_path / "out", [source], engine="local", lhs_col="src", rel_col="rel",
                  rhs_col="dst")
    tiny = ImportPlan("local", 1, 0, 4000 * 40, None, 0, budget(1))
    with pytest.raises(PbgRayError) as caught:
        run_import(config, functools.partial(local_phases, plan=tiny))
    message = str(caught.value)
    assert message.startswith("the import's names outgrow the local engine's memory: ")
    assert "over the 0.00 GiB its plan leaves them" in message and "importer.engine=ray" in message
    assert not any(p.name.startswith(".import") for p in tmp_path.rglob("*"))  # nothing staged
