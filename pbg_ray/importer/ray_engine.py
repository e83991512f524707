"""The importer on Ray tasks and actors, and the choice of engine (importer.engine).

The importer's phases (pbg_ray/importer/) as parallel work over the inputs' shards,
committed by the same `run_import` as the local engine, within the memory plan that
importer/plan.py makes before Ray starts (reads at once, dictionary shards and what their
names may hold, the object store):

    read          a task per shard, at most ImportPlan.reads at once, parses it (io/raw.py's
                  RawTable, the local reader's relation checks) and gives each name its id
                  in the same task (the local reader's IdReader), from the dictionary
                  shards, one batch behind: a batch's names are sent before the ids of
                  the batch before are gathered, so that the shards name them while the
                  read parses (a read and a shard take turns otherwise); it yields
                  IdBlocks of whole batches of at most BLOCK_ROWS edges as ids, then its
                  ShardRead (figures, edges left unresolved)
    dictionary    actors, each the NameIndex of every name type for the names whose
    shards        key hashes to it (ids in order of first sighting, first-input counts,
                  the second hash compared at every sighting, the names themselves): one
                  hash table lookup a name, several times cheaper than sorting every
                  block's names (docs/benchmarks-log.md, "Import at 20M names"); a read
                  task run again after its worker died is not counted twice. A shard whose
                  names reach their plan takes no new names for the rest of the pass (their
                  edges stay unresolved: id -1) and spills its names to disk at its end;
                  another pass reads the shards with unresolved edges again, sending only
                  those names, which get the ids after the spilled ones
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

Each exchange is a map task with one return per receiving task. Ray Data is not used: its
executor's actors (a stats actor and an autoscaling coordinator, each a worker of its own)
and the driver's share of it held about 0.4 GiB of a 1.5 GiB limit (docs/sizing.md), and
the read needs its own pass structure. For the same inputs and seed both engines write the
same entity files and the same edges in every bucket (the order inside a bucket may differ).
The driver holds object references and per-shard and per-bucket figures only; a
dictionary shard holds its share of the names, a task its share of the edges. The tasks
and shards are spread over the nodes (Ray's default would pack tasks this short onto the
driver's node). Output directories must be reachable from every node (object storage, or
a shared file system); names spill only on a local Ray (one machine).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import ActorDiedError

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, in_chain
from pbg_ray.importer.dictionaries import (
    appended_places, cut_places, previous_types, shuffle_rng)
from pbg_ray.importer.graph_import import local_phases, run_import
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.importer.plan import ImportPlan, import_plan
from pbg_ray.importer.read import RELATIONS, EntityTypes, IdReader, read_stats, spill_dtype
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.importer.staging import Staging
from pbg_ray.io.entities import (
    load_entity_names, load_relation_names, save_dynamic_rel_count, save_entity_count,
    save_entity_names, save_relation_names)
from pbg_ray.io.name_keys import mix, name_keys
from pbg_ray.io.raw import RawTable, input_shards
from pbg_ray.io.storage import StoragePath, storage_path
from pbg_ray.runtime.budget import memory_budget
from pbg_ray.runtime.connect import connect_ray, local_ray, starts_local_ray
from pbg_ray.runtime.faults import fault_point
from pbg_ray.runtime.tasks import TASK_RETRIES, worker_died

logger = logging.getLogger("pbg_ray")

UNSEEN = -2  # the place of a later input's names the first never had, and of their edges' bucket
DROPPED = -1  # the place of names dropped as too rare, and of their edges' bucket
PLACE_BITS = 40  # a name's place: partition << PLACE_BITS | offset
OFFSET_MASK = (1 << PLACE_BITS) - 1
PART_BYTES = 64 << 20  # blocks' bytes per names writer and bucket writer
MAX_IDS = 1 << 31  # ids are int32 in the blocks
# The import's tasks and actors run in workers of their own: glibc hands a freed buffer of a
# MiB or more back to the system at once (its threshold would otherwise grow to the largest
# freed, and a read's batches stay held in its heap), and Arrow allocates with glibc too
# (its default pool keeps what it freed). On big_bench's import these take a read worker
# from about 430 to 250 MiB and a dictionary shard's from 530 to 470 (docs/sizing.md).
IMPORT_RUNTIME_ENV = {"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20),
                                   "ARROW_DEFAULT_MEMORY_POOL": "system"}}

# Per name type, the place of every id (partition << PLACE_BITS | offset; DROPPED, UNSEEN).
Places = np.ndarray
# A dictionary shard's names of one type, by id: (keys, first-input counts, checks).
Keyed = Tuple[np.ndarray, np.ndarray, np.ndarray]


def import_graph(config: ConfigSchema) -> Dict[str, Any]:
    """Import `config.importer.inputs` with the engine importer.engine picks, within the
    plan of its memory (importer/plan.py; refused before Ray starts where even the least
    does not fit); returns stats."""
    config = config.checked()
    engine = choose_engine(config)
    if engine == "local" or starts_local_ray(config.ray):
        plan = import_plan(config, engine, memory_budget(config.ray))
        if engine == "ray" and config.ray.object_store_memory is None:
            config = dataclasses.replace(config, ray=dataclasses.replace(
                config.ray, object_store_memory=plan.object_store))
    if engine == "ray":
        connect_ray(config.ray)
        if not local_ray():  # a cluster: each node is its own
            plan = import_plan(config, engine, None, int(ray.cluster_resources().get("CPU", 1)))
    logger.info("import: the %s engine, %s", engine, plan.describe())
    if engine == "local":
        return run_import(config, functools.partial(local_phases, plan=plan))
    return run_import(config, functools.partial(ray_phases, plan=plan), shared=True)


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
    line."""
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


