"""`option()`: a config field with its help text, as PBG's schema gives each field one, the
check of its value and whether it is a storage location; the checks fields declare; and
`check_fields`, which runs every check a config's fields declare.

The help text is the field's documentation everywhere: `--help` of the commands and the
generated key reference (docs/configuration.md, `python -m pbg_ray.config.reference`).
A check is called as `check(value, key, fail)` and calls `fail(key, problem, fix)` when the
value breaks its rule; a value of None (an optional key left unset) is never checked.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union
from urllib.parse import parse_qs, urlsplit

from pbg_ray.config.convert import field_types
from pbg_ray.errors import did_you_mean

HELP, CHECK, LOCATION = "help", "check", "location"
# pyarrow's S3 URI options that hold secrets.
CREDENTIAL_KEYS = {"access_key", "secret_key", "session_token"}
CREDENTIALS_FIX = ("Remove them from the URI and set them in the environment (e.g. "
                   "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the node's role).")
# fail(key, problem, fix) raises the PbgRayError that names the config source and the key.
Fail = Callable[[str, str, str], None]
# check(value, key, fail): calls fail when the value of the field `key` breaks the rule.
Check = Callable[[Any, str, Fail], None]


def option(default: Any = dataclasses.MISSING, *, help: str,
           factory: Optional[Callable[[], Any]] = None, check: Optional[Check] = None,
           location: bool = False) -> Any:
    """A dataclass field with `help`; `factory` for mutable defaults (lists, dicts); `check`
    the rule its value keeps; `location`: a path or URI (or a list of them) where data is
    read or written, made absolute for Ray's workers and refused when it carries
    credentials."""
    metadata = {HELP: help, CHECK: check, LOCATION: location}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(field: dataclasses.Field) -> str:
    return field.metadata.get(HELP, "")


@dataclass(frozen=True)
class Bounds:
    """A check: the number lies between `low` and `high` (each allowed itself unless
    `low_open` / `high_open`). `rule` words it for the message ("must be positive"), `fix`
    says what to set, `{key}` standing for the field's key."""

    rule: str
    fix: str
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __call__(self, value: float, key: str, fail: Fail) -> None:
        above_low = value > self.low or (value == self.low and not self.low_open)
        below_high = value < self.high or (value == self.high and not self.high_open)
        if not (above_low and below_high):
            fail(key, f"{self.rule}, got {value}", self.fix.format(key=key))

    def with_fix(self, fix: str) -> "Bounds":
        """The same bounds, with a fix of the field's own words."""
        return dataclasses.replace(self, fix=fix)


positive = Bounds("must be positive", "Set {key} to a value above 0.", low=0, low_open=True)
not_negative = Bounds("must not be negative", "Set {key} to 0 or more.", low=0)
tcp_port = Bounds("must be a TCP port (1 to 65535)", "Set {key}=8000 or another free port.",
              low=1, high=65535)


def one_of(choices: Sequence[str]) -> Check:
    """A check: the value is one of `choices`."""

    def check(value: str, key: str, fail: Fail) -> None:
        if value not in choices:
            fail(key, f"unknown value {value!r}{did_you_mean(value, choices)}",
                 f"Valid values: {', '.join(choices)}.")
    return check


def each(item_check: Check) -> Check:
    """A check of a list: every item passes `item_check`."""

    def check(values: Sequence[Any], key: str, fail: Fail) -> None:
        for value in values:
            item_check(value, key, fail)
    return check


def required(problem: str, fix: str) -> Check:
    """A check: the value is not empty ("", [], {}); `{key}` in `fix` stands for the key."""

    def check(value: Any, key: str, fail: Fail) -> None:
        if not value:
            fail(key, problem, fix.format(key=key))
    return check


def carries_credentials(location: str) -> bool:
    """Whether a path or URI holds a password or a secret in its query (s3://b/x?secret_key=)."""
    if "://" not in location:
        return False
    parts = urlsplit(location)
    return bool(parts.password or CREDENTIAL_KEYS & set(parse_qs(parts.query)))


def check_no_credentials(location: Union[None, str, List[str]], key: str, fail: Fail) -> None:
    """A storage location in the config (or each of a list's, `key[index]`) never carries
    credentials: config.json, manifests, logs and stats would keep them."""
    if isinstance(location, list):
        for index, path in enumerate(location):
            check_no_credentials(path, f"{key}[{index}]", fail)
    elif location and carries_credentials(location):
        fail(key, "the URI carries credentials, which config.json, manifests and logs would "
             "keep", CREDENTIALS_FIX)


def check_fields(obj: Any, prefix: str, fail: Fail) -> None:
    """Run the checks the fields of the dataclass `obj` declare, and refuse credentials in
    its storage locations; then the same for its sections, the dataclasses of its mappings
    (entities) and those of its lists (relations). A field's key is `prefix` and its name;
    a section's fields' `<key>.<field>`, a mapping's `<key>.<name>.<field>`, a list's
    `<key>[<index>].<field>`."""
    for field in dataclasses.fields(obj):
        key, value = prefix + field.name, getattr(obj, field.name)
        if value is None:
            continue
        if field.metadata.get(CHECK):
            field.metadata[CHECK](value, key, fail)
        if field.metadata.get(LOCATION):
            check_no_credentials(value, key, fail)
        for item_key, item in _sections(key, value):
            check_fields(item, f"{item_key}.", fail)


def _sections(key: str, value: Any) -> Iterator[Tuple[str, Any]]:
    """(key, dataclass) of a field's value: itself, or the items of its mapping or list."""
    if dataclasses.is_dataclass(value):
        yield key, value
    elif isinstance(value, dict):
        yield from ((f"{key}.{name}", item) for name, item in value.items()
                    if dataclasses.is_dataclass(item))
    elif isinstance(value, list):
        yield from ((f"{key}[{index}]", item) for index, item in enumerate(value)
                    if dataclasses.is_dataclass(item))


def storage_locations(cls: type, prefix: str = "") -> Iterator[str]:
    """The keys of the storage locations (`option(location=True)`) of the dataclass `cls`
    and its sections."""
    hints = field_types(cls)
    for field in dataclasses.fields(cls):
        if field.metadata.get(LOCATION):
            yield prefix + field.name
        elif dataclasses.is_dataclass(hints[field.name]):
            yield from storage_locations(hints[field.name], f"{prefix}{field.name}.")
