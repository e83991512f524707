"""The importer on Ray Data, and the choice of engine (importer.engine).

The importer's phases (pbg_ray/importer/) as parallel work over the inputs' shards,
committed by the same `run_import` as the local engine, each task's memory bounded by
its share of the inputs (PART_BYTES of indexed blocks), not by the graph's names:

    read, index   Ray Data parses every shard in a task (io/raw.py's RawTable, the
                  local reader's relation checks) and, in the same task, gives each
                  block's names block ids as they are read (NameIndex, as the local
                  reader gives ids): a block is one row of its edges as block ids
                  (lhs, rhs, rel[, weight]) and its distinct names with their 64-bit
                  keys and first-input counts; raw names never reach the object store
    split         a task per Ray Data block: its edges with their names' keys (for
                  routing), and its names grouped by a hash of the key into one part
                  per count task
    count         a task per part sums its names' counts over every block and stops
                  the import where two names share a key: each distinct name reaches
                  one task, never the driver
    dictionaries  a task per entity type (and relation names) places the names by
                  their keys alone (8 bytes a name; dictionaries.py's cut_places and
                  appended_places, the local engine's seed rule) and returns a lookup
                  table (name key -> partition and offset)
    names         a task per part finds its names' places and groups them by
                  partition; a task per group of partitions writes their entity files
                  (an incremental import's previous names first)
    route         each block's names looked up by key (no name is hashed again after
                  the read), its edges given their bucket by BucketRouter.buckets, as
                  the local engine does, and split by bucket into one part per writer
    write         a task per writer gathers its buckets' edges from every block and
                  writes their files (BucketRouter.write_bucket: the previous import's
                  edges, then the new)

Each exchange is a map task with one return per receiving task: Ray Data's hash
shuffle would start its aggregator actors at every import and carry each edge's names
as strings through it (docs/benchmarks-log.md, "Local and Ray Data engines"). For the
same inputs and seed both engines write the same entity files and the same edges in
every bucket (the order inside a bucket may differ). The driver holds object references
and per-shard and per-bucket figures only. The tasks are spread over the nodes (Ray's
default would pack tasks this short onto the driver's node). Output directories must be
reachable from every node (object storage, or a shared file system).
"""

from __future__ import annotations

import collections
import json
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import ray
import ray.data

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, in_chain
from pbg_ray.importer.dictionaries import (
    appended_places, cut_places, previous_types, shuffle_rng)
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.read import EntityTypes, IdReader, read_stats, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.importer.staging import Staging
from pbg_ray.io.entities import (
    load_entity_names, load_relation_names, save_dynamic_rel_count, save_entity_count,
    save_entity_names, save_relation_names)
from pbg_ray.io.name_keys import mix, name_keys
from pbg_ray.io.raw import RawTable, input_shards
from pbg_ray.io.storage import StoragePath, storage_path
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import TASK_RETRIES

logger = logging.getLogger("pbg_ray")

UNSEEN = -2  # the bucket of a later input's edges that name what the first never did
DROPPED = -1  # the bucket of edges whose entity or relation was dropped as too rare
PLACE_BITS = 40  # a name's place: partition << PLACE_BITS | offset
OFFSET_MASK = (1 << PLACE_BITS) - 1
RELATIONS = -1  # the name type of relation names (dynamic_relations); entity types: 0, 1, ...
BLOCK_ROWS = 1 << 20  # edges of a shard indexed into one block at most
PART_BYTES = 64 << 20  # indexed blocks' bytes per count task, names writer and bucket writer
NAME_COLUMNS = ("name_type", "name_key", "name_check", "name_count", "name")

# Lookup tables (dictionary task -> names and route tasks): per name type, its names'
# keys sorted and the place of each (partition << PLACE_BITS | offset; DROPPED: too rare).
Lookup = Tuple[np.ndarray, np.ndarray]
# A count task's names: per name type, (keys sorted, first-input counts, checks).
Counted = Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]]


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
    found = in_chain(err, PbgRayError)
    return None if found is None else PbgRayError(
        str(getattr(found, "cause", None) or found.args[0]))


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


