"""The importer on Ray Data, and the choice of engine (importer.engine).

The importer's phases (pbg_ray/importer/) as parallel work over the inputs' shards,
committed by the same `run_import` as the local engine:

    read, index   Ray Data parses every shard in a task (io/raw.py's RawTable, the
                  local reader's relation checks) and, in the same task, gives each
                  block's names block ids as they are read (NameIndex, as the local
                  reader gives ids): a block is one row of its edges as block ids
                  (lhs, rhs, rel[, weight]) and its distinct names with their 64-bit
                  keys and first-input counts, those with a count grouped by a hash of
                  the key into one part per count task; raw names never reach the
                  object store
    count         a task per part sums its names' counts over every block: each
                  distinct name reaches one task, never the driver
    dictionaries  one task places the distinct names with build_dictionaries (the
                  local engine's seed rule: canonical order by key, seeded shuffle,
                  contiguous partitions; previous imports grown), writes the entity
                  files and returns lookup tables (name key -> partition and offset)
    route         each block's distinct names looked up by key in those tables once
                  (no name is hashed again after the read), its edges given their
                  bucket by BucketRouter.buckets, as the local engine does, and split
                  by bucket into one part per writer
    write         a task per writer gathers its buckets' edges from every block and
                  writes their files (BucketRouter.write_bucket: the previous import's
                  edges, then the new)

The exchange of routed edges is a map task with one return per writer, and the count
tasks read their part of every block (on several nodes a block travels whole to every
node with a count task): Ray Data's hash shuffle would start its aggregator
actors at every import and carry each edge's names as strings through it
(docs/benchmarks-log.md, "Local and Ray Data engines"). For the same inputs and seed both
engines write the same entity files and the same edges in every bucket (the order inside
a bucket may differ). The driver holds object references and per-shard and per-bucket
figures only. The map, count and write tasks are spread over the nodes (Ray's default
would pack tasks this short onto the driver's node). Output directories must be reachable
from every node (object storage, or a shared file system).
"""

from __future__ import annotations

import collections
import json
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.dictionaries import build_dictionaries, load_previous
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.importer.read import EntityTypes, IdReader, read_stats, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.io.name_keys import mix
from pbg_ray.importer.staging import Staging
from pbg_ray.io.raw import RawTable, input_shards
from pbg_ray.io.storage import StoragePath, storage_path
from pbg_ray.runtime.connect import connect_ray

logger = logging.getLogger("pbg_ray")

UNSEEN = -2  # the bucket of a later input's edges that name what the first never did
DROPPED = -1  # the bucket of edges whose entity or relation was dropped as too rare
PLACE_BITS = 40  # a name's place: partition << PLACE_BITS | offset (see _place)
RELATIONS = -1  # the type index of relation names (dynamic_relations) when counting
BLOCK_ROWS = 1 << 22  # edges of a shard indexed into one block at most


def import_graph(config: ConfigSchema) -> Dict[str, Any]:
    """Import `config.importer.inputs` with the engine importer.engine picks; returns stats."""
    config = config.checked()
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


# --- read and index ------------------------------------------------------------------


def _list(values: Any) -> pa.Array:
    """`values` (numpy or Arrow) as a one-element list: a value of a block's row."""
    values = values if isinstance(values, pa.Array) else pa.array(values)
    return pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)


def _rows(blocks: Tuple[pa.Table, ...]) -> Iterator[pa.Table]:
    """Each indexed block (see _block) in Ray Data's blocks, which may hold several."""
    for block in blocks:
        for row in range(block.num_rows):
            yield block.slice(row, 1)


def _values(block: pa.Table, column: str) -> Any:
    """The values of one of an indexed block's list columns, zero-copy (numpy for
    numbers)."""
    values = next(c for c in block[column].chunks if len(c)).flatten()
    return values if pa.types.is_large_string(values.type) else values.to_numpy()


def _parts_of(keys: np.ndarray, parts: int) -> np.ndarray:
    """The count task of each name key (short names' keys are their bytes: mixed first)."""
    return (mix(keys.copy()) % np.uint64(parts)).astype(np.int64)


