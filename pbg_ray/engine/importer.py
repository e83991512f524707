"""The importer on Ray Data, and the choice of engine (importer.engine).

The importer's phases (pbg_ray/importer/) as parallel tasks over the inputs' shards,
committed by the same `run_import` as the local engine:

    read          every shard parsed by a task (io/raw.py's RawTable, the local reader's
                  relation checks), its edges' names kept as Arrow strings
    count         names counted per batch (NameIndex), then summed by a hash shuffle on
                  (entity type, name key): each distinct name reaches one task, never the
                  driver
    dictionaries  one task places the distinct names of the first input with
                  build_dictionaries (the local engine's seed rule: canonical order by
                  key, seeded shuffle, contiguous partitions; previous imports grown),
                  writes the entity files and returns lookup tables (name key ->
                  partition, offset), kept in the object store
    route         each batch's names looked up in those tables, its edges given their
                  bucket by BucketRouter.buckets, as the local engine does
    write         a hash shuffle on (input, bucket) hands each bucket to one writer task
                  (BucketRouter.write_bucket: the previous import's edges, then the new)

For the same inputs and seed both engines write the same entity files and the same edges
in every bucket (the order inside a bucket may differ). The driver holds per-shard and
per-bucket figures only. Output directories must be reachable from every node (object
storage, or a shared file system).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data
from ray.data.aggregate import Max, Min, Sum

from pbg_ray.config import ConfigSchema
from pbg_ray.engine.cluster import connect_ray
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.dictionaries import build_dictionaries, load_previous
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.name_index import NameIndex, name_keys
from pbg_ray.importer.read import EntityTypes, IdReader, read_stats, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.importer.staging import Staging
from pbg_ray.io.raw import RawTable, input_shards
from pbg_ray.io.storage import StoragePath, storage_path

logger = logging.getLogger("pbg_ray")

UNSEEN = -2  # the bucket of a later input's edges that name what the first never did
DROPPED = -1  # the bucket of edges whose entity or relation was dropped as too rare
RELATIONS = -1  # the type index of relation names (dynamic_relations) when counting


def import_graph(config: ConfigSchema) -> Dict[str, Any]:
    """Import `config.importer.inputs` with the engine importer.engine picks; returns stats."""
    if choose_engine(config) == "local":
        return run_import(config, local_phases)
    connect_ray(config.ray)
    return run_import(config, ray_phases, shared=True)


def choose_engine(config: ConfigSchema) -> str:
    """importer.engine, with auto resolved: ray on a multi-node cluster (ray.address) or
    for inputs of more than importer.ray_min_bytes, else local."""
    settings = config.importer
    if settings.engine != "auto":
        return settings.engine
    if config.ray.address is not None:
        connect_ray(config.ray)
        if sum(1 for node in ray.nodes() if node["Alive"]) > 1:
            return "ray"
    size = sum(shard.size for spec in settings.inputs for shard in input_shards(spec))
    return "ray" if size > settings.ray_min_bytes else "local"


def _user_error(err: BaseException) -> Optional[PbgRayError]:
    """The PbgRayError a task raised, found in the exceptions Ray wraps it in."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, PbgRayError):
            return PbgRayError(str(getattr(err, "cause", None) or err.args[0]))
        err = getattr(err, "cause", None) or err.__cause__
    return None


