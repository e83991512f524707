"""eval, export and serve on a local Ray check their plan against the memory they may use
before Ray starts: a plan over the budget is refused in one line with its figures and what
would fit (docs/sizing.md); the plans' figures follow the tables they hold."""

import dataclasses
from pathlib import Path

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import TASK_SCRATCH, evaluation_plan
from pbg_ray.evaluation.entity_names import READ_PER_NAME, EntityNames, names_bytes
from pbg_ray.export import EXPORT_COPIES, export_plan
from pbg_ray.runtime.budget import GIB
from pbg_ray.serving.index import index_bytes
from pbg_ray.serving.launch import serving_plan
from tests.commands.test_cli import assert_one_error_line, pbg_module, run
from tests.util import partitioned_checkpoint

ROWS = 50_000  # per partition, 8 partitions, d=16: 3.05 MiB a partition
ONE_TASK = ["ray.num_cpus=1", "ray.cpus_per_trainer=1"]


@pytest.fixture
def checkpoint(tmp_path) -> ConfigSchema:
    """A random checkpoint of 8 partitions of one type (no training), and its config file."""
    config = partitioned_checkpoint(tmp_path, 8, 8 * ROWS, 16)
    pbg_module(tmp_path / "config.py", config.to_dict())
    return config


def with_ray(config: ConfigSchema, **ray) -> ConfigSchema:
    return dataclasses.replace(config, ray=dataclasses.replace(config.ray, **ray))


def test_the_plans_hold_what_each_command_keeps(checkpoint):
    counts = {"node": [ROWS] * 8, "user": [30, 31], "item": [20, 21], "tag": [7]}
    partition = ROWS * 16 * 4
    memory = evaluation_plan(checkpoint, counts, filter_edges=0, query_edges=0, tasks=2)
    disk = evaluation_plan(with_ray(checkpoint, placement="disk"), counts, 0, 0, 2)
    assert memory.table == 8 * partition and memory.per_task == TASK_SCRATCH
    assert disk.table == 0 and disk.per_task == TASK_SCRATCH + partition  # its candidates
    assert memory.processes == disk.processes
    known = evaluation_plan(checkpoint, counts, filter_edges=64_000, query_edges=0, tasks=2)
    assert known.per_task > memory.per_task  # the filter buckets' known edges
    queries = evaluation_plan(checkpoint, counts, filter_edges=0, query_edges=1000, tasks=2)
    assert queries.per_task == TASK_SCRATCH + 1000 * 2 * 16 * 4  # both sides' rows

    exact = serving_plan(dataclasses.replace(checkpoint, serve=dataclasses.replace(
        checkpoint.serve, index="exact")), counts)
    hnsw = dataclasses.replace(checkpoint, serve=dataclasses.replace(
        checkpoint.serve, index="hnsw", shard_replicas=2))
    assert exact.table >= 8 * 2 * partition  # a table and prepared vectors per partition
    assert serving_plan(hnsw, counts).table >= 2 * (exact.table + 8 * index_bytes(
        hnsw, "hnsw", ROWS, 16))
    assert index_bytes(hnsw, "hnsw", ROWS, 16) > partition > index_bytes(hnsw, "exact", ROWS, 16)

    tsv = export_plan(checkpoint, counts, tasks=1)
    assert tsv.per_task == int(EXPORT_COPIES["tsv"] * partition) and tsv.tasks == 2


def test_each_router_replica_holds_every_entitys_names_in_the_service_plan(checkpoint):
    counts = {"node": [ROWS] * 8}
    routers = lambda n: dataclasses.replace(checkpoint, serve=dataclasses.replace(  # noqa: E731
        checkpoint.serve, index="ivfpq", router_replicas=n))
    per_router = serving_plan(routers(2), counts).table - serving_plan(routers(1), counts).table
    assert per_router == names_bytes(checkpoint, counts)
    kept = EntityNames(checkpoint).read("node")  # what a router keeps, measured
    assert kept <= per_router <= 2 * kept + READ_PER_NAME * ROWS
    missing = Path(checkpoint.entity_path) / "entity_names_node_3.json"
    missing.unlink()
    with pytest.raises(PbgRayError, match=f"entity names file '{missing}' is missing"):
        serving_plan(routers(1), counts)


def test_an_evaluation_over_its_budget_is_refused_before_ray_starts_with_the_fix(
        checkpoint, tmp_path):
    counts = {"node": [ROWS] * 8}
    config = with_ray(checkpoint, num_cpus=1)
    memory = evaluation_plan(config, counts, filter_edges=0, query_edges=0, tasks=1).total
    disk = evaluation_plan(with_ray(config, placement="disk"), counts, 0, 0, 1).total
    assert disk < memory
    budget = (disk + memory) // 2
    code, _, err = run("eval", [tmp_path / "config.py", *ONE_TASK, f"ray.memory_budget={budget}",
                                "eval.filtered=false"], tmp_path)
    assert code == 2
    trained_edges = "pbg_ray: warning: eval scores edges the model was trained on"
    assert_one_error_line("\n".join(line for line in err.splitlines()
                                     if not line.startswith(trained_edges)),
                          f"this evaluation in memory placement needs about {memory / GIB:.2f} GiB",
                          "(ray.memory_budget)", "set ray.placement=disk")


def test_an_export_and_a_service_over_their_budget_are_refused_in_one_line(
        checkpoint, tmp_path):
    code, _, err = run("export", [tmp_path / "config.py", *ONE_TASK, "ray.memory_budget=100000000"],
                       tmp_path)
    assert code == 2
    assert_one_error_line(err, "this export needs about", "export.format=parquet")
    assert not (tmp_path / "checkpoints" / "export").exists()
    replicated = dataclasses.replace(checkpoint, serve=dataclasses.replace(
        checkpoint.serve, index="hnsw", shard_replicas=2))
    counts = {"node": [ROWS] * 8, "user": [30, 31], "item": [20, 21], "tag": [7]}
    hnsw = serving_plan(replicated, counts).total
    compressed = serving_plan(dataclasses.replace(replicated, serve=dataclasses.replace(
        replicated.serve, index="ivfpq")), counts).total
    assert compressed < hnsw
    code, _, err = run("serve", [tmp_path / "config.py", *ONE_TASK, "serve.index=hnsw",
                                 f"ray.memory_budget={(compressed + hnsw) // 2}",
                                 "serve.shard_replicas=2"], tmp_path)
    assert code == 2
    assert_one_error_line(err, f"this service needs about {hnsw / GIB:.2f} GiB", "serve.index=ivfpq",
                          "serve.shard_replicas=1")