@dataclasses.dataclass
class _Generation:
    """A dictionary shard's names of one name type taken in one pass and spilled to disk:
    its first index id and its files (keys, counts, checks; names)."""

    first: int
    size: int
    arrays: str  # .npz of keys, counts, checks by index id
    names: str  # Arrow IPC file of the names by index id

    def keyed(self) -> Keyed:
        with np.load(self.arrays) as saved:
            return saved["keys"], saved["counts"], saved["checks"]

    def names_chunks(self) -> Iterator[Tuple[int, pa.Array]]:
        """(index id of the first, names) per record batch of the names file."""
        first = self.first
        with pa.memory_map(self.names) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                names = reader.get_batch(i).column(0)
                yield first, names
                first += len(names)


class DictionaryShard:
    """One share of an import's dictionaries, as a Ray actor: for every name type, a
    NameIndex of the names whose key hashes to this shard. An id it gives is
    `index id * shards + shard`, unique over the shards.

    With `names_bytes` (a local Ray's plan, importer/plan.py), once its indexes hold more,
    or would as a hash table grows, it takes no new names in this pass: a name it lacks
    gets id -1 (unresolved) and is not counted; the names it knows still get their ids and
    counts. Between passes (`spill`) it writes its names to `spill_dir` and starts empty;
    the next pass's reads send it the names still unresolved, whose ids follow those
    spilled."""

    def __init__(self, config: ConfigSchema, shard: int, shards: int,
                 names_bytes: Optional[int] = None, spill_dir: Optional[str] = None) -> None:
        types = EntityTypes.of(config)
        self.shard, self.shards = shard, shards
        self.names_bytes, self.spill_dir = names_bytes, spill_dir
        self.slots = _slots(config)
        self.indexes = {t: NameIndex(_what(types, t)) for t in self.slots}
        self.spilled: Dict[int, List[_Generation]] = {t: [] for t in self.slots}
        self.first = {t: 0 for t in self.slots}  # index id of each index's first name
        self.counted: Set[Tuple[Any, ...]] = set()
        self.full = False  # this pass takes no new names

    def add(self, name_type: int, call: Tuple[Any, ...], keys: np.ndarray, checks: np.ndarray,
            names: pa.Array, counts: Optional[np.ndarray]) -> np.ndarray:
        """The ids of one read call's names (NameIndex.add_keyed), new names getting new
        ids (or -1 once the shard is full); counted unless `call` (a read's pass, shard,
        name type and call number) was counted before: its read task runs again after
        its worker died."""
        fault_point("importer.shard_add")
        if call in self.counted:
            counts = np.zeros(len(keys))
        self.counted.add(call)
        index = self.indexes[name_type]
        growth = index.growth(len(keys))
        if self.names_bytes is not None and not self.full and growth:
            # A hash table that grows holds its old slots and its new ones at once.
            self.full = self._held() + growth > self.names_bytes
        ids = index.add_keyed(keys, checks, names, counts, grow=not self.full)
        if (self.first[name_type] + len(index)) * self.shards > MAX_IDS:
            raise PbgRayError(f"{index.what}: more than {MAX_IDS:,} names in one import, the "
                              "most the Ray engine gives ids to. Import them in parts "
                              "(importer.previous_entity_path).")
        if self.names_bytes is not None and not self.full:
            self.full = self._held() > self.names_bytes
        return np.where(ids >= 0, (ids + self.first[name_type]) * self.shards + self.shard,
                        -1).astype(np.int32)

    def _held(self) -> int:
        """The bytes its indexes hold (NameIndex.nbytes)."""
        return sum(index.nbytes() for index in self.indexes.values())

    def pass_done(self) -> int:
        """The end of a pass: the names it holds, where it took its share and left some
        unresolved (spilled to disk: it starts the next pass empty); else 0."""
        if not self.full:
            return 0
        held = 0
        for name_type, index in self.indexes.items():
            first, held = self.first[name_type], held + len(index)
            base = (f"{self.spill_dir}/shard{self.shard}-type{name_type}-"
                    f"pass{len(self.spilled[name_type]) + 1}")
            keys, counts, checks = index.close()
            np.savez(base + ".npz", keys=keys, counts=counts, checks=checks)
            with pa.OSFile(base + ".arrow", "wb") as sink, pa.ipc.new_file(
                    sink, pa.schema([("name", pa.large_string())])) as writer:
                for _, chunk in index.drain_names():
                    writer.write_batch(pa.record_batch([chunk], names=["name"]))
            self.spilled[name_type].append(_Generation(first, len(keys), base + ".npz",
                                                       base + ".arrow"))
            self.first[name_type] = first + len(keys)
            self.indexes[name_type] = NameIndex(index.what)
        self.full = False
        return held

    def keyed(self, name_type: int) -> Keyed:
        """A name type's (keys, counts, checks), by index id, once every read is done:
        from then on the shard holds its names only (NameIndex.close)."""
        parts = [g.keyed() for g in self.spilled[name_type]]
        parts.append(self.indexes[name_type].close())
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))

    def name(self, name_type: int, index_id: int) -> str:
        for first, names in self._names_chunks(name_type):
            if first <= index_id < first + len(names):
                return names[index_id - first].as_py()
        raise KeyError(index_id)

    def _names_chunks(self, name_type: int) -> Iterator[Tuple[int, pa.Array]]:
        """The names as added, in chunks: (the index id of the first, the chunk's names);
        those held let go once the next is asked for."""
        for generation in self.spilled[name_type]:
            yield from generation.names_chunks()
        for first, names in self.indexes[name_type].drain_names():
            yield self.first[name_type] + first, names

    def scatter_names(self, writers: int, *places: Places) -> Any:
        """The kept names with their places, per names writer: for each, a list of (name
        type, partitions, offsets, names). `places`: of each name type, in _slots order.
        The shard's last work: it lets go of its names as it goes."""
        out: List[List[Any]] = [[] for _ in range(writers)]
        for name_type, place_of in zip(self.slots, places):
            for first, names in self._names_chunks(name_type):
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

    def __init__(self, shards: List[Any], name_type: int, call: Tuple[Any, ...]) -> None:
        self.shards, self.name_type = shards, name_type
        self.calls = (call + (name_type, n) for n in itertools.count())

    def add(self, names: pa.Array, counts: Optional[np.ndarray] = None) -> np.ndarray:
        return self.add_later(names, counts)()

    def add_later(self, names: pa.Array,
                  counts: Optional[np.ndarray] = None) -> Callable[[], np.ndarray]:
        """The names sent to their shards now; the call returned waits for their ids."""
        keys, checks = name_keys(names)
        call = next(self.calls)
        if len(self.shards) == 1:  # every name to the one shard: no grouping, no copies
            ref = self.shards[0].add.remote(self.name_type, call, keys, checks, names, counts)
            return lambda: _got([ref])[0]
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

        def gather() -> np.ndarray:
            ids = np.empty(len(keys), np.int32)
            for mine, got in zip(rows, _got(refs)):
                ids[mine] = got
            return ids
        return gather


