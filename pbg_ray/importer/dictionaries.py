"""The dictionaries phase: each name's id -> its partition and offset, as PBG assigns them.

After the first input is read, each entity type's dictionary is fixed: names seen fewer
than importer.entity_min_count times are dropped, the rest put in a canonical order (by
key, independent of row order), shuffled with importer.seed and cut into contiguous
partitions. With dynamic_relations the relation names get the same treatment
(importer.relation_type_min_count, one partition): a relation's id is its offset.

An incremental import (importer.previous_entity_path) seeds each name index with the
previous import's names before anything is read, so that they get the first ids. They
keep their partition and offset whatever their count now, and the new names are
appended to the ends of partitions, the smallest partitions first (fill_smallest).

The places themselves (cut_places, appended_places) depend on the number of names and
the seed only: the local engine applies them to its name index, the Ray engine
(ray_engine.py) to the names' keys alone, so both write the same entity files.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.importer.read import EntityTypes, IdReader
from pbg_ray.importer.staging import MANIFEST
from pbg_ray.io.entities import (
    dynamic_rel_names_file, entity_count_file, load_entity_names, load_relation_names,
    save_dynamic_rel_count, save_entity_count, save_entity_names, save_relation_names)
from pbg_ray.io.storage import StoragePath, storage_path


@dataclasses.dataclass
class Dictionary:
    """One name index's ids (order of first appearance) -> partition and offset."""

    part: np.ndarray  # int64 per id, -1: dropped (too rare)
    offset: np.ndarray  # int64 per id
    names: List[List[str]]  # per partition


def _positions(n: int, rng: np.random.Generator) -> np.ndarray:
    """The place in the shuffled order of each of `n` names in canonical order: the
    inverse of the shuffle (its argsort, by one scatter)."""
    positions = np.empty(n, np.int64)
    positions[rng.permutation(n)] = np.arange(n)
    return positions


def cut_places(n: int, num_partitions: int, rng: np.random.Generator) -> Tuple[np.ndarray, ...]:
    """PBG's places of `n` names in canonical order (by key, independent of row order):
    shuffled with `rng`, cut into contiguous ranges (partition p holds positions
    ceil(p n / P) .. ceil((p + 1) n / P) - 1); (partition, offset) of each."""
    offset = _positions(n, rng)
    part = offset * num_partitions
    part //= max(n, 1)
    parts = np.arange(num_partitions + 1, dtype=np.int64)
    starts = (parts * n + num_partitions - 1) // num_partitions
    offset -= starts[part]
    return part, offset


def appended_places(counts: np.ndarray, n: int,
                    rng: np.random.Generator) -> Tuple[np.ndarray, ...]:
    """The places of `n` new names in canonical order appended to partitions of `counts`
    names: shuffled with `rng`, the smallest partitions filled first (fill_smallest);
    (partition, offset) of each."""
    offset = _positions(n, rng)
    starts = np.concatenate([[0], np.cumsum(fill_smallest(counts, n))])
    part = np.searchsorted(starts, offset, side="right") - 1
    offset += counts[part] - starts[part]
    return part, offset


def _canonical(index: NameIndex, ids: np.ndarray) -> np.ndarray:
    """`ids` in canonical order: by key."""
    return ids[np.argsort(index.keys()[ids], kind="stable")]


def _names_by_partition(index: NameIndex, ids: np.ndarray, part: np.ndarray,
                        offset: np.ndarray, num_partitions: int) -> List[List[str]]:
    """The names of `ids` placed at (part, offset), per partition in offset order."""
    order = np.lexsort((offset, part))
    ordered = index.names().take(pa.array(ids[order]))
    starts = np.searchsorted(part[order], np.arange(num_partitions + 1))
    return [ordered.slice(starts[p], starts[p + 1] - starts[p]).to_pylist()
            for p in range(num_partitions)]


