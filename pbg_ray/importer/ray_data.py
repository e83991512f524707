"""The importer on Ray Data, and the choice of engine (importer.engine).

The importer's phases (pbg_ray/importer/) as parallel work over the inputs' shards,
committed by the same `run_import` as the local engine:

    read          Ray Data parses every shard in a task (io/raw.py's RawTable, the local
                  reader's relation checks) and gives each name its id in the same task
                  (the local reader's IdReader), from the dictionary shards: a block is
                  one row of at most BLOCK_ROWS edges as ids (lhs, rhs, rel[, weight])
    dictionary    actors, each the NameIndex of every name type for the names whose
    shards        key hashes to it (ids in order of first sighting, first-input counts,
                  the second hash compared at every sighting, the names themselves): one
                  hash table lookup a name, several times cheaper than sorting every
                  block's names (docs/benchmarks-log.md, "Import at 20M names"); a read
                  task run again after its worker died is not counted twice
    dictionaries  a task per entity type (and relation names) places the names by their
                  keys alone (dictionaries.py's cut_places and appended_places, the local
                  engine's seed rule) and returns the place of every id
    names         each dictionary shard groups its kept names by partition; a task per
                  group of partitions writes their entity files (an incremental import's
                  previous names first)
    route         each block's ids given their places (one gather, no name is hashed
                  again), its edges given their bucket by BucketRouter.buckets, as the
                  local engine does, and split by bucket into one part per writer
    write         a task per writer gathers its buckets' edges from every block and
                  writes their files (BucketRouter.write_bucket: the previous import's
                  edges, then the new)

Each exchange is a map task with one return per receiving task: Ray Data's hash shuffle
would start its aggregator actors at every import and carry each edge's names as strings
through it. For the same inputs and seed both engines write the same entity files and the
same edges in every bucket (the order inside a bucket may differ). The driver holds object
references and per-shard and per-bucket figures only; a dictionary shard holds its share of
the names, a task its share of the edges. The tasks and shards are spread over the nodes
(Ray's default would pack tasks this short onto the driver's node). Output directories must
be reachable from every node (object storage, or a shared file system).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.exceptions import ActorDiedError

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, in_chain
from pbg_ray.importer.dictionaries import (
    appended_places, cut_places, previous_types, shuffle_rng)
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.importer.read import RELATIONS, EntityTypes, IdReader, read_stats, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.importer.staging import Staging
from pbg_ray.io.entities import (
    load_entity_names, load_relation_names, save_dynamic_rel_count, save_entity_count,
    save_entity_names, save_relation_names)
from pbg_ray.io.name_keys import mix, name_keys
from pbg_ray.io.raw import RawTable, input_shards
from pbg_ray.io.storage import StoragePath, storage_path
from pbg_ray.runtime.budget import GIB, MemoryBudget, memory_budget
from pbg_ray.runtime.connect import connect_ray, starts_local_ray
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import TASK_RETRIES, worker_died

logger = logging.getLogger("pbg_ray")

UNSEEN = -2  # the place of a later input's names the first never had, and of their edges' bucket
DROPPED = -1  # the place of names dropped as too rare, and of their edges' bucket
PLACE_BITS = 40  # a name's place: partition << PLACE_BITS | offset
OFFSET_MASK = (1 << PLACE_BITS) - 1
BLOCK_ROWS = 1 << 20  # edges of a shard read into one block at most
PART_BYTES = 64 << 20  # blocks' bytes per names writer and bucket writer
CPUS_PER_SHARD = 2  # dictionary shards: one per this many of the cluster's CPUs
SHARD_SHARE = 0.4  # of a local Ray's memory budget, what the dictionary shards may hold
MAX_IDS = 1 << 31  # ids are int32 in the blocks

# Per name type, the place of every id (partition << PLACE_BITS | offset; DROPPED, UNSEEN).
Places = np.ndarray
# A dictionary shard's names of one type, by id: (keys, first-input counts, checks).
Keyed = Tuple[np.ndarray, np.ndarray, np.ndarray]


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
    """The PbgRayError a task raised, found in the exceptions Ray wraps it in: its one
    line (Ray Data appends its retry advice on lines of its own)."""
    found = in_chain(err, PbgRayError)
    return None if found is None else PbgRayError(
        str(getattr(found, "cause", None) or found.args[0]).split("\n")[0])


def _reraising(fn, *args, **kwargs):
    """fn(*args, **kwargs); a PbgRayError raised in a task is raised here as itself."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        user = _user_error(err)
        if user is None:
            raise
        raise user from None


