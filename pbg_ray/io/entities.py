"""Entity counts and names per (type, partition), dynamic relation counts and names.

Layout (PBG v1), all inside `entity_path`:
  entity_count_{type}_{part}.txt   one integer
  entity_names_{type}_{part}.json  a JSON list of names, index = offset in the partition
  dynamic_rel_count.txt            one integer (dynamic relations mode)
  dynamic_rel_names.json           a JSON list of relation names
"""

from __future__ import annotations

import json
from typing import Dict, List

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.files import PathLike, write_text_atomic
from pbg_ray.io.storage import ObjectPath, StoragePath, storage_path
from pbg_ray.types import EntityName, Partition


def entity_count_file(entity_path: PathLike, entity: EntityName, part: Partition) -> StoragePath:
    return storage_path(entity_path) / f"entity_count_{entity}_{part}.txt"


def entity_names_file(entity_path: PathLike, entity: EntityName, part: Partition) -> StoragePath:
    return storage_path(entity_path) / f"entity_names_{entity}_{part}.json"


def dynamic_rel_count_file(entity_path: PathLike) -> StoragePath:
    return storage_path(entity_path) / "dynamic_rel_count.txt"


def dynamic_rel_names_file(entity_path: PathLike) -> StoragePath:
    return storage_path(entity_path) / "dynamic_rel_names.json"


def _save_count(path: StoragePath, count: int) -> None:
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    write_text_atomic(path, f"{count}\n")


def _load_count(path: StoragePath, what: str) -> int:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise PbgRayError(f"{what} file {str(path)!r} is missing. Run the importer "
                          "(python -m pbg_ray.import_edges) or check entity_path.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PbgRayError(f"{what} file {str(path)!r} can't be read: {err}") from None
    try:
        count = int(text)
    except ValueError:
        raise PbgRayError(f"{what} file {str(path)!r} must hold one integer, "
                          f"found {text[:40]!r}. Rewrite it with the count.") from None
    if count < 0:
        raise PbgRayError(f"{what} file {str(path)!r} holds a negative count ({count}). "
                          "Rewrite it with the number of entities.")
    return count


def _save_names(path: StoragePath, names: List[str]) -> None:
    # json.dumps then one write: json.dump makes a write call per name.
    write_text_atomic(path, json.dumps(names))


def _missing(path: StoragePath, what: str) -> PbgRayError:
    return PbgRayError(f"{what} file {str(path)!r} is missing. The importer writes it; "
                       "check entity_path.")


def _load_names(path: StoragePath, what: str) -> List[str]:
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _missing(path, what) from None
    except (OSError, ValueError) as err:
        raise PbgRayError(f"{what} file {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(names, list):
        raise PbgRayError(f"{what} file {str(path)!r} must hold a JSON list of names.")
    return names


def save_entity_count(entity_path: PathLike, entity: EntityName, part: Partition, count: int) -> None:
    _save_count(entity_count_file(entity_path, entity, part), count)


def load_entity_count(entity_path: PathLike, entity: EntityName, part: Partition) -> int:
    return _load_count(entity_count_file(entity_path, entity, part), "entity count")


def save_entity_names(entity_path: PathLike, entity: EntityName, part: Partition,
                      names: List[str]) -> None:
    _save_names(entity_names_file(entity_path, entity, part), names)


def load_entity_names(entity_path: PathLike, entity: EntityName, part: Partition) -> List[str]:
    return _load_names(entity_names_file(entity_path, entity, part), "entity names")


def entity_names_bytes(entity_path: PathLike, entity: EntityName, part: Partition) -> int:
    """The size of a partition's names file (missing: load_entity_names's error)."""
    path = entity_names_file(entity_path, entity, part)
    if not path.exists():
        raise _missing(path, "entity names")
    return path.size() if isinstance(path, ObjectPath) else path.stat().st_size


def save_dynamic_rel_count(entity_path: PathLike, count: int) -> None:
    _save_count(dynamic_rel_count_file(entity_path), count)


def load_dynamic_rel_count(entity_path: PathLike) -> int:
    return _load_count(dynamic_rel_count_file(entity_path), "dynamic relation count")


def save_relation_names(entity_path: PathLike, names: List[str]) -> None:
    _save_names(dynamic_rel_names_file(entity_path), names)


def load_relation_names(entity_path: PathLike) -> List[str]:
    return _load_names(dynamic_rel_names_file(entity_path), "relation names")


def load_entity_counts(config: ConfigSchema) -> Dict[EntityName, List[int]]:
    """Counts of every partition of every entity type: {type: [count per partition]}."""
    return {
        entity: [load_entity_count(config.entity_path, entity, part)
                 for part in range(econf.num_partitions)]
        for entity, econf in config.entities.items()
    }


def num_relation_ids(config: ConfigSchema) -> int:
    """How many relation ids edges may use: the config's relations, or the
    dynamic count from entity_path in dynamic mode."""
    if config.dynamic_relations:
        return load_dynamic_rel_count(config.entity_path)
    return len(config.relations)