def _reraising(fn, *args, **kwargs):
    """fn(*args, **kwargs); a PbgRayError raised in a task is raised here as itself."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        user = _user_error(err)
        if user is None:
            raise
        raise user from None


# --- read ---------------------------------------------------------------------


def _parse_shards(items: Dict[str, np.ndarray], config: ConfigSchema) -> Iterator[pa.Table]:
    """Tables of a shard's edges (input, lhs, rhs, rel ids or names, weight), then one row
    with the shard's stats (JSON in `stats`, names null)."""
    reader = IdReader(config)
    weighted = config.importer.weight_col is not None
    for number, path in zip(items["input"], items["shard"]):
        table = RawTable(path, config.importer)
        for batch, rel in reader.batches(table, learn=False):
            columns = {"input": pa.array(np.full(len(batch), number, np.int32)),
                       "lhs": batch.lhs.cast(pa.large_string()),
                       "rhs": batch.rhs.cast(pa.large_string()),
                       "rel": pa.array(rel.astype(np.int64)),
                       "rel_name": pa.nulls(len(batch), pa.large_string())
                       if batch.rel is None or not config.dynamic_relations
                       else batch.rel.cast(pa.large_string())}
            if weighted:
                columns["weight"] = pa.array(batch.weight, pa.float32())
            columns["stats"] = pa.nulls(len(batch), pa.string())
            yield pa.table(columns)
        stats = {"path": str(table.path), "format": table.format, "rows": table.num_rows,
                 "bad_rows": table.bad_rows, "bad_examples": table.bad_examples}
        row = {"input": pa.array([number], pa.int32()), "lhs": pa.nulls(1, pa.large_string()),
               "rhs": pa.nulls(1, pa.large_string()), "rel": pa.array([-1], pa.int64()),
               "rel_name": pa.nulls(1, pa.large_string())}
        if weighted:
            row["weight"] = pa.array([0.0], pa.float32())
        row["stats"] = pa.array([json.dumps(stats)], pa.string())
        yield pa.table(row)


def _edges(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.is_valid(batch["lhs"]))


def _shard_stats(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.is_valid(batch["stats"])).select(["input", "stats"])


# --- count and dictionaries ------------------------------------------------------


def _count_names(batch: pa.Table, config: ConfigSchema) -> pa.Table:
    """The first input's distinct names in a batch: (type, key, check, name, count); the
    keys' bits as int64, which every shuffle of Ray Data takes."""
    batch = _edges(batch)
    batch = batch.filter(pc.equal(batch["input"], 0))
    types = EntityTypes.of(config)
    rel = batch["rel"].to_numpy()
    groups: List[Tuple[int, pa.Array]] = []
    for t in range(len(types.names)):
        lhs = batch["lhs"].filter(pa.array(types.of_edges("lhs", rel) == t))
        rhs = batch["rhs"].filter(pa.array(types.of_edges("rhs", rel) == t))
        groups.append((t, pa.concat_arrays(lhs.chunks + rhs.chunks)
                       if lhs.num_chunks + rhs.num_chunks else pa.array([], pa.large_string())))
    if config.dynamic_relations:
        groups.append((RELATIONS, pa.concat_arrays(batch["rel_name"].chunks)
                       if batch["rel_name"].num_chunks else pa.array([], pa.large_string())))
    parts = []
    for t, names in groups:
        index = NameIndex(f"entity type {types.names[t]!r}" if t >= 0 else "relation names")
        index.add(names)
        parts.append(pa.table({"type": pa.array(np.full(len(index), t, np.int32)),
                               "key": pa.array(index.keys().view(np.int64)),
                               "check": pa.array(index.checks().view(np.int64)),
                               "name": index.names(), "count": pa.array(index.counts)}))
    return pa.concat_tables(parts)