def _got(refs: List[Any]) -> List[np.ndarray]:
    """The dictionary shards' answers; a shard whose worker died said in one line here."""
    try:
        return ray.get(refs)
    except ActorDiedError as err:
        raise worker_died(err) from None


# --- read ----------------------------------------------------------------------------


@dataclasses.dataclass
class ShardFigures:
    """A shard's reading figures, as read_stats takes them from a RawTable."""

    path: str
    format: str
    num_rows: int
    bad_rows: int
    bad_examples: List[str]


@dataclasses.dataclass
class IdBlock:
    """At most a block's rows of edges of one input shard, as ids (-1: a name a full
    dictionary shard left unresolved, for a later pass)."""

    input: int  # the input's number
    lhs: np.ndarray  # int32 ids within the lhs's entity type
    rhs: np.ndarray
    rel: np.ndarray  # relation ids (with dynamic_relations: ids of relation names)
    weight: Optional[np.ndarray]  # float32, with importer.weight_col

    def unresolved(self) -> np.ndarray:
        """Whether each edge names something still unresolved."""
        return (self.lhs < 0) | (self.rhs < 0) | (self.rel < 0)


@dataclasses.dataclass
class ShardRead:
    """What a read task says of its shard once done: its figures and the edges it left
    unresolved."""

    input: int
    figures: ShardFigures
    blocks: int
    unresolved: int