def _what(types: EntityTypes, name_type: int) -> str:
    """A name type for messages."""
    return f"entity type {types.names[name_type]!r}" if name_type >= 0 else "relation names"


def _block(number: int, reader: IdReader, edges: Dict[str, List[np.ndarray]],
           stats: Optional[Dict[str, Any]]) -> pa.Table:
    """One row: a block's edges as block ids, its distinct names (relation names, then
    each entity type's, in block id order) with their first-input counts (0: a later
    input's name), and (its shard's last block) the shard's stats."""
    indexes = ({RELATIONS: reader.relation_index} if reader.config.dynamic_relations else {})
    indexes.update(enumerate(reader.entity_index[t] for t in reader.types.names))
    columns = {"input": pa.array([number], pa.int32()),
               "stats": pa.array([json.dumps(stats) if stats else None], pa.string()),
               **{k: _list(np.concatenate(v)) for k, v in edges.items()},
               "name_type": _list(np.concatenate([np.full(len(index), t, np.int32)
                                                  for t, index in indexes.items()])),
               "name_key": _list(np.concatenate([i.keys() for i in indexes.values()])),
               "name_check": _list(np.concatenate([i.checks() for i in indexes.values()])),
               "name": _list(pa.concat_arrays([i.names() for i in indexes.values()])),
               "name_count": _list(np.concatenate([i.counts for i in indexes.values()]))}
    return pa.table(columns)


def _read_blocks(items: Dict[str, np.ndarray], config: ConfigSchema,
                 block_rows: int) -> Iterator[pa.Table]:
    """Every shard of `items` parsed (io/raw.py's RawTable, the local reader's relation
    checks) and indexed as it is read (a block from each `block_rows` edges or more, see
    _block): raw names never reach the object store."""
    check = IdReader(config)
    dynamic, weighted = config.dynamic_relations, config.importer.weight_col is not None
    for number, path in zip(items["input"], items["shard"]):
        fault_point("importer.read_shard")
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
                yield _block(number, reader, edges, None)
                reader = None
        stats = {"path": str(table.path), "format": table.format, "rows": table.num_rows,
                 "bad_rows": table.bad_rows, "bad_examples": table.bad_examples}
        if reader is None:  # an empty shard, or its last block full: a block of no edges
            reader = IdReader(config)
            edges = {k: [np.empty(0, np.float32 if k == "weight" else np.int32)]
                     for k in ("lhs", "rhs", "rel") + (("weight",) if weighted else ())}
        yield _block(number, reader, edges, stats)


# --- split and count -----------------------------------------------------------------


def _parts_of(keys: np.ndarray, parts: int) -> np.ndarray:
    """The count task of each name key (short names' keys are their bytes: mixed first)."""
    return (mix(keys.copy()) % np.uint64(parts)).astype(np.int64)


@ray.remote(scheduling_strategy="SPREAD")
def _split_block(parts: int, block: pa.Table) -> Tuple[pa.Table, ...]:
    """A Ray Data block of indexed blocks apart: their edges with their names' types and
    keys (for routing), then per count task the names it counts (NAME_COLUMNS)."""
    rows = list(_rows((block,)))
    edges = pa.concat_tables([row.drop_columns(["name_check", "name", "name_count"])
                              for row in rows])
    names = pa.concat_tables([pa.table({c: _values(row, c) for c in NAME_COLUMNS})
                              for row in rows])
    part = _parts_of(names["name_key"].to_numpy(), parts)
    order = np.argsort(part.astype(np.uint16) if parts < 1 << 16 else part, kind="stable")  # radix
    starts = np.searchsorted(part[order], np.arange(parts + 1))
    return (edges,) + tuple(names.take(pa.array(order[starts[p]:starts[p + 1]]))
                            for p in range(parts))