def _block(number: int, reader: IdReader, edges: Dict[str, List[np.ndarray]], parts: int,
           stats: Optional[Dict[str, Any]]) -> pa.Table:
    """One row: a block's edges as block ids, its distinct names, those with a count
    grouped by count task, and (its shard's last block) the shard's stats."""
    indexes = ({RELATIONS: reader.relation_index} if reader.config.dynamic_relations else {})
    indexes.update(enumerate(reader.entity_index[t] for t in reader.types.names))
    name_type = np.concatenate([np.full(len(index), t, np.int32) for t, index in indexes.items()])
    key = np.concatenate([index.keys() for index in indexes.values()])
    count = np.concatenate([index.counts for index in indexes.values()])
    counted = np.flatnonzero(count > 0)
    part = _parts_of(key[counted], parts)
    by_part = np.argsort(part, kind="stable")
    columns = {"input": pa.array([number], pa.int32()),
               "stats": pa.array([json.dumps(stats) if stats else None], pa.string()),
               **{k: _list(np.concatenate(v)) for k, v in edges.items()},
               "name_type": _list(name_type), "name_key": _list(key),
               "name_check": _list(np.concatenate([i.checks() for i in indexes.values()])),
               "name": _list(pa.concat_arrays([i.names() for i in indexes.values()])),
               "name_count": _list(count), "counted": _list(counted[by_part]),
               "counted_starts": _list(np.searchsorted(part[by_part], np.arange(parts + 1)))}
    return pa.table(columns)


def _read_blocks(items: Dict[str, np.ndarray], config: ConfigSchema, parts: int,
                 block_rows: int) -> Iterator[pa.Table]:
    """Every shard of `items` parsed (io/raw.py's RawTable, the local reader's relation
    checks) and indexed as it is read (a block from each `block_rows` edges or more, see
    _block): raw names never reach the object store."""
    check = IdReader(config)
    dynamic, weighted = config.dynamic_relations, config.importer.weight_col is not None
    for number, path in zip(items["input"], items["shard"]):
        table = RawTable(path, config.importer)
        reader, edges, rows = None, {}, 0
        for batch, rel in check.batches(table, learn=False):
            if reader is None:
                reader, rows = IdReader(config), 0
                edges = {k: [] for k in ("lhs", "rhs", "rel") + (("weight",) if weighted else ())}
            counts = None if number == 0 else np.zeros(len(batch))  # the first input counts
            rel = reader.relation_ids(batch, learn=True, counts=counts) if dynamic else rel
            lhs, rhs = reader.entity_ids(batch, rel, learn=True, counts=counts)
            edges["lhs"].append(lhs.astype(np.int32))
            edges["rhs"].append(rhs.astype(np.int32))
            edges["rel"].append(rel.astype(np.int32))
            if weighted:
                edges["weight"].append(np.asarray(batch.weight, np.float32))
            rows += len(batch)
            if rows >= block_rows:
                yield _block(number, reader, edges, parts, None)
                reader = None
        stats = {"path": str(table.path), "format": table.format, "rows": table.num_rows,
                 "bad_rows": table.bad_rows, "bad_examples": table.bad_examples}
        if reader is None:  # an empty shard, or its last block full: a block of no edges
            reader = IdReader(config)
            edges = {k: [np.empty(0, np.float32 if k == "weight" else np.int32)]
                     for k in ("lhs", "rhs", "rel") + (("weight",) if weighted else ())}
        yield _block(number, reader, edges, parts, stats)


# --- count and dictionaries ----------------------------------------------------------


@ray.remote(scheduling_strategy="SPREAD")
def _count_part(config: ConfigSchema, part: int, *blocks: pa.Table) -> pa.Table:
    """The distinct names of count task `part`, their counts summed over every block."""
    columns = collections.defaultdict(list)
    for block in _rows(blocks):
        starts = _values(block, "counted_starts")
        mine = _values(block, "counted")[starts[part]:starts[part + 1]]
        for name in ("name_type", "name_key", "name_check", "name_count"):
            columns[name].append(_values(block, name)[mine])
        columns["name"].append(_values(block, "name").take(pa.array(mine)))
    table = pa.table({name: pa.concat_arrays(values) if name == "name"
                      else np.concatenate(values) for name, values in columns.items()})
    types = EntityTypes.of(config)
    out = []
    for t in np.unique(table["name_type"].to_numpy()):
        index = NameIndex(f"entity type {types.names[t]!r}" if t >= 0 else "relation names")
        _add(index, table.filter(pc.equal(table["name_type"], t)))
        out.append(pa.table({"name_type": pa.array(np.full(len(index), t, np.int32)),
                             "name_key": index.keys(), "name_check": index.checks(),
                             "name": index.names(), "name_count": index.counts}))
    return pa.concat_tables(out) if out else table


def _add(index: NameIndex, rows: pa.Table) -> None:
    """Counted names (name_key, name_check, name, name_count) added to a name index."""
    index.add_keyed(rows["name_key"].to_numpy(), rows["name_check"].to_numpy(),
                    rows["name"].combine_chunks(), rows["name_count"].to_numpy())


