"""Entity and relation names of a model, looked up in batches: each type's partitions read
one at a time (a few kept between calls) or all kept, the (partition, offset) of each name
found, and one clear error for each name that is not, with the nearest names. A partition's
names are kept compact (about 20 bytes a name beyond its characters, where a Python string
and a dict entry take about 100): a service keeps every partition's.

The one name lookup of Predictor, the predict command and the service."""

from __future__ import annotations

import bisect
import collections
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.io.entities import entity_names_bytes, load_entity_names, load_relation_names
from pbg_ray.io.name_keys import name_keys

SUGGESTIONS = 64  # names near an unknown one (in sorted order, per partition) that "did you mean" weighs
# PartitionNames' bytes a name beyond its characters (an offset and a key of 8 bytes, a
# position of 4) less the 4 its names file spends on quotes and separators; and what
# reading takes beyond that, per name of the largest partition (the JSON file's Python
# strings, their keys' arrays, and the heap they leave: 20M names in 32 partitions kept
# 569 MB and grew the process by 766 MB).
COMPACT_EXTRA = 16
READ_PER_NAME = 320

Asked = Tuple[str, str]  # (entity type, name)
Located = Tuple[int, int]  # (partition, offset)


class Recent:
    """Values by key, made on first use; the `size` used last are kept (least recently used
    dropped first), all of them where size is None."""

    def __init__(self, size: Optional[int]) -> None:
        self.size = size
        self._kept: "collections.OrderedDict[Hashable, Any]" = collections.OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._kept

    def __getitem__(self, key: Hashable) -> Any:
        """The value kept for `key`, now the one used last."""
        self._kept.move_to_end(key)
        return self._kept[key]

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value of `key`, made by `make` and kept if absent."""
        if key in self._kept:
            return self[key]
        value = make()
        self.put(key, value)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        """Keep `value` as the one used last, dropping the least recently used past size."""
        if self.size is None or self.size > 0:
            self._kept[key] = value
            self._kept.move_to_end(key)
            while self.size is not None and len(self._kept) > self.size:
                self._kept.popitem(last=False)


class PartitionNames:
    """One partition's names: in offset order as an Arrow string array, and their 64-bit
    keys (io/name_keys.py, as the importer's) sorted, with the offset of each: a name is
    found by a binary search on its key, then compared. Their sorted order, for
    suggestions, is made on first use."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = pa.array(names, pa.large_string())
        keys, _ = name_keys(self.names)
        self._by_key = np.argsort(keys, kind="stable").astype(np.int32)
        self._keys = keys[self._by_key]
        self._by_name: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:
        sorted_names = 0 if self._by_name is None else self._by_name.nbytes
        return self.names.nbytes + self._by_key.nbytes + self._keys.nbytes + sorted_names

    def take(self, offsets: Sequence[int]) -> List[str]:
        """The names at `offsets`."""
        return self.names.take(pa.array(offsets, pa.int64())).to_pylist()

    def offsets(self, asked: Sequence[str]) -> Dict[str, int]:
        """The offset of each name in `asked` that the partition has."""
        if not asked or not len(self):
            return {}
        keys, _ = name_keys(pa.array(asked, pa.large_string()))
        at = np.searchsorted(self._keys, keys).clip(max=len(self) - 1)
        hits = np.flatnonzero(self._keys[at] == keys)
        offsets = self._by_key[at[hits]]
        return {asked[i]: int(o) for i, o, name in zip(hits, offsets, self.take(offsets))
                if name == asked[i]}

    def near(self, name: str) -> List[str]:
        """The names that sort next to `name` (a scan of millions of names per unknown one
        would stall the service)."""
        if self._by_name is None:
            self._by_name = pc.sort_indices(self.names).to_numpy()
        ordered = _Sorted(self.names, self._by_name)
        at = bisect.bisect_left(ordered, name)
        return self.take(self._by_name[max(0, at - SUGGESTIONS // 2):at + SUGGESTIONS // 2])


class _Sorted:
    """The names in sorted order, as a sequence bisect can search (each read on access)."""

    def __init__(self, names: pa.Array, order: np.ndarray) -> None:
        self.names, self.order = names, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> str:
        return self.names[int(self.order[i])].as_py()


def names_bytes(config: ConfigSchema, counts: Dict[str, Sequence[int]]) -> int:
    """What keeping every partition's names takes (EntityNames with keep=None), from the
    names files' sizes: the compact names, and the largest partition while it is read."""
    kept = sum(entity_names_bytes(config.entity_path, entity, part) + COMPACT_EXTRA * rows
               for entity in config.entities for part, rows in enumerate(counts[entity]))
    return kept + READ_PER_NAME * max((max(counts[entity], default=0)
                                       for entity in config.entities), default=0)


class EntityNames:
    """The names of the entity types in config.entity_path, per partition. keep: how many
    partitions stay loaded between calls (least recently used dropped first); None: all,
    as the service keeps them."""

    def __init__(self, config: ConfigSchema, keep: Optional[int] = None,
                 counts: Optional[Dict[str, List[int]]] = None, source: str = "") -> None:
        """counts: per type the embeddings of each partition, checked against the names'
        (source: where the embeddings are, for that message)."""
        self.config = config
        self.counts = counts
        self.source = source
        self._kept = Recent(keep)

    def partition(self, entity: str, part: int) -> PartitionNames:
        """One partition's names, read on first use."""
        return self._kept.get((entity, part), lambda: self._read(entity, part))

    def _read(self, entity: str, part: int) -> PartitionNames:
        names = load_entity_names(self.config.entity_path, entity, part)
        if self.counts is not None and len(names) != self.counts[entity][part]:
            raise PbgRayError(
                f"entity type {entity!r} partition {part}: {len(names)} names in "
                f"{self.config.entity_path!r} but {self.counts[entity][part]} embeddings in "
                f"{self.source}. Pass the entity_path the checkpoint was trained on.")
        return PartitionNames(names)

    def keep_all(self) -> None:
        """From now on keep every partition read (a batch whose answers are in all of them)."""
        self._kept.size = None

    def partitions(self, entity: str) -> range:
        return range(self.config.entities[entity].num_partitions)

    def names(self, entity: str) -> List[List[str]]:
        """The names of an entity type, per partition, as Python lists (all of them: mind
        the table's size)."""
        return [self.partition(entity, p).names.to_pylist() for p in self.partitions(entity)]

    def read(self, entity: str) -> int:
        """Every partition of an entity type read (and kept as `keep` allows): their bytes."""
        return sum(self.partition(entity, p).nbytes for p in self.partitions(entity))

    def lookup(self, asked: Iterable[Asked]) -> Dict[Asked, Located]:
        """(partition, offset) of each (entity type, name) asked that the type has; each
        type's partitions read once, and no further than its last name found."""
        wanted: Dict[str, Set[str]] = {}
        for entity, name in asked:
            wanted.setdefault(entity, set()).add(name)
        found: Dict[Asked, Located] = {}
        for entity, names in wanted.items():
            for part in self.partitions(entity):
                if not names:
                    break
                for name, offset in self.partition(entity, part).offsets(list(names)).items():
                    found[entity, name] = (part, offset)
                    names.discard(name)
        return found

    def unknown(self, missing: Sequence[Asked]) -> Dict[Asked, PbgRayError]:
        """The error of each (entity type, name) the type lacks: the type the name is of,
        where another has it (the wrong side of a relation), else the nearest names."""
        others = self.lookup((other, name) for entity, name in missing
                             for other in self.config.entities if other != entity)
        errors: Dict[Asked, PbgRayError] = {}
        for entity, name in missing:
            elsewhere = [other for other in self.config.entities if (other, name) in others]
            errors[entity, name] = PbgRayError(
                f"{name!r} is an entity of type {elsewhere[0]!r}, not of type {entity!r}: check "
                "the relation and which side the name is on." if elsewhere else
                f"unknown {entity} entity {name!r}{self.suggest(name, [entity])}.")
        return errors

    def suggest(self, name: str, entities: Sequence[str]) -> str:
        """did_you_mean among the names of `entities` that sort next to `name`."""
        return did_you_mean(name, [near for entity in entities for part in self.partitions(entity)
                                   for near in self.partition(entity, part).near(name)])

    def type_of(self, names: Sequence[str]) -> Dict[str, "str | PbgRayError"]:
        """The entity type of each name, or the error of a name in no type or in several."""
        found = self.lookup((entity, name) for name in names for entity in self.config.entities)
        types: Dict[str, "str | PbgRayError"] = {}
        for name in names:
            among = [entity for entity in self.config.entities if (entity, name) in found]
            types[name] = among[0] if len(among) == 1 else PbgRayError(
                f"entity {name!r} " + (f"is in several types {among}: give its type (entity_type, or --type "
                                       "on the command line)." if among
                                       else f"is unknown"
                                       f"{self.suggest(name, list(self.config.entities))}."))
        return types


class RelationNames:
    """The relation names of a config: its relation types', or in dynamic mode those listed
    in entity_path."""

    def __init__(self, config: ConfigSchema) -> None:
        self.config = config
        self.names = (load_relation_names(config.entity_path) if config.dynamic_relations
                      else [r.name for r in config.relations])
        self._ids = {name: i for i, name in enumerate(self.names)}

    def resolve(self, name: str) -> Tuple[int, int]:
        """(index into config.relations, relation id) of a relation by name, or the error
        naming the nearest ones."""
        rel_id = self._ids.get(name)
        if rel_id is None:
            raise PbgRayError(f"unknown relation {name!r}{did_you_mean(name, self.names)}. "
                              f"Relations: {', '.join(self.names[:20])}"
                              f"{' ...' if len(self.names) > 20 else ''}.")
        return (0 if self.config.dynamic_relations else rel_id), rel_id