@ray.remote(scheduling_strategy="SPREAD", num_returns=2)
def _count_part(config: ConfigSchema, *pieces: pa.Table) -> Tuple[Counted, Dict[int, pa.Array]]:
    """The distinct names of one count task, their first-input counts summed over every
    block: per name type (keys sorted, counts, checks), then their names in that order.
    Two names sharing a key stop the import."""
    table = pa.concat_tables(pieces)
    name_type, key, check = (table[c].to_numpy() for c in ("name_type", "name_key", "name_check"))
    order = np.lexsort((key, name_type))
    name_type, key, check = name_type[order], key[order], check[order]
    first = np.ones(len(key), bool)
    first[1:] = (name_type[1:] != name_type[:-1]) | (key[1:] != key[:-1])
    clash = np.flatnonzero(~first[1:] & (check[1:] != check[:-1]))
    if len(clash):
        a, b = table["name"].take(pa.array(order[clash[0]:clash[0] + 2])).to_pylist()
        raise _clash_error(_what(EntityTypes.of(config), int(name_type[clash[0]])), a, b)
    starts = np.flatnonzero(first)
    counts = (np.add.reduceat(table["name_count"].to_numpy()[order], starts).astype(np.int64)
              if len(starts) else np.zeros(0, np.int64))
    name_type = name_type[starts]
    counted, names = {}, {}
    for t in np.unique(name_type):
        lo, hi = np.searchsorted(name_type, [t, t + 1])
        mine = starts[lo:hi]
        counted[int(t)] = (key[mine], counts[lo:hi], check[mine])
        names[int(t)] = table["name"].take(pa.array(order[mine])).combine_chunks()
    return counted, names


def _clash_error(what: str, name: str, other: str) -> PbgRayError:
    return PbgRayError(f"{what}: the names {name!r} and {other!r} have the same 64-bit key, a "
                       "chance of about one in 10^19 per pair. Rename one of them.")


# --- dictionaries and names ----------------------------------------------------------


def _partitions(config: ConfigSchema, name_type: int) -> int:
    """The partitions of a name type (relation names: one)."""
    if name_type == RELATIONS:
        return 1
    return config.entities[EntityTypes.of(config).names[name_type]].num_partitions


def _type_settings(config: ConfigSchema, name_type: int) -> Tuple[int, int, np.random.Generator]:
    """(min count, partitions, shuffle generator) of a name type, as build_dictionaries."""
    settings = config.importer
    if name_type == RELATIONS:
        return settings.relation_type_min_count, 1, shuffle_rng(settings.seed, "relations")
    name = EntityTypes.of(config).names[name_type]
    return (settings.entity_min_count, _partitions(config, name_type),
            shuffle_rng(settings.seed, f"entity {name}"))


def _previous_names(config: ConfigSchema, name_type: int, part: int) -> List[str]:
    """The previous import's names of a name type's partition."""
    path = config.importer.previous_entity_path
    if name_type == RELATIONS:
        return load_relation_names(path)
    return load_entity_names(path, EntityTypes.of(config).names[name_type], part)


def _previous_keys(config: ConfigSchema, name_type: int) -> Tuple[np.ndarray, ...]:
    """(keys sorted, their checks, their places, the number of names of each partition) of
    the previous import's names of a name type; a name listed twice, or two sharing a key, stop the
    import."""
    parts = _partitions(config, name_type)
    keys, checks, places, sizes = [], [], [], []
    for part in range(parts):
        key, check = name_keys(pa.array(_previous_names(config, name_type, part), pa.string()))
        keys.append(key)
        checks.append(check)
        places.append((part << PLACE_BITS) | np.arange(len(key), dtype=np.int64))
        sizes.append(len(key))
    key, check, place = (np.concatenate(a) for a in (keys, checks, places))
    order = np.argsort(key, kind="stable")
    key, check, place = key[order], check[order], place[order]
    twice = np.flatnonzero(key[1:] == key[:-1])
    if len(twice):
        i = twice[0]
        a, b = (_previous_names(config, name_type, int(p >> PLACE_BITS))[
            int(p & OFFSET_MASK)] for p in place[i:i + 2])
        what = _what(EntityTypes.of(config), name_type)
        if check[i] != check[i + 1]:
            raise _clash_error(what, a, b)
        path = config.importer.previous_entity_path
        raise PbgRayError(f"importer.previous_entity_path {path!r}: "
                          f"{what} lists a name twice ({a!r}), so its ids are ambiguous. Fix "
                          "the previous import's entity files.")
    return key, check, place, np.array(sizes, np.int64)