@ray.remote(num_returns=2)
def _build_dictionaries(config: ConfigSchema, entities: StoragePath,
                        *counted: pa.Table) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The local engine's build_dictionaries over the counted names; writes the entity
    files to `entities` and returns (lookup tables, the figures the driver needs)."""
    reader = IdReader(config)
    previous = load_previous(config, reader)  # seeds the reader: known names come first
    for table in counted:
        types = table["name_type"].to_numpy()
        for t in np.unique(types):
            _add(reader.relation_index if t == RELATIONS
                 else reader.entity_index[reader.types.names[t]],
                 table.filter(pa.array(types == t)))
    dictionaries = build_dictionaries(config, reader, previous)
    dictionaries.write(config, entities)

    def lookup(index: NameIndex, part: np.ndarray, offset: np.ndarray) -> Tuple[np.ndarray, ...]:
        """(keys in order, their checks, their places: see _place)."""
        order = np.argsort(index.keys(), kind="stable")
        place = np.where(part >= 0, (part << PLACE_BITS) | offset, DROPPED)
        return index.keys()[order], index.checks()[order], place[order]

    tables = {t: lookup(reader.entity_index[name], d.part, d.offset)
              for t, name in enumerate(reader.types.names)
              for d in [dictionaries.entities[name]]}
    if config.dynamic_relations:
        ids = dictionaries.relation_ids  # a relation's place is its id
        tables[RELATIONS] = lookup(reader.relation_index, np.where(ids >= 0, 0, -1), ids)
    return tables, {"entities": dictionaries.entity_counts(),
                    "relations": len(dictionaries.relation_names)}


# --- route and write -------------------------------------------------------------


def _look_up(table: Tuple[np.ndarray, ...], names: Tuple[np.ndarray, np.ndarray, pa.Array],
             what: str) -> np.ndarray:
    """The place of each of a block's distinct names in a lookup table: partition <<
    PLACE_BITS | offset (a relation's: its id), DROPPED (too rare) or UNSEEN (not in it)."""
    keys, checks, place = table
    key, check, strings = names
    at = np.minimum(np.searchsorted(keys, key), max(len(keys) - 1, 0))
    found = keys[at] == key if len(keys) else np.zeros(len(key), bool)
    clash = found & (checks[at] != check)
    if clash.any():
        raise PbgRayError(f"{what}: the name {strings[int(np.argmax(clash))].as_py()!r} shares "
                          "its 64-bit key with another name, a chance of about one in 10^19 "
                          "per pair. Rename one of them.")
    return np.where(found, place[at], UNSEEN) if len(keys) else np.full(len(key), UNSEEN)


@ray.remote(scheduling_strategy="SPREAD")
def _route_block(config: ConfigSchema, writers: int, tables: Dict[int, Tuple[np.ndarray, ...]],
                 block: pa.Table) -> Tuple[List[Any], ...]:
    """_route of each indexed block in a Ray Data block: the list of their figures, then
    per writer the list of their edges for it."""
    routed = [_route(config, writers, tables, row) for row in _rows((block,))]
    return ([figures for figures, _ in routed],) + tuple(
        [edges[w] for _, edges in routed] for w in range(writers))


def _route(config: ConfigSchema, writers: int, tables: Dict[int, Tuple[np.ndarray, ...]],
           block: pa.Table) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """An indexed block's edges given their buckets: (its figures: input, shard stats,
    edges left out as dropped and as unseen; per writer the edges of its buckets, bucket
    % writers)."""
    weighted = "weight" in block.column_names
    types = EntityTypes.of(config)
    router = BucketRouter(config, types, spill_dtype(weighted))
    name_type = _values(block, "name_type")
    names = [_values(block, c) for c in ("name_key", "name_check", "name")]
    looked_up = collections.defaultdict(lambda: np.zeros(0, np.int64))  # no names: no edges
    for t in np.unique(name_type):
        lo, hi = np.searchsorted(name_type, [t, t + 1])
        looked_up[t] = _look_up(tables[t], [n[lo:hi] for n in names],
                                f"entity type {types.names[t]!r}" if t >= 0 else "relation names")
    edges = {c: _values(block, c) for c in ("lhs", "rhs", "rel")}
    n = len(edges["rel"])
    rel = (looked_up[RELATIONS][edges["rel"]] if config.dynamic_relations
           else edges["rel"].astype(np.int64))
    unseen, sides = rel == UNSEEN, {}
    for side in ("lhs", "rhs"):
        of_edge = types.of_edges(side, rel)
        place = np.empty(n, np.int64)
        for t in range(len(types.names)):
            mask = of_edge == t if len(types.names) > 1 else slice(None)
            place[mask] = looked_up[t][edges[side][mask]]
        unseen |= place == UNSEEN
        sides[side] = (np.where(place >= 0, place >> PLACE_BITS, DROPPED),
                       place & ((1 << PLACE_BITS) - 1))
    bucket = np.where(unseen, UNSEEN, router.buckets(rel, *sides["lhs"], *sides["rhs"]))
    number = int(block["input"][0].as_py())
    figures = {"input": number, "stats": block["stats"][0].as_py(),
               "dropped": int((bucket == DROPPED).sum()), "unseen": int((bucket == UNSEEN).sum())}
    # Grouped by writer (the edges left out last) with one stable radix sort: a gather
    # per column, not a mask per column and writer.
    writer = np.where(bucket >= 0, bucket % writers, writers)
    order = np.argsort(writer.astype(np.uint16) if writers < 1 << 16 else writer, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(writer, minlength=writers + 1))])
    order = order[:bounds[writers]]
    columns = {"bucket": bucket[order], "lhs": sides["lhs"][1][order],
               "rhs": sides["rhs"][1][order], "rel": rel[order]}
    if weighted:
        columns["weight"] = _values(block, "weight")[order]
    return figures, [{"input": number, **{k: v[bounds[w]:bounds[w + 1]] for k, v in columns.items()}}
                     for w in range(writers)]