@ray.remote(num_returns=2)
def _build_dictionaries(config: ConfigSchema, entities: StoragePath,
                        counted: List[ray.ObjectRef]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The local engine's build_dictionaries over the counted names; writes the entity
    files to `entities` and returns (lookup tables, the figures the driver needs)."""
    reader = IdReader(config)
    previous = load_previous(config, reader)  # seeds the reader: known names come first
    for table in ray.get(counted):
        if not len(table):
            continue
        clash = pc.not_equal(table["min(check)"], table["max(check)"])
        if pc.any(clash).as_py():
            name = table.filter(clash)["min(name)"][0].as_py()
            raise PbgRayError(f"two different names share the 64-bit key of {name!r}, a chance "
                              "of about one in 10^19 per pair. Rename one of them.")
        types = table["type"].to_numpy()
        for t in np.unique(types):
            rows = table.filter(pa.array(types == t))
            index = (reader.relation_index if t == RELATIONS
                     else reader.entity_index[reader.types.names[t]])
            index.add(rows["min(name)"].combine_chunks(),
                      rows["sum(count)"].to_numpy().astype(np.int64))
    dictionaries = build_dictionaries(config, reader, previous)
    dictionaries.write(config, entities)

    def lookup(index: NameIndex, part: np.ndarray, offset: np.ndarray) -> Tuple[np.ndarray, ...]:
        order = np.argsort(index.keys(), kind="stable")
        return index.keys()[order], index.checks()[order], part[order], offset[order]

    tables = {"entities": {name: lookup(reader.entity_index[name], d.part, d.offset)
                           for name, d in dictionaries.entities.items()},
              "relations": lookup(reader.relation_index, np.zeros_like(
                  dictionaries.relation_ids), dictionaries.relation_ids)
              if config.dynamic_relations else None}
    return tables, {"entities": dictionaries.entity_counts(),
                    "relations": len(dictionaries.relation_names)}


# --- route and write -------------------------------------------------------------


def _look_up(table: Tuple[np.ndarray, ...], names: pa.Array, what: str) -> Tuple[np.ndarray, ...]:
    """(found, partition, offset) of each name in a lookup table."""
    keys, checks, part, offset = table
    key, check = name_keys(names)
    at = np.minimum(np.searchsorted(keys, key), max(len(keys) - 1, 0))
    found = keys[at] == key if len(keys) else np.zeros(len(key), bool)
    clash = found & (checks[at] != check)
    if clash.any():
        raise PbgRayError(f"{what}: the name {names[int(np.argmax(clash))].as_py()!r} shares its "
                          "64-bit key with another name, a chance of about one in 10^19 per "
                          "pair. Rename one of them.")
    return found, np.where(found, part[at], -1), np.where(found, offset[at], -1)


def _route(batch: pa.Table, config: ConfigSchema, tables_ref: List[ray.ObjectRef]) -> pa.Table:
    """Each edge's (input, bucket, lhs, rhs, rel[, weight]); bucket DROPPED or UNSEEN for
    edges left out."""
    batch = _edges(batch)
    tables = ray.get(tables_ref[0])
    types = EntityTypes.of(config)
    weighted = config.importer.weight_col is not None
    router = BucketRouter(config, types, spill_dtype(weighted))
    n = len(batch)
    if config.dynamic_relations:
        found, _, rel = _look_up(tables["relations"], batch["rel_name"].combine_chunks(),
                                 "relation names")
    else:
        found, rel = np.ones(n, bool), batch["rel"].to_numpy()
    sides = {}
    for side in ("lhs", "rhs"):
        of_edge = types.of_edges(side, rel)
        names = batch[side].combine_chunks()
        part, offset = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        for t, name in enumerate(types.names):
            mask = of_edge == t
            if mask.any():
                hit, part[mask], offset[mask] = _look_up(
                    tables["entities"][name], names.filter(pa.array(mask)), f"entity type {name!r}")
                found[mask] &= hit
        sides[side] = part, offset
    bucket = router.buckets(rel, *sides["lhs"], *sides["rhs"])
    columns = {"input": batch["input"], "bucket": pa.array(np.where(found, bucket, UNSEEN)),
               "lhs": pa.array(sides["lhs"][1]), "rhs": pa.array(sides["rhs"][1]),
               "rel": pa.array(rel.astype(np.int64))}
    if weighted:
        columns["weight"] = batch["weight"]
    return pa.table(columns)


def _write_bucket(group: Dict[str, np.ndarray], config: ConfigSchema,
                  stages: List[StoragePath]) -> Dict[str, np.ndarray]:
    """One (input, bucket) group: its bucket file written (placeholder rows, lhs -1, left
    out); returns (input, bucket, edges, previous edges)."""
    number, index = int(group["input"][0]), int(group["bucket"][0])
    real = group["lhs"] >= 0 if index >= 0 else group["bucket"] == index
    previous = 0
    if index >= 0:
        weighted = "weight" in group
        router = BucketRouter(config, EntityTypes.of(config), spill_dtype(weighted))
        names = ("lhs", "rhs", "rel", "weight") if weighted else ("lhs", "rhs", "rel")
        previous_paths = config.importer.previous_edge_paths[number:number + 1]
        previous = router.write_bucket(stages[number], index,
                                       {k: group[k][real] for k in names},
                                       previous_paths[0] if previous_paths else None)
    return {"input": np.array([number]), "bucket": np.array([index]),
            "edges": np.array([int(real.sum()) if index >= 0 else len(real)]),
            "previous": np.array([previous])}


def _placeholders(config: ConfigSchema, num_buckets: int, num_inputs: int) -> ray.data.Dataset:
    """One row per (input, bucket), so that every bucket file is written, empty or not."""
    rows = {"input": np.repeat(np.arange(num_inputs, dtype=np.int32), num_buckets),
            "bucket": np.tile(np.arange(num_buckets, dtype=np.int64), num_inputs)}
    n = len(rows["input"])
    rows.update(lhs=np.full(n, -1, np.int64), rhs=np.full(n, -1, np.int64),
                rel=np.full(n, -1, np.int64))
    if config.importer.weight_col is not None:
        rows["weight"] = np.zeros(n, np.float32)
    return ray.data.from_arrow(pa.table(rows))


def ray_phases(config: ConfigSchema, stages: Staging) -> Tuple[List[Dict[str, Any]],
                                                               Dict[str, int], int]:
    """The phases on Ray Data (see the module doc)."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.shuffle_strategy = ray.data.context.ShuffleStrategy.HASH_SHUFFLE
    partitions = max(1, int(ray.cluster_resources().get("CPU", 1)))  # of each hash shuffle
    shards = [{"input": number, "shard": str(shard.path)}
              for number, spec in enumerate(config.importer.inputs)
              for shard in input_shards(spec)]
    parsed = ray.data.from_items(shards, override_num_blocks=len(shards)).map_batches(
        _parse_shards, batch_size=1, fn_kwargs={"config": config}, batch_format="numpy")
    parsed = _reraising(parsed.materialize)
    logger.info("import: %d shards read", len(shards))
    counted = parsed.map_batches(_count_names, fn_kwargs={"config": config},
                                 batch_format="pyarrow", batch_size=None)
    counted = counted.groupby(["type", "key"], num_partitions=partitions).aggregate(
        Sum("count"), Min("check"), Max("check"), Min("name"))
    tables, figures = _build_dictionaries.remote(config, stages.entities,
                                                 _reraising(counted.to_arrow_refs))
    figures = _reraising(ray.get, figures)
    num_inputs = len(config.importer.inputs)
    router = BucketRouter(config, EntityTypes.of(config), spill_dtype(False))
    routed = parsed.map_batches(_route, fn_kwargs={"config": config, "tables_ref": [tables]},
                                batch_format="pyarrow", batch_size=None)
    grouped = routed.union(_placeholders(config, router.num_buckets, num_inputs)).groupby(
        ["input", "bucket"], num_partitions=partitions)
    written = grouped.map_groups(_write_bucket, batch_format="numpy",
                                 fn_kwargs={"config": config, "stages": stages.edges})
    written = _reraising(written.to_pandas)
    shard_stats = parsed.map_batches(_shard_stats, batch_format="pyarrow", batch_size=None)
    shard_stats = _reraising(shard_stats.to_pandas)
    per_input = []
    for number, (spec, output) in enumerate(zip(config.importer.inputs,
                                                config.edge_paths + config.eval_edge_paths)):
        mine = written[written["input"] == number]
        found = [json.loads(s) for s in shard_stats[shard_stats["input"] == number]["stats"]]
        found.sort(key=lambda s: s["path"])
        stats = {"output": str(storage_path(output)), **read_stats(
            spec, [_ShardFigures(s) for s in found],
            int(mine[mine["bucket"] == UNSEEN]["edges"].sum()) if number else None,
            config.importer.inputs[0])}
        real = mine[mine["bucket"] >= 0]
        stats.update(edges=int(real["edges"].sum() + real["previous"].sum()),
                     dropped_rare=int(mine[mine["bucket"] == DROPPED]["edges"].sum()))
        if config.importer.previous_edge_paths[number:number + 1]:
            stats["previous_edges"] = int(real["previous"].sum())
        per_input.append(stats)
    return per_input, figures["entities"], figures["relations"]


class _ShardFigures:
    """A shard's reading figures as read_stats takes them from a RawTable."""

    def __init__(self, stats: Dict[str, Any]) -> None:
        self.format, self.num_rows = stats["format"], stats["rows"]
        self.bad_rows, self.bad_examples = stats["bad_rows"], stats["bad_examples"]