def _what(types: EntityTypes, name_type: int) -> str:
    """A name type for messages."""
    return f"entity type {types.names[name_type]!r}" if name_type >= 0 else "relation names"


def _partitions(config: ConfigSchema, name_type: int) -> int:
    """The partitions of a name type (relation names: one)."""
    if name_type == RELATIONS:
        return 1
    return config.entities[EntityTypes.of(config).names[name_type]].num_partitions


def _slots(config: ConfigSchema) -> Dict[int, int]:
    """The name types in order (relation names first with dynamic_relations), each with
    the first slot of its partitions (slot % writers: its names writer)."""
    types = EntityTypes.of(config)
    slots, at = {}, 0
    relations = [RELATIONS] if config.dynamic_relations else []
    for name_type in relations + list(range(len(types.names))):
        slots[name_type] = at
        at += _partitions(config, name_type)
    return slots


def _shard_of(keys: np.ndarray, shards: int) -> np.ndarray:
    """The dictionary shard of each name key (short names' keys are their bytes: mixed
    first)."""
    return (mix(keys.copy()) % np.uint64(shards)).astype(np.int64)


# --- dictionary shards ---------------------------------------------------------------


class DictionaryShard:
    """One share of an import's dictionaries, as a Ray actor: for every name type, a
    NameIndex of the names whose key hashes to this shard. An id it gives is
    `index id * shards + shard`, unique over the shards."""

    def __init__(self, config: ConfigSchema, shard: int, shards: int,
                 budget: Optional[MemoryBudget] = None) -> None:
        """`budget`: a local Ray's, whose SHARD_SHARE the shards' names may hold (a run
        on a cluster: no bound)."""
        types = EntityTypes.of(config)
        self.shard, self.shards, self.budget = shard, shards, budget
        self.slots = _slots(config)
        self.indexes = {t: NameIndex(_what(types, t)) for t in self.slots}
        self.counted: Set[Tuple[Any, ...]] = set()

    def add(self, name_type: int, call: Tuple[Any, ...], keys: np.ndarray, checks: np.ndarray,
            names: pa.Array, counts: Optional[np.ndarray]) -> np.ndarray:
        """The ids of one read call's names (NameIndex.add_keyed), new names getting new
        ids; counted unless `call` (a read's shard, name type and call number) was counted
        before: its read task runs again after its worker died."""
        fault_point("importer.shard_add")
        if call in self.counted:
            counts = np.zeros(len(keys))
        self.counted.add(call)
        index = self.indexes[name_type]
        ids = index.add_keyed(keys, checks, names, counts)
        self._check_memory()
        if len(index) * self.shards > MAX_IDS:
            raise PbgRayError(f"{index.what}: more than {MAX_IDS:,} names in one import, the "
                              "most the Ray Data engine gives ids to. Import them in parts "
                              "(importer.previous_entity_path).")
        return (ids * self.shards + self.shard).astype(np.int32)

    def _check_memory(self) -> None:
        """Stops the import in one line once the names outgrow the shard's share of the
        budget, where the machine would otherwise thrash at its limit."""
        if self.budget is None:
            return
        held = sum(index.nbytes() for index in self.indexes.values())
        share = SHARD_SHARE * self.budget.bytes / self.shards
        if held > share:
            names = sum(len(index) for index in self.indexes.values())
            raise PbgRayError(
                f"the import's names outgrow its memory: dictionary shard {self.shard} of "
                f"{self.shards} holds {held / GIB:.2f} GiB for {names:,} names, over its "
                f"share ({SHARD_SHARE:.0%} of {self.budget}, over the shards). Give the "
                "import more memory, run it on a cluster (a dictionary shard per "
                f"{CPUS_PER_SHARD} CPUs), or import the inputs in parts "
                "(importer.previous_entity_path).")

    def keyed(self, name_type: int) -> Keyed:
        """A name type's (keys, counts, checks), by index id, once every read is done:
        from then on the shard holds its names only (NameIndex.close)."""
        return self.indexes[name_type].close()

    def name(self, name_type: int, index_id: int) -> str:
        return self.indexes[name_type].names()[index_id].as_py()

    def scatter_names(self, writers: int, *places: Places) -> Any:
        """The kept names with their places, per names writer: for each, a list of (name
        type, partitions, offsets, names). `places`: of each name type, in _slots order.
        The shard's last work: it lets go of its names as it goes."""
        out: List[List[Any]] = [[] for _ in range(writers)]
        for name_type, place_of in zip(self.slots, places):
            for first, names in self.indexes[name_type].drain_names():
                ids = np.arange(first, first + len(names)) * self.shards + self.shard
                place = place_of[ids]
                kept = np.flatnonzero(place >= 0)
                place, kept_names = place[kept], names.take(pa.array(kept))
                part = place >> PLACE_BITS
                writer = (self.slots[name_type] + part) % writers
                order = np.argsort(writer.astype(np.uint16) if writers < 1 << 16 else writer,
                                   kind="stable")  # radix below 2^16 writers
                bounds = np.searchsorted(writer[order], np.arange(writers + 1))
                for w in range(writers):
                    mine = order[bounds[w]:bounds[w + 1]]
                    if len(mine):
                        out[w].append((name_type, part[mine], place[mine] & OFFSET_MASK,
                                       kept_names.take(pa.array(mine))))
        return tuple(out) if writers > 1 else out[0]