@ray.remote(scheduling_strategy="SPREAD")
def _write_buckets(config: ConfigSchema, stages: List[StoragePath], writer: int, writers: int,
                   *blocks: List[Dict[str, Any]]) -> List[Tuple[int, int, int, int]]:
    """Every bucket file of one writer (its buckets of every input, empty or not) from
    the blocks' routed edges; returns (input, bucket, edges, previous edges) of each."""
    routed = [edges for block in blocks for edges in block]
    columns = {k: np.concatenate([r[k] for r in routed]) for k in routed[0] if k != "input"}
    weighted = "weight" in columns
    router = BucketRouter(config, EntityTypes.of(config), spill_dtype(weighted))
    number = np.concatenate([np.full(len(r["bucket"]), r["input"], np.int64) for r in routed])
    group = number * router.num_buckets + columns["bucket"]
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
    # Reserved per operator, the read's share of a small cluster would let one shard be
    # parsed at a time until Ray Data's budget catches up: one operator, no reservation.
    context.op_resource_reservation_enabled = False
    tasks = max(1, int(ray.cluster_resources().get("CPU", 1)))  # count tasks, writers
    shards = [{"input": number, "shard": str(shard.path)}
              for number, spec in enumerate(config.importer.inputs)
              for shard in input_shards(spec)]
    blocks = ray.data.from_items(shards, override_num_blocks=len(shards)).map_batches(
        _read_blocks, batch_size=1, batch_format="numpy",
        fn_kwargs={"config": config, "parts": tasks, "block_rows": BLOCK_ROWS})
    blocks = _reraising(blocks.to_arrow_refs)
    logger.info("import: %d shards read into %d blocks", len(shards), len(blocks))
    counted = [_count_part.remote(config, p, *blocks) for p in range(tasks)]
    tables, figures = _build_dictionaries.remote(config, stages.entities, *counted)
    router = BucketRouter(config, EntityTypes.of(config), spill_dtype(False))
    writers = min(tasks, router.num_buckets)
    routed = [_route_block.options(num_returns=1 + writers).remote(config, writers, tables, block)
              for block in blocks]
    written = [_write_buckets.remote(config, stages.edges, w, writers,
                                     *(refs[1 + w] for refs in routed)) for w in range(writers)]
    written = [row for rows in _reraising(ray.get, written) for row in rows]
    read = [f for block in _reraising(ray.get, [refs[0] for refs in routed]) for f in block]
    figures = _reraising(ray.get, figures)
    per_input = []
    for number, (spec, output) in enumerate(zip(config.importer.inputs,
                                                config.edge_paths + config.eval_edge_paths)):
        mine = [f for f in read if f["input"] == number]
        found = sorted((json.loads(f["stats"]) for f in mine if f["stats"]),
                       key=lambda s: s["path"])
        unseen = sum(f["unseen"] for f in mine)
        stats = {"output": str(storage_path(output)), **read_stats(
            spec, [_ShardFigures(s) for s in found], unseen if number else None,
            config.importer.inputs[0])}
        rows = [row for row in written if row[0] == number]
        stats.update(edges=sum(row[2] + row[3] for row in rows),
                     dropped_rare=sum(f["dropped"] for f in mine))
        if config.importer.previous_edge_paths[number:number + 1]:
            stats["previous_edges"] = sum(row[3] for row in rows)
        per_input.append(stats)
    return per_input, figures["entities"], figures["relations"]


class _ShardFigures:
    """A shard's reading figures as read_stats takes them from a RawTable."""

    def __init__(self, stats: Dict[str, Any]) -> None:
        self.format, self.num_rows = stats["format"], stats["rows"]
        self.bad_rows, self.bad_examples = stats["bad_rows"], stats["bad_examples"]
