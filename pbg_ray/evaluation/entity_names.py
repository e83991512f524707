"""Entity and relation names of a model, looked up in batches: each type's partitions read
one at a time (a few kept between calls) or all kept, the (partition, offset) of each name
found, and one clear error for each name that is not, with the nearest names.

The one name lookup of Predictor, the predict command and the service."""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.io.entities import load_entity_names, load_relation_names

SUGGESTIONS = 64  # names near an unknown one (in sorted order, per partition) that "did you mean" weighs

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


@dataclasses.dataclass
class PartitionNames:
    """One partition's names: in offset order, name -> offset (str and int only: a dict the
    garbage collector never scans), and sorted (made on first use, for suggestions)."""

    names: List[str]
    offsets: Dict[str, int]
    ordered: Optional[List[str]] = None

    def near(self, name: str) -> List[str]:
        """The names that sort next to `name` (a scan of millions of names per unknown one
        would stall the service)."""
        if self.ordered is None:
            self.ordered = sorted(self.names)
        at = bisect.bisect_left(self.ordered, name)
        return self.ordered[max(0, at - SUGGESTIONS // 2):at + SUGGESTIONS // 2]


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
        return PartitionNames(names, {n: i for i, n in enumerate(names)})

    def partitions(self, entity: str) -> range:
        return range(self.config.entities[entity].num_partitions)

    def names(self, entity: str) -> List[List[str]]:
        """The names of an entity type, per partition (all of them: mind the table's size)."""
        return [self.partition(entity, p).names for p in self.partitions(entity)]

    def name(self, entity: str, part: int, offset: int) -> str:
        return self.partition(entity, part).names[offset]

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
                offsets = self.partition(entity, part).offsets
                for name in [n for n in names if n in offsets]:
                    found[entity, name] = (part, offsets[name])
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