class _SharedIndex:
    """A name type's dictionary as a read task's IdReader sees it: NameIndex's add, each
    name sent by its key to its dictionary shard."""

    def __init__(self, shards: List[Any], name_type: int, source: str) -> None:
        self.shards, self.name_type = shards, name_type
        self.calls = (("read", source, name_type, n) for n in itertools.count())

    def add(self, names: pa.Array, counts: Optional[np.ndarray] = None) -> np.ndarray:
        keys, checks = name_keys(names)
        call = next(self.calls)
        if len(self.shards) == 1:  # every name to the one shard: no grouping, no copies
            return _got([self.shards[0].add.remote(self.name_type, call, keys, checks, names,
                                                   counts)])[0]
        shard = _shard_of(keys, len(self.shards))
        order = np.argsort(shard.astype(np.uint16), kind="stable")  # radix
        bounds = np.searchsorted(shard[order], np.arange(len(self.shards) + 1))
        refs, rows = [], []
        for s, handle in enumerate(self.shards):
            mine = order[bounds[s]:bounds[s + 1]]
            if len(mine):
                refs.append(handle.add.remote(
                    self.name_type, call, keys[mine], checks[mine], names.take(pa.array(mine)),
                    None if counts is None else counts[mine]))
                rows.append(mine)
        ids = np.empty(len(keys), np.int32)
        for mine, got in zip(rows, _got(refs)):
            ids[mine] = got
        return ids


def _got(refs: List[Any]) -> List[np.ndarray]:
    """The dictionary shards' answers; a shard whose worker died said in one line here
    (Ray Data's driver may not unpickle Ray's error)."""
    try:
        return ray.get(refs)
    except ActorDiedError as err:
        raise worker_died(err) from None


# --- read ----------------------------------------------------------------------------


def _list(values: Any) -> pa.Array:
    """`values` (numpy) as a one-element list: a value of a block's row."""
    return pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), pa.array(values))


