"""The importer on Ray Data, and the choice of engine (importer.engine).

The importer's phases (pbg_ray/importer/) as parallel work over the inputs' shards,
committed by the same `run_import` as the local engine:

    read          Ray Data parses every shard in a task (io/raw.py's RawTable, the local
                  reader's relation checks) into Arrow blocks in the object store
    index         each block's names get block ids (NameIndex, as the local reader
                  gives ids); its edges become (input, lhs, rhs, rel[, weight]) block
                  ids, and its first-input names with their counts are split by a hash
                  of the name key into one part per count task
    count         a task per part sums its names' counts: each distinct name reaches
                  one task, never the driver
    dictionaries  one task places the distinct names with build_dictionaries (the
                  local engine's seed rule: canonical order by key, seeded shuffle,
                  contiguous partitions; previous imports grown), writes the entity
                  files and returns lookup tables (name key -> partition, offset)
    route         each block's distinct names looked up in those tables once, its
                  edges given their bucket by BucketRouter.buckets, as the local engine
                  does, and split by bucket into one part per writer
    write         a task per writer gathers its buckets' edges from every block and
                  writes their files (BucketRouter.write_bucket: the previous import's
                  edges, then the new)

The three exchanges after the read (names to count tasks, routed edges to writers) are
map tasks with one return per receiving task: Ray Data's hash shuffle would start its
aggregator actors at every import and carry each edge's names as strings through it
(docs/benchmarks.md, "Local and Ray Data engines"). For the same inputs and seed both
engines write the same entity files and the same edges in every bucket (the order inside
a bucket may differ). The driver holds object references and per-shard and per-bucket
figures only. The map, count and write tasks are spread over the nodes (Ray's default
would pack tasks this short onto the driver's node). Output directories must be reachable
from every node (object storage, or a shared file system).
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

from pbg_ray.config import ConfigSchema
from pbg_ray.engine.cluster import connect_ray
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.dictionaries import build_dictionaries, load_previous
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.name_index import NameIndex, mix
from pbg_ray.importer.read import EntityTypes, IdReader, read_stats, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.importer.staging import Staging
from pbg_ray.io.raw import PARQUET_BATCH_ROWS, RawBatch, RawTable, input_shards
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


# --- index and count ---------------------------------------------------------------


def _parts_of(keys: np.ndarray, parts: int) -> np.ndarray:
    """The count task of each name key (short names' keys are their bytes: mixed first)."""
    return (mix(keys.copy()) % np.uint64(parts)).astype(np.int64)


@ray.remote(scheduling_strategy="SPREAD")
def _index_block(config: ConfigSchema, parts: int, block: pa.Table) -> Tuple[Any, ...]:
    """A parsed block's (shard stats, edges as block ids with the block's distinct names,
    then its first-input names with their counts, split into `parts` by name key)."""
    stats = _shard_stats(block)
    block = _edges(block)
    reader = IdReader(config)
    first = (block["input"].to_numpy() == 0).astype(np.int64)  # only the first input counts
    rel, lhs, rhs = [], [], []
    for at in range(0, len(block), PARQUET_BATCH_ROWS):  # hashed in cache-sized slices
        part = block.slice(at, PARQUET_BATCH_ROWS)
        rows = RawBatch(part["lhs"].combine_chunks(), part["rhs"].combine_chunks(),
                        part["rel_name"].combine_chunks(), None, np.empty(0))
        counts = first[at:at + len(part)]
        rel.append(reader.relation_ids(rows, learn=True, counts=counts)
                   if config.dynamic_relations else part["rel"].to_numpy())
        ids = reader.entity_ids(rows, rel[-1], learn=True, counts=counts)
        lhs.append(ids[0])
        rhs.append(ids[1])
    rel, lhs, rhs = (np.concatenate(c) if c else np.empty(0, np.int64) for c in (rel, lhs, rhs))
    indexes = dict(enumerate(reader.entity_index[t] for t in reader.types.names))
    if config.dynamic_relations:
        indexes[RELATIONS] = reader.relation_index
    edges = {"input": block["input"].to_numpy(), "lhs": lhs, "rhs": rhs, "rel": rel,
             "names": {t: (index.keys(), index.checks(), index.names())
                       for t, index in indexes.items()}}
    if "weight" in block.column_names:
        edges["weight"] = block["weight"].to_numpy()
    counted, part = [], []
    for t, index in indexes.items():
        mine = index.counts > 0
        counted.append(pa.table({"type": pa.array(np.full(int(mine.sum()), t, np.int32)),
                                 "name": index.names().filter(pa.array(mine)),
                                 "count": pa.array(index.counts[mine])}))
        part.append(_parts_of(index.keys()[mine], parts))
    counted, part = pa.concat_tables(counted), np.concatenate(part)
    return (stats, edges) + tuple(counted.filter(pa.array(part == p)) for p in range(parts))


@ray.remote(scheduling_strategy="SPREAD")
def _count_part(config: ConfigSchema, *counted: pa.Table) -> pa.Table:
    """One part's distinct names with their counts summed over every block."""
    table = pa.concat_tables(counted)
    types = EntityTypes.of(config)
    out = []
    for t in np.unique(table["type"].to_numpy()):
        rows = table.filter(pc.equal(table["type"], int(t)))
        index = NameIndex(f"entity type {types.names[t]!r}" if t >= 0 else "relation names")
        index.add(rows["name"].combine_chunks(), rows["count"].to_numpy())
        out.append(pa.table({"type": pa.array(np.full(len(index), t, np.int32)),
                             "name": index.names(), "count": pa.array(index.counts)}))
    return pa.concat_tables(out) if out else table


@ray.remote(num_returns=2)
def _build_dictionaries(config: ConfigSchema, entities: StoragePath,
                        *counted: pa.Table) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The local engine's build_dictionaries over the counted names; writes the entity
    files to `entities` and returns (lookup tables, the figures the driver needs)."""
    reader = IdReader(config)
    previous = load_previous(config, reader)  # seeds the reader: known names come first
    for table in counted:
        types = table["type"].to_numpy()
        for t in np.unique(types):
            rows = table.filter(pa.array(types == t))
            index = (reader.relation_index if t == RELATIONS
                     else reader.entity_index[reader.types.names[t]])
            index.add(rows["name"].combine_chunks(), rows["count"].to_numpy())
    dictionaries = build_dictionaries(config, reader, previous)
    dictionaries.write(config, entities)

    def lookup(index: NameIndex, part: np.ndarray, offset: np.ndarray) -> Tuple[np.ndarray, ...]:
        order = np.argsort(index.keys(), kind="stable")
        return index.keys()[order], index.checks()[order], part[order], offset[order]

    tables = {t: lookup(reader.entity_index[name], d.part, d.offset)
              for t, name in enumerate(reader.types.names)
              for d in [dictionaries.entities[name]]}
    if config.dynamic_relations:
        tables[RELATIONS] = lookup(reader.relation_index, np.zeros_like(
            dictionaries.relation_ids), dictionaries.relation_ids)
    return tables, {"entities": dictionaries.entity_counts(),
                    "relations": len(dictionaries.relation_names)}


# --- route and write -------------------------------------------------------------


def _look_up(table: Tuple[np.ndarray, ...], names: Tuple[np.ndarray, np.ndarray, pa.Array],
             what: str) -> Tuple[np.ndarray, ...]:
    """(found, partition, offset) of each of a block's distinct names in a lookup table."""
    keys, checks, part, offset = table
    key, check, strings = names
    at = np.minimum(np.searchsorted(keys, key), max(len(keys) - 1, 0))
    found = keys[at] == key if len(keys) else np.zeros(len(key), bool)
    clash = found & (checks[at] != check)
    if clash.any():
        raise PbgRayError(f"{what}: the name {strings[int(np.argmax(clash))].as_py()!r} shares "
                          "its 64-bit key with another name, a chance of about one in 10^19 "
                          "per pair. Rename one of them.")
    return found, np.where(found, part[at], -1), np.where(found, offset[at], -1)


@ray.remote(scheduling_strategy="SPREAD")
def _route_block(config: ConfigSchema, writers: int, tables: Dict[int, Tuple[np.ndarray, ...]],
                 edges: Dict[str, Any]) -> Tuple[Any, ...]:
    """A block's edges given their buckets: (edges left out per input, dropped and unseen),
    then per writer the edges of its buckets (bucket % writers)."""
    types = EntityTypes.of(config)
    router = BucketRouter(config, types, spill_dtype("weight" in edges))
    looked_up = {t: _look_up(tables[t], names, f"entity type {types.names[t]!r}"
                             if t >= 0 else "relation names")
                 for t, names in edges["names"].items()}
    n = len(edges["input"])
    if config.dynamic_relations:
        found_rel, _, rel_of = looked_up[RELATIONS]
        found, rel = found_rel[edges["rel"]], rel_of[edges["rel"]]
    else:
        found, rel = np.ones(n, bool), edges["rel"]
    sides = {}
    for side in ("lhs", "rhs"):
        of_edge = types.of_edges(side, rel)
        part, offset = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        for t in range(len(types.names)):
            mask = of_edge == t
            hit, parts_of, offsets_of = looked_up[t]
            ids = edges[side][mask]
            part[mask], offset[mask] = parts_of[ids], offsets_of[ids]
            found[mask] &= hit[ids]
        sides[side] = part, offset
    bucket = np.where(found, router.buckets(rel, *sides["lhs"], *sides["rhs"]), UNSEEN)
    num_inputs = len(config.importer.inputs)
    left_out = {kind: np.bincount(edges["input"][bucket == kind], minlength=num_inputs)
                for kind in (DROPPED, UNSEEN)}
    kept = np.flatnonzero(bucket >= 0)
    columns = {"input": edges["input"][kept], "bucket": bucket[kept],
               "lhs": sides["lhs"][1][kept], "rhs": sides["rhs"][1][kept],
               "rel": rel[kept].astype(np.int64)}
    if "weight" in edges:
        columns["weight"] = edges["weight"][kept]
    writer = columns["bucket"] % writers
    return (left_out,) + tuple({k: v[writer == w] for k, v in columns.items()}
                               for w in range(writers))


@ray.remote(scheduling_strategy="SPREAD")
def _write_buckets(config: ConfigSchema, stages: List[StoragePath], writer: int, writers: int,
                   *routed: Dict[str, np.ndarray]) -> List[Tuple[int, int, int, int]]:
    """Every bucket file of one writer (its buckets of every input, empty or not) from
    the blocks' routed edges; returns (input, bucket, edges, previous edges) of each."""
    columns = {k: np.concatenate([r[k] for r in routed]) for k in routed[0]}
    weighted = "weight" in columns
    router = BucketRouter(config, EntityTypes.of(config), spill_dtype(weighted))
    group = columns["input"].astype(np.int64) * router.num_buckets + columns["bucket"]
    # Stable: a bucket keeps the blocks' order; a radix sort below 2^16 groups.
    small = len(config.importer.inputs) * router.num_buckets <= 1 << 16
    order = np.argsort(group.astype(np.uint16) if small else group, kind="stable")
    group = group[order]
    names = ("lhs", "rhs", "rel", "weight") if weighted else ("lhs", "rhs", "rel")
    written = []
    for number in range(len(config.importer.inputs)):
        previous = config.importer.previous_edge_paths[number:number + 1]
        for index in range(writer, router.num_buckets, writers):
            lo, hi = (np.searchsorted(group, number * router.num_buckets + index, side)
                      for side in ("left", "right"))
            mine = order[lo:hi]
            old = router.write_bucket(stages[number], index, {k: columns[k][mine] for k in names},
                                      previous[0] if previous else None)
            written.append((number, index, int(hi - lo), int(old)))
    return written


def ray_phases(config: ConfigSchema, stages: Staging) -> Tuple[List[Dict[str, Any]],
                                                               Dict[str, int], int]:
    """The phases on Ray Data and Ray tasks (see the module doc)."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    tasks = max(1, int(ray.cluster_resources().get("CPU", 1)))  # count tasks, writers
    shards = [{"input": number, "shard": str(shard.path)}
              for number, spec in enumerate(config.importer.inputs)
              for shard in input_shards(spec)]
    parsed = ray.data.from_items(shards, override_num_blocks=len(shards)).map_batches(
        _parse_shards, batch_size=1, fn_kwargs={"config": config}, batch_format="numpy")
    blocks = _reraising(parsed.to_arrow_refs)
    logger.info("import: %d shards read into %d blocks", len(shards), len(blocks))
    indexed = [_index_block.options(num_returns=2 + tasks).remote(config, tasks, block)
               for block in blocks]
    counted = [_count_part.remote(config, *(refs[2 + p] for refs in indexed))
               for p in range(tasks)]
    tables, figures = _build_dictionaries.remote(config, stages.entities, *counted)
    router = BucketRouter(config, EntityTypes.of(config), spill_dtype(False))
    writers = min(tasks, router.num_buckets)
    routed = [_route_block.options(num_returns=1 + writers).remote(config, writers, tables,
                                                                   refs[1])
              for refs in indexed]
    written = [_write_buckets.remote(config, stages.edges, w, writers,
                                     *(refs[1 + w] for refs in routed)) for w in range(writers)]
    written = [row for rows in _reraising(ray.get, written) for row in rows]
    left_out = _reraising(ray.get, [refs[0] for refs in routed])
    shard_stats = [s for table in _reraising(ray.get, [refs[0] for refs in indexed])
                   for s in zip(table["input"].to_pylist(), table["stats"].to_pylist())]
    figures = _reraising(ray.get, figures)
    per_input = []
    for number, (spec, output) in enumerate(zip(config.importer.inputs,
                                                config.edge_paths + config.eval_edge_paths)):
        found = sorted((json.loads(s) for i, s in shard_stats if i == number),
                       key=lambda s: s["path"])
        unseen = sum(int(f[UNSEEN][number]) for f in left_out)
        stats = {"output": str(storage_path(output)), **read_stats(
            spec, [_ShardFigures(s) for s in found], unseen if number else None,
            config.importer.inputs[0])}
        mine = [row for row in written if row[0] == number]
        stats.update(edges=sum(row[2] + row[3] for row in mine),
                     dropped_rare=sum(int(f[DROPPED][number]) for f in left_out))
        if config.importer.previous_edge_paths[number:number + 1]:
            stats["previous_edges"] = sum(row[3] for row in mine)
        per_input.append(stats)
    return per_input, figures["entities"], figures["relations"]


class _ShardFigures:
    """A shard's reading figures as read_stats takes them from a RawTable."""

    def __init__(self, stats: Dict[str, Any]) -> None:
        self.format, self.num_rows = stats["format"], stats["rows"]
        self.bad_rows, self.bad_examples = stats["bad_rows"], stats["bad_examples"]