@ray.remote(num_returns="streaming", max_retries=TASK_RETRIES, scheduling_strategy="SPREAD",
            runtime_env=IMPORT_RUNTIME_ENV)
def _read_shard(config: ConfigSchema, number: int, path: str, shards: List[Any],
                block_rows: int, pass_number: int,
                previous: Optional[List[Any]]) -> Iterator[Any]:
    """One input shard parsed (io/raw.py's RawTable, the local reader's relation checks),
    its names given ids by the dictionary shards as they are read, in IdBlocks of whole
    batches of `block_rows` edges or more, and last its ShardRead. In a pass after the
    first, `previous` holds the shard's blocks of the pass before (references): only the
    names they left unresolved are sent, the others kept."""
    fault_point("importer.read_shard")
    table = RawTable(path, config.importer)
    blocks, unresolved, pieces, rows = 0, 0, [], 0
    for piece in _named_batches(config, number, table, shards, ("read", pass_number, path),
                                previous):
        fault_point("importer.batch_named")
        pieces.append(piece)
        rows += len(piece[0])
        if rows >= block_rows:
            block = _block(number, pieces)
            unresolved, blocks = unresolved + int(block.unresolved().sum()), blocks + 1
            yield block
            pieces, rows = [], 0
    if pieces or not blocks:
        block = _block(number, pieces)
        unresolved, blocks = unresolved + int(block.unresolved().sum()), blocks + 1
        yield block
    figures = ShardFigures(str(table.path), table.format, table.num_rows, table.bad_rows,
                           table.bad_examples)
    yield ShardRead(number, figures, blocks, unresolved)


def _named_batches(config: ConfigSchema, number: int, table: RawTable, shards: List[Any],
                   call: Tuple[Any, ...],
                   previous: Optional[List[Any]]) -> Iterator[Tuple[Optional[np.ndarray], ...]]:
    """The (lhs, rhs, rel, weight) ids of each batch of `table`, named by the dictionary
    `shards` one batch behind: a batch's names are sent before the batch before it is
    gathered, so that the shards name it while the next is parsed. `call`: the read's
    (pass, shard), which numbers its calls to the shards."""
    check = IdReader(config)
    reader = IdReader(config, shared=lambda t, _: _SharedIndex(shards, t, call))
    dynamic, weighted = config.dynamic_relations, config.importer.weight_col is not None
    earlier = iter(previous or [])
    before, at = None, 0  # the pass before's block of the batch, and the batch's place in it
    pending: Optional[Callable[[], Tuple[Optional[np.ndarray], ...]]] = None
    for batch, rel in check.batches(table, learn=False):
        n = len(batch)
        counts = None if number == 0 else np.zeros(n)  # the first input counts
        weight = np.asarray(batch.weight, np.float32) if weighted else None
        if previous is None:
            rel = reader.relation_ids(batch, learn=True, counts=counts) if dynamic else rel
            named = reader.entity_ids_later(batch, rel, learn=True, counts=counts)
            kept = None
        else:
            if before is None or at == len(before.lhs):
                before, at = ray.get(next(earlier)), 0
            lhs, rhs, rel = (getattr(before, side)[at:at + n].astype(np.int64)
                             for side in ("lhs", "rhs", "rel"))
            at += n
            if dynamic and (rel < 0).any():
                rel[rel < 0] = reader.relation_ids(
                    batch.take(rel < 0), learn=True,
                    counts=None if counts is None else counts[rel < 0])
            named = reader.entity_ids_later(batch, rel, learn=True, counts=counts,
                                            only=(lhs < 0, rhs < 0))
            kept = lhs, rhs
        if pending is not None:
            yield pending()
        pending = functools.partial(_piece, named, kept, rel, weight)
    if pending is not None:
        yield pending()