def partition_names(index: NameIndex, num_partitions: int, min_count: int,
                    rng: np.random.Generator) -> Dictionary:
    """PBG's dictionary: the names seen min_count times at cut_places."""
    ids = _canonical(index, np.flatnonzero(index.counts >= min_count))
    places = cut_places(len(ids), num_partitions, rng)
    part = np.full(len(index), -1, np.int64)
    offset = np.full(len(index), -1, np.int64)
    part[ids], offset[ids] = places
    return Dictionary(part, offset, _names_by_partition(index, ids, *places, num_partitions))


def fill_smallest(counts: np.ndarray, n: int) -> np.ndarray:
    """How many of `n` new entities each partition of `counts` [P] gets, the smallest
    filled first: all partitions below a level are raised to it, and what is left goes
    one each to the partitions at the level, lowest index first."""
    lo, hi = int(counts.min()), int(counts.min()) + n
    while lo < hi:  # the highest level reachable with n entities
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if np.maximum(mid - counts, 0).sum() <= n else (lo, mid - 1)
    added = np.maximum(lo - counts, 0)
    at_level = np.flatnonzero(counts + added == lo)
    added[at_level[:n - int(added.sum())]] += 1
    return added


def extend_names(index: NameIndex, previous: List[List[str]], min_count: int,
                 rng: np.random.Generator) -> Dictionary:
    """A previous dictionary grown by the new names of `index`, whose first ids are the
    previous names partition by partition (seeded before reading). Known names keep
    their (partition, offset) whatever their count; new names seen min_count times go
    to appended_places."""
    counts = np.array([len(names) for names in previous], np.int64)
    known = int(counts.sum())
    ids = _canonical(index, known + np.flatnonzero(index.counts[known:] >= min_count))
    places = appended_places(counts, len(ids), rng)
    part = np.full(len(index), -1, np.int64)
    offset = np.full(len(index), -1, np.int64)
    part[:known] = np.repeat(np.arange(len(counts)), counts)
    offset[:known] = np.arange(known) - np.repeat(np.cumsum(counts) - counts, counts)
    part[ids], offset[ids] = places
    added = _names_by_partition(index, ids, *places, len(previous))
    return Dictionary(part, offset, [old + new for old, new in zip(previous, added)])


@dataclasses.dataclass
class PreviousDictionaries:
    """What an incremental import keeps of importer.previous_entity_path."""

    entities: Dict[str, List[List[str]]]  # entity type -> names per partition
    relations: Optional[List[str]]  # with dynamic_relations: relation names by id


def previous_types(config: ConfigSchema, types: EntityTypes) -> List[str]:
    """The entity types importer.previous_entity_path holds (none without it), each checked
    to have the config's partitions; its relation files checked against the config."""
    path = config.importer.previous_entity_path
    if path is None:
        return []
    kept = []
    for name in types.names:
        parts = config.entities[name].num_partitions
        present = [entity_count_file(path, name, p).is_file() for p in range(parts + 1)]
        if not any(present):
            continue  # a new entity type: all its names are new
        if not all(present[:parts]) or present[parts]:
            found = sum(1 for _ in storage_path(path).glob(f"entity_count_{name}_*.txt"))
            raise PbgRayError(
                f"importer.previous_entity_path {path!r} has {found} partition(s) of entity "
                f"type {name!r}, the config {parts}. Known entities keep their partitions: "
                f"set entities.{name}.num_partitions={found}.")
        kept.append(name)
    if not config.dynamic_relations:
        _check_previous_relations(config, storage_path(path))
    elif not dynamic_rel_names_file(path).is_file():
        raise PbgRayError(f"importer.previous_entity_path {path!r} has no "
                          "dynamic_rel_names.json, so it wasn't imported with "
                          "dynamic_relations=true. Import both the same way.")
    return kept