def _look_up(lookup: Lookup, key: np.ndarray) -> np.ndarray:
    """The place of each key in a lookup table, UNSEEN where it has none. The keys are
    searched in sorted order: consecutive binary searches then share their path through
    the table, which a table of millions of keys would otherwise miss the cache on at
    every step (the sort costs a fifth of what it saves)."""
    keys, place = lookup
    if not len(keys):
        return np.full(len(key), UNSEEN, np.int64)
    order = np.argsort(key)
    at = np.empty(len(key), np.int64)
    at[order] = np.minimum(np.searchsorted(keys, key[order]), len(keys) - 1)
    return np.where(keys[at] == key, place[at], UNSEEN)


@ray.remote(scheduling_strategy="SPREAD", num_returns=2)
def _dictionary(config: ConfigSchema, name_type: int, previous: bool, names: List[Any],
                *counted: Counted) -> Tuple[Lookup, int]:
    """One name type's dictionary from every count task's names, as build_dictionaries
    makes it, by keys alone: (the lookup table of every name the first input or the
    `previous` import has, the number of names kept). `names`: the count tasks' name
    refs, read for a message only."""
    mine = [c[name_type] for c in counted if name_type in c]
    key = np.concatenate([m[0] for m in mine]) if mine else np.zeros(0, np.uint64)
    order = np.argsort(key)  # the count tasks' keys are apart: one sorted whole
    key = key[order]
    count = np.concatenate([m[1] for m in mine])[order] if mine else np.zeros(0, np.int64)
    min_count, parts, rng = _type_settings(config, name_type)
    seen, kept = count > 0, count >= min_count  # a later input's names have no count
    del count
    sizes = None
    if previous:
        old_key, old_check, old_place, sizes = _previous_keys(config, name_type)
        old = _look_up((old_key, np.arange(len(old_key))), key)
        check = np.concatenate([m[2] for m in mine])[order] if mine else np.zeros(0, np.uint64)
        clash = np.flatnonzero((old >= 0) & (old_check[np.maximum(old, 0)] != check)
                               if len(old_key) else [])
        if len(clash):
            i, at = clash[0], old[clash[0]]
            p = int(old_place[at])
            raise _clash_error(_what(EntityTypes.of(config), name_type),
                               _name_of(names, counted, name_type, key[i]),
                               _previous_names(config, name_type, p >> PLACE_BITS)[
                                   p & OFFSET_MASK])
        seen &= old < 0
        del old, check
    del order
    kept &= seen
    new = int(kept.sum())
    # Places of the kept names in canonical order (by key: their order in `key`).
    place, offset = (cut_places(new, parts, rng) if sizes is None else
                     appended_places(sizes, new, rng))
    place <<= PLACE_BITS
    place |= offset
    del offset
    lookup_key = key if seen.all() else key[seen]
    lookup_place = np.full(len(lookup_key), DROPPED, np.int64)
    lookup_place[kept[seen]] = place
    total = new + (len(old_key) if previous else 0)
    if name_type == RELATIONS and not total:
        raise PbgRayError(f"no relation type occurs importer.relation_type_min_count="
                          f"{min_count} times in {config.importer.inputs[0]!r}. Lower the "
                          "minimum.")
    if previous:  # merged: the new names are none of the old
        at = np.searchsorted(old_key, lookup_key)
        lookup_key, lookup_place = (np.insert(old_key, at, lookup_key),
                                    np.insert(old_place, at, lookup_place))
    return (lookup_key, lookup_place), total


def _name_of(names: List[Any], counted: Tuple[Counted, ...], name_type: int, key: int) -> str:
    """The name of a key among the count tasks' names (`names`: their refs)."""
    for ref, part in zip(names, counted):
        at = np.flatnonzero(part[name_type][0] == key) if name_type in part else []
        if len(at):
            return ray.get(ref)[name_type][int(at[0])].as_py()
    raise KeyError(key)


def _slots(config: ConfigSchema) -> Dict[int, int]:
    """The first slot of each name type's partitions (slot % writers: its names writer)."""
    types = EntityTypes.of(config)
    slots, at = {}, 0
    relations = [RELATIONS] if config.dynamic_relations else []
    for name_type in relations + list(range(len(types.names))):
        slots[name_type] = at
        at += _partitions(config, name_type)
    return slots