def _piece(named: Callable[[], tuple], kept: Optional[Tuple[np.ndarray, np.ndarray]],
           rel: np.ndarray, weight: Optional[np.ndarray]) -> Tuple[Optional[np.ndarray], ...]:
    """A batch's ids once its shards have named it: (lhs, rhs, rel, weight), int32;
    `kept`: the ids the pass before found, the names it left unresolved named here."""
    lhs, rhs = named()
    if kept is not None:
        lhs, rhs = np.where(kept[0] < 0, lhs, kept[0]), np.where(kept[1] < 0, rhs, kept[1])
    return lhs.astype(np.int32), rhs.astype(np.int32), rel.astype(np.int32), weight


def _block(number: int, pieces: List[Tuple[Optional[np.ndarray], ...]]) -> IdBlock:
    """The batches' ids of `pieces` as one block."""
    columns = [np.concatenate([p[i] for p in pieces]) if pieces else np.zeros(0, np.int32)
               for i in range(3)]
    weight = (np.concatenate([p[3] for p in pieces])
              if pieces and pieces[0][3] is not None else None)
    return IdBlock(number, *columns, weight)


def _read_all(config: ConfigSchema, plan: ImportPlan, shards: List[Any],
              inputs: List[Tuple[int, str]]) -> Tuple[List[List[Any]], List[ShardRead]]:
    """Every input shard read by the plan's reads at once (ImportPlan.reads), pass after
    pass until no name is unresolved: each shard's block references and ShardRead."""
    blocks: List[Optional[List[Any]]] = [None] * len(inputs)
    figures: List[Optional[ShardRead]] = [None] * len(inputs)
    todo = list(range(len(inputs)))
    for pass_number in itertools.count(1):
        running: Dict[Any, int] = {}
        got: Dict[int, List[Any]] = {i: [] for i in todo}
        waiting = list(todo)
        while waiting or running:
            while waiting and len(running) < plan.reads:
                i = waiting.pop(0)
                number, path = inputs[i]
                running[_read_shard.remote(config, number, path, shards, plan.block_rows,
                                           pass_number, blocks[i])] = i
            (ready,), _ = ray.wait(list(running), num_returns=1)
            try:
                got[running[ready]].append(next(ready))
            except StopIteration:
                i = running.pop(ready)
                blocks[i], figures[i] = got[i][:-1], _reraising(ray.get, got[i][-1])
        held = _reraising(ray.get, [shard.pass_done.remote() for shard in shards])
        todo = [i for i in todo if figures[i].unresolved]
        if not todo:
            return blocks, figures
        logger.info("import: pass %d left the names of %d edges unresolved, its %d names "
                    "spilled to disk; pass %d reads %d shards again", pass_number,
                    sum(figures[i].unresolved for i in todo), sum(held), pass_number + 1,
                    len(todo))
    raise AssertionError("unreachable")


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


@ray.remote(scheduling_strategy="SPREAD", num_returns=2, runtime_env=IMPORT_RUNTIME_ENV)
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


@ray.remote(scheduling_strategy="SPREAD", runtime_env=IMPORT_RUNTIME_ENV)
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


@ray.remote(scheduling_strategy="SPREAD", runtime_env=IMPORT_RUNTIME_ENV)
def _route_block(config: ConfigSchema, writers: int, name_types: List[int], block: IdBlock,
                 *places: Places) -> Tuple[Any, ...]:
    """A block's edges given their buckets: (its figures: input, edges left out as
    dropped and as unseen), then per writer the edges of its buckets (bucket % writers)."""
    places_of = dict(zip(name_types, places))
    types = EntityTypes.of(config)
    router = BucketRouter(config, types, spill_dtype(block.weight is not None))
    n = len(block.rel)
    rel = places_of[RELATIONS][block.rel] if config.dynamic_relations else block.rel.astype(np.int64)
    unseen, sides = rel == UNSEEN, {}
    for side in ("lhs", "rhs"):
        of_edge = types.of_edges(side, rel)
        ids = getattr(block, side)
        place = np.empty(n, np.int64)
        for t in range(len(types.names)):
            mask = of_edge == t if len(types.names) > 1 else slice(None)
            place[mask] = places_of[t][ids[mask]]
        unseen |= place == UNSEEN
        sides[side] = (np.where(place >= 0, place >> PLACE_BITS, DROPPED),
                       place & OFFSET_MASK)
    bucket = np.where(unseen, UNSEEN, router.buckets(rel, *sides["lhs"], *sides["rhs"]))
    figures = {"input": block.input, "dropped": int((bucket == DROPPED).sum()),
               "unseen": int((bucket == UNSEEN).sum())}
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
    if block.weight is not None:
        columns["weight"] = block.weight[order]
    return (figures,) + tuple({"input": block.input,
                               **{k: v[bounds[w]:bounds[w + 1]] for k, v in columns.items()}}
                              for w in range(writers))