def load_previous(config: ConfigSchema, reader: IdReader) -> PreviousDictionaries:
    """The previous import's dictionaries (none without importer.previous_entity_path),
    seeded into the reader's name indexes so that their ids come first."""
    path = config.importer.previous_entity_path
    names: Dict[str, List[List[str]]] = {}
    for name in previous_types(config, reader.types):
        parts = config.entities[name].num_partitions
        names[name] = [load_entity_names(path, name, p) for p in range(parts)]
        _seed(reader.entity_index[name], [n for ns in names[name] for n in ns],
              f"entity type {name!r}", path)
    if path is None or not config.dynamic_relations:
        return PreviousDictionaries(names, None)
    relations = load_relation_names(path)
    _seed(reader.relation_index, relations, "relations", path)
    return PreviousDictionaries(names, relations)


def _seed(index: NameIndex, names: List[str], what: str, previous: str) -> None:
    """Known names get the first ids, in the previous import's order."""
    index.add(pa.array(names, pa.string()))
    if len(index) != len(names):
        raise PbgRayError(f"importer.previous_entity_path {previous!r}: {what} lists a name "
                          "twice, so its ids are ambiguous. Fix the previous import's entity "
                          "files.")


def _check_previous_relations(config: ConfigSchema, previous: StoragePath) -> None:
    """Relation ids are positions in `relations`: the previous import's must come first."""
    try:
        identity = json.loads((previous / MANIFEST).read_text())["identity"]
        before = [r["name"] for r in identity["relations"]]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not imported by pbg_ray: nothing to compare with
    now = [r.name for r in config.relations]
    if now[:len(before)] != before:
        raise PbgRayError(f"the config's relations {now} don't start with those of the "
                          f"previous import {before} ({str(previous / MANIFEST)!r}); relation "
                          "ids would change. Keep the old relations first, in their order, "
                          "and add new ones at the end.")


@dataclasses.dataclass
class Dictionaries:
    """The import's fixed dictionaries: entity types' and relations'."""

    entities: Dict[str, Dictionary]  # entity type -> its dictionary
    relation_ids: np.ndarray  # int64 per relation id as read -> id written; -1: too rare
    relation_names: List[str]  # by id written

    def entity_counts(self) -> Dict[str, int]:
        return {name: sum(map(len, d.names)) for name, d in self.entities.items()}

    def write(self, config: ConfigSchema, directory: Path) -> None:
        """The entity files of every entity type of the config (empty for types no
        relation uses) and, with dynamic_relations, the relation files."""
        for name, entity in config.entities.items():
            dictionary = self.entities.get(name)
            for part in range(entity.num_partitions):
                names = dictionary.names[part] if dictionary is not None else []
                save_entity_names(directory, name, part, names)
                save_entity_count(directory, name, part, len(names))
        if config.dynamic_relations:
            save_relation_names(directory, self.relation_names)
            save_dynamic_rel_count(directory, len(self.relation_names))


def shuffle_rng(seed: int, name: str) -> np.random.Generator:
    """One generator per dictionary: each shuffle depends on the seed and its name only."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def build_dictionaries(config: ConfigSchema, reader: IdReader,
                       previous: PreviousDictionaries) -> Dictionaries:
    """The dictionaries of what `reader` has read (the first input)."""
    settings = config.importer
    entities = {}
    for name in reader.types.names:
        rng = shuffle_rng(settings.seed, f"entity {name}")
        index = reader.entity_index[name]
        entities[name] = (
            extend_names(index, previous.entities[name], settings.entity_min_count, rng)
            if name in previous.entities else
            partition_names(index, config.entities[name].num_partitions,
                            settings.entity_min_count, rng))
    if not config.dynamic_relations:
        return Dictionaries(entities, np.arange(len(config.relations), dtype=np.int64),
                            [r.name for r in config.relations])
    min_count, rng = settings.relation_type_min_count, shuffle_rng(settings.seed, "relations")
    relations = (partition_names(reader.relation_index, 1, min_count, rng)
                 if previous.relations is None else
                 extend_names(reader.relation_index, [previous.relations], min_count, rng))
    if not relations.names[0]:
        raise PbgRayError(f"no relation type occurs importer.relation_type_min_count="
                          f"{min_count} times in {settings.inputs[0]!r}. Lower the minimum.")
    return Dictionaries(entities, relations.offset, relations.names[0])
