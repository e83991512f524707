"""Plain data (dicts, lists, scalars from YAML, JSON or a PBG module), or the schema's
dataclasses themselves, into the schema's dataclasses, with errors that name the key; and
the type the schema gives a dotted key, for checking command-line overrides before Hydra
runs."""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from typing import Any, Dict, List, Union

from omegaconf import MISSING

from pbg_ray.errors import PbgRayError, did_you_mean


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> Dict[str, Any]:
    """The types of the dataclass `cls`'s fields by name, evaluated once a class (a config is
    converted whenever one is built)."""
    return typing.get_type_hints(cls)


def convert(value: Any, hint: Any, key: str, source: str) -> Any:
    where = f"{source}: {key or '<root>'}"
    origin = typing.get_origin(hint)
    if hint is Any:  # e.g. importer.lhs_col: a column index or a column name
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return convert(value, args[0], key, source)
    if dataclasses.is_dataclass(hint):
        return hint(**convert_fields(field_values(value, hint, key, source), hint, key, source))
    if value is None or (isinstance(value, str) and value == "???"):
        raise PbgRayError(f"{where}: a value is required. Set {key}=<value>.")
    if origin in (list, List):
        (item_hint,) = typing.get_args(hint)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            if item_hint is str and isinstance(value, str):
                return [value]  # edge_paths=path means a list of one path
            raise PbgRayError(f"{where}: expected a list, got {value!r}")
        return [convert(v, item_hint, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        _, item_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise PbgRayError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): convert(v, item_hint, f"{key}.{k}", source) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise PbgRayError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise PbgRayError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise PbgRayError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise PbgRayError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported type in schema: {hint!r}")  # a bug, not user input


def field_values(value: Any, cls: type, key: str, source: str) -> Dict[str, Any]:
    """The values by field name that `value`, an instance of the dataclass `cls` (at the
    dotted `key`) or a mapping, gives; a mapping's unknown keys and the required keys it
    leaves out are refused."""
    if isinstance(value, cls):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
    if not isinstance(value, dict):
        raise PbgRayError(f"{source}: {key or '<root>'}: expected a mapping, got {value!r}")
    for name in value:
        check_key(cls, key, name, source)
    for f in dataclasses.fields(cls):
        if (f.name not in value and f.default is MISSING
                and f.default_factory is dataclasses.MISSING):
            sub = f"{key}.{f.name}" if key else f.name
            raise PbgRayError(f"{source}: missing required key {sub!r}. Set {sub}=<value>.")
    return value


def convert_fields(values: Dict[str, Any], cls: type, key: str, source: str) -> Dict[str, Any]:
    """`values` (field name -> value, as field_values gives them) converted to the types of
    the fields of the dataclass `cls`, at the dotted `key`."""
    hints = field_types(cls)
    return {name: convert(item, hints[name], f"{key}.{name}" if key else name, source)
            for name, item in values.items()}


def check_key(cls: type, key: str, name: Any, source: str) -> None:
    """Refuse `name`, under the dotted `key` of type `cls`, unless it is one of its fields."""
    fields = [f.name for f in dataclasses.fields(cls)]
    if name not in fields:
        sub = f"{key}.{name}" if key else str(name)
        prefix = f"{key}." if key else ""
        raise PbgRayError(f"{source}: unknown key {sub!r}"
                          f"{did_you_mean(sub, [prefix + f for f in fields])}. "
                          f"Valid keys here: {', '.join(fields)}.")


def check_part(value: Any, hint: Any, key: str, source: str) -> None:
    """Refuse unknown keys and ill-typed values in part of a config (a config file that the
    command line or other files complete), as convert() does, without requiring any key.
    Values Hydra fills in later (`${...}`, `???`) are left to it."""
    if isinstance(value, str) and ("${" in value or value == "???"):
        return
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType) and value is not None:
        hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
        origin = typing.get_origin(hint)
    sub = lambda name: f"{key}.{name}" if key else str(name)  # noqa: E731
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        hints = field_types(hint)
        for name, item in value.items():
            check_key(hint, key, name, source)
            check_part(item, hints[name], sub(name), source)
    elif origin in (dict, Dict) and isinstance(value, dict):
        for name, item in value.items():
            check_part(item, typing.get_args(hint)[1], sub(name), source)
    elif origin in (list, List) and isinstance(value, list):
        for index, item in enumerate(value):
            check_part(item, typing.get_args(hint)[0], sub(index), source)
    else:
        convert(value, hint, key, source)


def schema_type(root: type, path: str, source: str = "command line") -> Any:
    """The type the schema gives a dotted key; refuses keys that don't exist
    (e.g. `lr` typed `lrr`) with the nearest valid name.

    Keys under `entities.<type>` may name any entity type; list items are
    addressed by index (`relations.0.operator`).
    """
    hint: Any = root
    done: List[str] = []
    for part in path.split("."):
        origin = typing.get_origin(hint)
        if origin in (Union, types.UnionType):
            hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
            origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            names = [f.name for f in dataclasses.fields(hint)]
            if part not in names:
                where, wrong = ".".join(done) or "the top level", ".".join(done + [part])
                raise PbgRayError(
                    f"{source}: unknown key {wrong!r}"
                    f"{did_you_mean(wrong, ['.'.join(done + [n]) for n in names])}. "
                    f"Valid keys at {where}: {', '.join(names)}.")
            hint = field_types(hint)[part]
        elif origin in (dict, Dict):
            hint = typing.get_args(hint)[1]
        elif origin in (list, List):
            if not part.isdigit():
                raise PbgRayError(f"{source}: {'.'.join(done)} is a list; address its items by "
                                  f"index (e.g. {'.'.join(done)}.0), not {part!r}.")
            hint = typing.get_args(hint)[0]
        else:
            raise PbgRayError(
                f"{source}: {'.'.join(done)!r} is a plain value and has no key {part!r}.")
        done.append(part)
    return hint


def check_value(root: type, path: str, value: Any, source: str = "command line") -> None:
    """Refuse a value of the wrong type for a dotted key (plain values only)."""
    hint = schema_type(root, path, source)
    if not dataclasses.is_dataclass(hint) and typing.get_origin(hint) not in (dict, Dict):
        convert(value, hint, path, source)