def _rows(blocks: Tuple[pa.Table, ...]) -> Iterator[pa.Table]:
    """Each block (see _block) in Ray Data's blocks, which may hold several."""
    for block in blocks:
        for row in range(block.num_rows):
            yield block.slice(row, 1)


def _values(block: pa.Table, column: str) -> np.ndarray:
    """The values of one of a block's list columns, zero-copy."""
    return next(c for c in block[column].chunks if len(c)).flatten().to_numpy()


def _block(number: int, edges: Dict[str, List[np.ndarray]],
           stats: Optional[Dict[str, Any]]) -> pa.Table:
    """One row: a block's edges as ids, and (its shard's last block) the shard's stats."""
    return pa.table({"input": pa.array([number], pa.int32()),
                     "stats": pa.array([json.dumps(stats) if stats else None], pa.string()),
                     **{k: _list(np.concatenate(v)) for k, v in edges.items()}})


def _read_blocks(items: Dict[str, np.ndarray], config: ConfigSchema, block_rows: int,
                 shards: List[Any]) -> Iterator[pa.Table]:
    """Every shard of `items` parsed (io/raw.py's RawTable, the local reader's relation
    checks), its names given ids by the dictionary shards as they are read, and cut into
    blocks of `block_rows` edges or more (see _block)."""
    check = IdReader(config)
    dynamic, weighted = config.dynamic_relations, config.importer.weight_col is not None
    columns = {"lhs": np.int32, "rhs": np.int32, "rel": np.int32}
    if weighted:
        columns["weight"] = np.float32
    for number, path in zip(items["input"], items["shard"]):
        fault_point("importer.read_shard")
        table = RawTable(path, config.importer)
        reader = IdReader(config, shared=lambda t, _: _SharedIndex(shards, t, str(path)))
        edges, rows = {k: [np.empty(0, t)] for k, t in columns.items()}, 0
        for batch, rel in check.batches(table, learn=False):
            counts = None if number == 0 else np.zeros(len(batch))  # the first input counts
            rel = reader.relation_ids(batch, learn=True, counts=counts) if dynamic else rel
            lhs, rhs = reader.entity_ids(batch, rel, learn=True, counts=counts)
            fault_point("importer.batch_named")
            edges["lhs"].append(lhs.astype(np.int32))
            edges["rhs"].append(rhs.astype(np.int32))
            edges["rel"].append(rel.astype(np.int32))
            if weighted:
                edges["weight"].append(np.asarray(batch.weight, np.float32))
            rows += len(batch)
            if rows >= block_rows:
                yield _block(number, edges, None)
                edges, rows = {k: [np.empty(0, t)] for k, t in columns.items()}, 0
        stats = {"path": str(table.path), "format": table.format, "rows": table.num_rows,
                 "bad_rows": table.bad_rows, "bad_examples": table.bad_examples}
        yield _block(number, edges, stats)  # the shard's last block, of no edges if need be


# --- dictionaries and names ----------------------------------------------------------


def _clash_error(what: str, name: str, other: str) -> PbgRayError:
    return PbgRayError(f"{what}: the names {name!r} and {other!r} have the same 64-bit key, a "
                       "chance of about one in 10^19 per pair. Rename one of them.")


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