@ray.remote(scheduling_strategy="SPREAD")
def _scatter_names(writers: int, slots: Dict[int, int], counted: Counted,
                   names: Dict[int, pa.Array], *lookups: Lookup) -> Any:
    """A count task's kept names with their places, per names writer: for each, a list of
    (name type, partitions, offsets, names)."""
    out: List[List[Any]] = [[] for _ in range(writers)]
    for name_type, lookup in zip(slots, lookups):
        if name_type not in counted:
            continue
        place = _look_up(lookup, counted[name_type][0])
        kept = np.flatnonzero(place >= 0)
        place, kept_names = place[kept], names[name_type].take(pa.array(kept))
        part = place >> PLACE_BITS
        writer = (slots[name_type] + part) % writers
        order = np.argsort(writer, kind="stable")
        bounds = np.searchsorted(writer[order], np.arange(writers + 1))
        for w in range(writers):
            mine = order[bounds[w]:bounds[w + 1]]
            if len(mine):
                out[w].append((name_type, part[mine], place[mine] & OFFSET_MASK,
                               kept_names.take(pa.array(mine))))
    return tuple(out) if writers > 1 else out[0]


@ray.remote(scheduling_strategy="SPREAD")
def _write_names(config: ConfigSchema, directory: StoragePath, writer: int, writers: int,
                 previous: List[int], *scattered: List[Any]) -> None:
    """The entity files (with dynamic_relations, the relation files) of the partitions
    of names writer `writer`: for the `previous` name types the previous import's names
    first, then those placed there, by offset; writer 0 also writes the empty files of
    entity types no relation uses."""
    types = EntityTypes.of(config)
    found = collections.defaultdict(list)
    for pieces in scattered:
        for name_type, part, offset, names in pieces:
            for p in np.unique(part):
                mine = np.flatnonzero(part == p)
                found[name_type, int(p)].append((offset[mine], names.take(pa.array(mine))))
    slots = _slots(config)
    for name_type, first in slots.items():
        for p in range(_partitions(config, name_type)):
            if (first + p) % writers != writer:
                continue
            names = _previous_names(config, name_type, p) if name_type in previous else []
            pieces = found.pop((name_type, p), [])
            if pieces:  # the previous names found again in the inputs are in `names`
                offset = np.concatenate([o for o, _ in pieces])
                placed = pa.concat_arrays([n for _, n in pieces])
                new = np.flatnonzero(offset >= len(names))
                names += placed.take(pa.array(new[np.argsort(offset[new])])).to_pylist()
            if name_type == RELATIONS:
                save_relation_names(directory, names)
                save_dynamic_rel_count(directory, len(names))
            else:
                save_entity_names(directory, types.names[name_type], p, names)
                save_entity_count(directory, types.names[name_type], p, len(names))
    if writer == 0:
        for name, entity in config.entities.items():
            if name not in types.names:
                for p in range(entity.num_partitions):
                    save_entity_names(directory, name, p, [])
                    save_entity_count(directory, name, p, 0)


# --- route and write -------------------------------------------------------------


@ray.remote(scheduling_strategy="SPREAD")
def _route_block(config: ConfigSchema, writers: int, name_types: List[int], block: pa.Table,
                 *lookups: Lookup) -> Tuple[List[Any], ...]:
    """_route of each indexed block in a split block: the list of their figures, then per
    writer the list of their edges for it."""
    tables = dict(zip(name_types, lookups))
    routed = [_route(config, writers, tables, row) for row in _rows((block,))]
    return ([figures for figures, _ in routed],) + tuple(
        [edges[w] for _, edges in routed] for w in range(writers))


