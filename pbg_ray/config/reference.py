"""The key reference, generated from the schema's help texts: docs/configuration.md
(`python -m pbg_ray.config.reference > docs/configuration.md`) and the commands' `--help`.

A test fails when docs/configuration.md differs from what this prints, so the file never
goes stale.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import typing
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

from omegaconf import MISSING

from pbg_ray.config.options import help_of
from pbg_ray.config.schema import ConfigSchema, EntitySchema, RelationSchema

REGENERATE = "python -m pbg_ray.config.reference > docs/configuration.md"
# Where --help sends a user for every key.
REFERENCE = ("every key with its type, default and meaning: docs/configuration.md\n"
             "  (python -m pbg_ray.config.reference prints it)")
KEY_COLUMN = 36  # where a key's meaning starts in --help
# (title, prefix of its keys, dataclass); the PBG keys are ConfigSchema's plain fields.
SECTIONS: List[Tuple[str, str, type]] = [
    ("PBG keys", "", ConfigSchema),
    ("Entity types: entities.<name>.*", "entities.<name>.", EntitySchema),
    ("Relation types: relations.<index>.*", "relations.<index>.", RelationSchema),
] + [(f"`{f.name}` section", f"{f.name}.", f.default_factory)
     for f in dataclasses.fields(ConfigSchema) if dataclasses.is_dataclass(f.default_factory)]


def type_name(hint: Any) -> str:
    """int, float, str, bool, list[str], ... as a user writes them (`?`: null is allowed)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return type_name(inner[0]) + ("?" if len(inner) < len(args) else "")
    if origin in (list, List):
        return f"list[{type_name(args[0])}]"
    if origin in (dict, typing.Dict):
        return "mapping"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def default_text(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        return f"`{json.dumps(field.default_factory())}`"
    return "required" if field.default is MISSING else f"`{json.dumps(field.default)}`"


def rows(cls: type, prefix: str) -> Iterator[Tuple[str, str, str, str]]:
    """(key, type, default, help) of a section's fields; sections of their own are left out."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(field.default_factory):
            yield (prefix + field.name, type_name(hints[field.name]), default_text(field),
                   help_of(field))


def section_table(title: str, prefix: str, cls: type) -> str:
    """A section's table of keys."""
    lines = [f"## {title}", "", (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
             "", "| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | {d} | {h.replace('|', '/')} |" for k, t, d, h in rows(cls, prefix)]
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The reference of every section."""
    return "\n".join(section_table(title, prefix, cls) for title, prefix, cls in SECTIONS)


def key_help(picks: Sequence[str], width: int = 100,
             defaults: Optional[Mapping[str, str]] = None) -> str:
    """The keys of `picks` (single keys, or sections by their prefix: "ray.") with their
    meanings and defaults, as a command's --help lists its options; `defaults`: key ->
    what to say of its default instead of the schema's ("Default: 8 (tune=asha).")."""
    every = [row for _, prefix, cls in SECTIONS for row in rows(cls, prefix)]
    chosen = [row for pick in picks for row in every
              if row[0] == pick or (pick.endswith(".") and row[0].startswith(pick))]
    lines = []
    for key, _, default, meaning in chosen:
        default = default.strip("`")
        said = (defaults or {}).get(key) or (
            f"Default: {default}." if default != "required" else "Required.")
        text = f"{meaning} {said}"
        wrapped = textwrap.wrap(text, width - KEY_COLUMN)
        first = f"  {key}".ljust(KEY_COLUMN)
        if len(key) + 4 > KEY_COLUMN:  # a long key: its meaning on the next lines
            lines.append(f"  {key}")
            first = " " * KEY_COLUMN
        lines += [first + wrapped[0]] + [" " * KEY_COLUMN + line for line in wrapped[1:]]
    return "\n".join(lines)


def document() -> str:
    return (
        "# Configuration keys\n\n"
        "Every key pbg_ray reads, with its type, default and meaning. PBG's keys keep their "
        "names and meanings, so a PyTorch-BigGraph config file carries over; pbg_ray's own "
        "settings live in sections. Set a key in a PBG config file, in a YAML file of "
        "conf/, or on the command line (`lr=0.05`, `ray.placement=disk`); `python -m "
        "pbg_ray.<command> --help` prints the keys a command reads.\n\n"
        f"Generated from the schema's help texts (pbg_ray/config/); regenerate with "
        f"`{REGENERATE}`.\n\n" + markdown())


if __name__ == "__main__":
    print(document(), end="")