@ray.remote(scheduling_strategy="SPREAD", runtime_env=IMPORT_RUNTIME_ENV)
def _write_buckets(config: ConfigSchema, stages: List[StoragePath], writer: int, writers: int,
                   *routed: Dict[str, Any]) -> List[Tuple[int, int, int, int]]:
    """Every bucket file of one writer (its buckets of every input, empty or not) from
    the blocks' routed edges; returns (input, bucket, edges, previous edges) of each."""
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


def ray_phases(config: ConfigSchema, stages: Staging, plan: ImportPlan) -> Tuple[
        List[Dict[str, Any]], Dict[str, int], int]:
    """The phases on Ray tasks and actors (see the module doc), within `plan`."""
    types = EntityTypes.of(config)
    previous = [types.names.index(name) for name in previous_types(config, types)] + (
        [RELATIONS] if config.dynamic_relations and config.importer.previous_entity_path else [])
    inputs = [(number, str(shard.path)) for number, spec in enumerate(config.importer.inputs)
              for shard in input_shards(spec)]
    shard_actor = ray.remote(DictionaryShard).options(
        num_cpus=0, scheduling_strategy="SPREAD", runtime_env=IMPORT_RUNTIME_ENV)
    with tempfile.TemporaryDirectory(prefix="pbg_ray-names-") as spill_dir:
        shards = [shard_actor.remote(config, s, plan.shards, plan.names_bytes, spill_dir)
                  for s in range(plan.shards)]
        try:
            return _phases(config, stages, plan, shards, inputs, previous)
        finally:
            for shard in shards:
                ray.kill(shard)


def _phases(config: ConfigSchema, stages: Staging, plan: ImportPlan, shards: List[Any],
            inputs: List[Tuple[int, str]], previous: List[int]) -> Tuple[
        List[Dict[str, Any]], Dict[str, int], int]:
    """ray_phases with its dictionary shards started."""
    types = EntityTypes.of(config)
    name_types = list(_slots(config))
    tasks = max(1, int(ray.cluster_resources().get("CPU", 1)))
    read_blocks, reads = _read_all(config, plan, shards, inputs)
    blocks = [block for shard_blocks in read_blocks for block in shard_blocks]
    edge_bytes = 16 if config.importer.weight_col is not None else 12
    parts = max(tasks, -(-sum(r.figures.num_rows for r in reads) * edge_bytes // PART_BYTES))
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
    del blocks, read_blocks
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
    routed_figures = _reraising(ray.get, [refs[0] for refs in routed])
    _reraising(ray.get, names_written)
    kept = dict(zip(name_types, _reraising(ray.get, [total for _, total in dictionaries])))
    per_input = []
    for number, (spec, output) in enumerate(zip(config.importer.inputs,
                                                config.edge_paths + config.eval_edge_paths)):
        mine = [f for f in routed_figures if f["input"] == number]
        found = sorted((r.figures for r in reads if r.input == number), key=lambda f: f.path)
        unseen = sum(f["unseen"] for f in mine)
        stats = {"output": str(storage_path(output)), **read_stats(
            spec, found, unseen if number else None, config.importer.inputs[0])}
        rows = [row for row in written if row[0] == number]
        stats.update(edges=sum(row[2] + row[3] for row in rows),
                     dropped_rare=sum(f["dropped"] for f in mine))
        if config.importer.previous_edge_paths[number:number + 1]:
            stats["previous_edges"] = sum(row[3] for row in rows)
        per_input.append(stats)
    return (per_input, {name: kept[t] for t, name in enumerate(types.names)},
            kept[RELATIONS] if config.dynamic_relations else len(config.relations))