def _route(config: ConfigSchema, writers: int, tables: Dict[int, Lookup],
           block: pa.Table) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """An indexed block's edges given their buckets: (its figures: input, shard stats,
    edges left out as dropped and as unseen; per writer the edges of its buckets, bucket
    % writers)."""
    weighted = "weight" in block.column_names
    types = EntityTypes.of(config)
    router = BucketRouter(config, types, spill_dtype(weighted))
    name_type, name_key = _values(block, "name_type"), _values(block, "name_key")
    looked_up = collections.defaultdict(lambda: np.zeros(0, np.int64))  # no names: no edges
    for t in np.unique(name_type):
        lo, hi = np.searchsorted(name_type, [t, t + 1])
        looked_up[t] = _look_up(tables[t], name_key[lo:hi])
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
                       place & OFFSET_MASK)
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
    for name, values in columns.items():  # half the bytes to exchange where they fit
        if not len(values) or values.max() < 1 << 31:
            columns[name] = values.astype(np.int32)
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
    types = EntityTypes.of(config)
    name_types = list(_slots(config))
    previous = [types.names.index(name) for name in previous_types(config, types)] + (
        [RELATIONS] if config.dynamic_relations and config.importer.previous_entity_path else [])
    tasks = max(1, int(ray.cluster_resources().get("CPU", 1)))
    shards = [{"input": number, "shard": str(shard.path)}
              for number, spec in enumerate(config.importer.inputs)
              for shard in input_shards(spec)]
    # Ray Data runs a task again without end when its worker dies (killed for memory, as a
    # rule): TASK_RETRIES times here, as pbg_ray's other tasks, and then the import stops.
    # (Ray 2.60 deprecates such remote arguments, with nothing named in their place yet.)
    read = ray.data.from_items(shards, override_num_blocks=len(shards)).map_batches(
        _read_blocks, batch_size=1, batch_format="numpy", max_retries=TASK_RETRIES,
        fn_kwargs={"config": config, "block_rows": BLOCK_ROWS})
    read = _reraising(read.materialize)
    parts = max(tasks, -(-read.size_bytes() // PART_BYTES))
    blocks = read.to_arrow_refs()
    del read
    logger.info("import: %d shards read into %d blocks, counted in %d parts", len(shards),
                len(blocks), parts)
    split = [_split_block.options(num_returns=1 + parts).remote(parts, block) for block in blocks]
    del blocks
    counted = [_count_part.remote(config, *(refs[1 + p] for refs in split)) for p in range(parts)]
    routable = [refs[0] for refs in split]
    del split
    dictionaries = [_dictionary.remote(config, t, t in previous, [names for _, names in counted],
                                       *(keys for keys, _ in counted)) for t in name_types]
    lookups = [lookup for lookup, _ in dictionaries]

    slots = _slots(config)
    name_writers = min(parts, sum(_partitions(config, t) for t in name_types))
    scattered = [_scatter_names.options(num_returns=name_writers).remote(
        name_writers, slots, keys, names, *lookups) for keys, names in counted]
    if name_writers == 1:
        scattered = [[refs] for refs in scattered]
    names_written = [_write_names.remote(config, stages.entities, w, name_writers, previous,
                                         *(refs[w] for refs in scattered))
                     for w in range(name_writers)]
    del counted, scattered

    router = BucketRouter(config, types, spill_dtype(False))
    writers = min(parts, router.num_buckets)
    routed = [_route_block.options(num_returns=1 + writers).remote(
        config, writers, name_types, block, *lookups) for block in routable]
    del routable
    written = [_write_buckets.remote(config, stages.edges, w, writers,
                                     *(refs[1 + w] for refs in routed)) for w in range(writers)]
    written = [row for rows in _reraising(ray.get, written) for row in rows]
    read = [f for block in _reraising(ray.get, [refs[0] for refs in routed]) for f in block]
    _reraising(ray.get, names_written)
    kept = dict(zip(name_types, _reraising(ray.get, [total for _, total in dictionaries])))
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
    return (per_input, {name: kept[t] for t, name in enumerate(types.names)},
            kept[RELATIONS] if config.dynamic_relations else len(config.relations))


class _ShardFigures:
    """A shard's reading figures as read_stats takes them from a RawTable."""

    def __init__(self, stats: Dict[str, Any]) -> None:
        self.format, self.num_rows = stats["format"], stats["rows"]
        self.bad_rows, self.bad_examples = stats["bad_rows"], stats["bad_examples"]