def _index_in(keys: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The position of each of `key` in the sorted `keys`, -1 where it is not there. The
    keys are searched in sorted order: consecutive binary searches then share their path
    through the table, which a table of millions of keys would otherwise miss the cache on
    at every step (the sort costs a fifth of what it saves)."""
    if not len(keys):
        return np.full(len(key), -1, np.int64)
    order = np.argsort(key)
    at = np.empty(len(key), np.int64)
    at[order] = np.minimum(np.searchsorted(keys, key[order]), len(keys) - 1)
    return np.where(keys[at] == key, at, -1)


@ray.remote(scheduling_strategy="SPREAD", num_returns=2)
def _dictionary(config: ConfigSchema, name_type: int, previous: bool, shards: List[Any],
                *keyed: Keyed) -> Tuple[Places, int]:
    """One name type's dictionary from every dictionary shard's names (`keyed`, from
    `shards`), as build_dictionaries makes it, by keys alone: (the place of every id, the
    number of names kept). The names of the `previous` import keep their places."""
    key = np.concatenate([k for k, _, _ in keyed]) if keyed else np.zeros(0, np.uint64)
    order = np.argsort(key)  # the canonical order of the names: by key
    key = key[order]
    bounds = np.cumsum([0] + [len(k) for k, _, _ in keyed])
    shard = np.searchsorted(bounds, order, side="right") - 1
    ids = (order - bounds[shard]) * len(keyed) + shard  # of the names in key order
    del shard
    count = np.concatenate([c for _, c, _ in keyed])[order] if keyed else np.zeros(0, np.int64)
    min_count, parts, rng = _type_settings(config, name_type)
    seen, kept = count > 0, count >= min_count  # a later input's names have no count
    del count
    placed = np.where(seen, DROPPED, UNSEEN)
    sizes, found = None, np.zeros(len(key), bool)
    if previous:
        old_key, old_check, old_place, sizes = _previous_keys(config, name_type)
        old = _index_in(old_key, key)
        found = old >= 0
        check = np.concatenate([c for _, _, c in keyed])[order]
        clash = np.flatnonzero(found & (old_check[np.maximum(old, 0)] != check))
        if len(clash):
            i, p = clash[0], int(old_place[old[clash[0]]])
            shard = shards[int(ids[i]) % len(keyed)]
            raise _clash_error(_what(EntityTypes.of(config), name_type),
                               ray.get(shard.name.remote(name_type, int(ids[i]) // len(keyed))),
                               _previous_names(config, name_type, p >> PLACE_BITS)[
                                   p & OFFSET_MASK])
        placed[found] = old_place[old[found]]
        del old, check
    kept &= seen & ~found
    new = int(kept.sum())
    # Places of the kept names in canonical order.
    place, offset = (cut_places(new, parts, rng) if sizes is None else
                     appended_places(sizes, new, rng))
    placed[kept] = (place << PLACE_BITS) | offset
    total = new + (int(sizes.sum()) if previous else 0)
    if name_type == RELATIONS and not total:
        raise PbgRayError(f"no relation type occurs importer.relation_type_min_count="
                          f"{min_count} times in {config.importer.inputs[0]!r}. Lower the "
                          "minimum.")
    places = np.full(len(keyed) * max((len(k) for k, _, _ in keyed), default=0), UNSEEN, np.int64)
    places[ids] = placed
    return places, total


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
                by_offset = np.empty(len(new), np.int64)  # the new names' offsets: each once
                by_offset[offset[new] - len(names)] = new
                names += placed.take(pa.array(by_offset)).to_pylist()
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
                 *places: Places) -> Tuple[List[Any], ...]:
    """_route of each block in a Ray Data block: the list of their figures, then per
    writer the list of their edges for it."""
    places_of = dict(zip(name_types, places))
    routed = [_route(config, writers, places_of, row) for row in _rows((block,))]
    return ([figures for figures, _ in routed],) + tuple(
        [edges[w] for _, edges in routed] for w in range(writers))


def _route(config: ConfigSchema, writers: int, places_of: Dict[int, Places],
           block: pa.Table) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """A block's edges given their buckets: (its figures: input, shard stats, edges left
    out as dropped and as unseen; per writer the edges of its buckets, bucket % writers)."""
    weighted = "weight" in block.column_names
    types = EntityTypes.of(config)
    router = BucketRouter(config, types, spill_dtype(weighted))
    edges = {c: _values(block, c) for c in ("lhs", "rhs", "rel")}
    n = len(edges["rel"])
    rel = (places_of[RELATIONS][edges["rel"]] if config.dynamic_relations
           else edges["rel"].astype(np.int64))
    unseen, sides = rel == UNSEEN, {}
    for side in ("lhs", "rhs"):
        of_edge = types.of_edges(side, rel)
        place = np.empty(n, np.int64)
        for t in range(len(types.names)):
            mask = of_edge == t if len(types.names) > 1 else slice(None)
            place[mask] = places_of[t][edges[side][mask]]
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
    previous = [types.names.index(name) for name in previous_types(config, types)] + (
        [RELATIONS] if config.dynamic_relations and config.importer.previous_entity_path else [])
    tasks = max(1, int(ray.cluster_resources().get("CPU", 1)))
    inputs = [{"input": number, "shard": str(shard.path)}
              for number, spec in enumerate(config.importer.inputs)
              for shard in input_shards(spec)]
    shard_actor = ray.remote(DictionaryShard).options(num_cpus=0, scheduling_strategy="SPREAD")
    count = max(1, tasks // CPUS_PER_SHARD)
    budget = memory_budget(config.ray) if starts_local_ray(config.ray) else None
    shards = [shard_actor.remote(config, s, count, budget) for s in range(count)]
    try:
        return _phases(config, stages, shards, inputs, previous, tasks)
    finally:
        for shard in shards:
            ray.kill(shard)


def _phases(config: ConfigSchema, stages: Staging, shards: List[Any],
            inputs: List[Dict[str, Any]], previous: List[int],
            tasks: int) -> Tuple[List[Dict[str, Any]], Dict[str, int], int]:
    """ray_phases with its dictionary shards started."""
    types = EntityTypes.of(config)
    name_types = list(_slots(config))
    # Ray Data runs a task again without end when its worker dies (killed for memory, as a
    # rule): TASK_RETRIES times here, as pbg_ray's other tasks, and then the import stops.
    # (Ray 2.60 deprecates such remote arguments, with nothing named in their place yet.)
    # A read task waiting on a dictionary shard gives its CPU back to Ray, which would
    # start another read in its place: at most one read per CPU, each holding its shard's
    # batches.
    read = ray.data.from_items(inputs, override_num_blocks=len(inputs)).map_batches(
        _read_blocks, batch_size=1, batch_format="numpy", max_retries=TASK_RETRIES,
        compute=ray.data.TaskPoolStrategy(size=tasks),
        fn_kwargs={"config": config, "block_rows": BLOCK_ROWS, "shards": shards})
    read = _reraising(read.materialize)
    parts = max(tasks, -(-read.size_bytes() // PART_BYTES))
    blocks = read.to_arrow_refs()
    del read
    logger.info("import: %d shards read into %d blocks, names in %d dictionary shards",
                len(inputs), len(blocks), len(shards))
    dictionaries = [_dictionary.remote(config, t, t in previous, shards,
                                       *(shard.keyed.remote(t) for shard in shards))
                    for t in name_types]
    places = [place for place, _ in dictionaries]

    name_writers = min(parts, sum(_partitions(config, t) for t in name_types))
    scattered = [shard.scatter_names.options(num_returns=name_writers).remote(
        name_writers, *places) for shard in shards]
    if name_writers == 1:
        scattered = [[refs] for refs in scattered]
    names_written = [_write_names.remote(config, stages.entities, w, name_writers, previous,
                                         *(refs[w] for refs in scattered))
                     for w in range(name_writers)]

    router = BucketRouter(config, types, spill_dtype(False))
    writers = min(parts, router.num_buckets)
    routed = [_route_block.options(num_returns=1 + writers).remote(
        config, writers, name_types, block, *places) for block in blocks]
    del blocks
    written = [_write_buckets.remote(config, stages.edges, w, writers,
                                     *(refs[1 + w] for refs in routed)) for w in range(writers)]
    # The shards' work ends with their names scattered: their memory goes back while the
    # edges are routed and written.
    every = [ref for refs in scattered for ref in refs]
    ray.wait(every, num_returns=len(every), fetch_local=False)
    for shard in shards:
        ray.kill(shard)
    del scattered, every
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
