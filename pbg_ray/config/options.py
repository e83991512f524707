"""`option()`: a config field with its help text, as PBG's schema gives each field one; and
the checks every section's `validate(fail)` uses.

The help text is the field's documentation everywhere: `--help` of the commands and the
generated key reference (docs/configuration.md, `python -m pbg_ray.config.reference`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union
from urllib.parse import parse_qs, urlsplit

from pbg_ray.errors import did_you_mean

HELP = "help"
# pyarrow's S3 URI options that hold secrets.
CREDENTIAL_KEYS = {"access_key", "secret_key", "session_token"}
CREDENTIALS_FIX = ("Remove them from the URI and set them in the environment (e.g. "
                   "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the node's role).")
# fail(key, problem, fix) raises the PbgRayError that names the config source and the key.
Fail = Callable[[str, str, str], None]


def option(default: Any = dataclasses.MISSING, *, help: str,
           factory: Optional[Callable[[], Any]] = None) -> Any:
    """A dataclass field with `help`; `factory` for mutable defaults (lists, dicts)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={HELP: help})
    return dataclasses.field(default=default, metadata={HELP: help})


def help_of(field: dataclasses.Field) -> str:
    return field.metadata.get(HELP, "")


def check_positive(value: Union[int, float], key: str, fail: Fail) -> None:
    if value <= 0:
        fail(key, f"must be positive, got {value}", f"Set {key} to a value above 0.")


def check_not_negative(value: Union[int, float], key: str, fail: Fail) -> None:
    if value < 0:
        fail(key, f"must not be negative, got {value}", f"Set {key} to 0 or more.")


def check_choice(value: str, choices: Sequence[str], key: str, fail: Fail) -> None:
    if value not in choices:
        fail(key, f"unknown value {value!r}{did_you_mean(value, choices)}",
             f"Valid values: {', '.join(choices)}.")


def carries_credentials(location: str) -> bool:
    """Whether a path or URI holds a password or a secret in its query (s3://b/x?secret_key=)."""
    if "://" not in location:
        return False
    parts = urlsplit(location)
    return bool(parts.password or CREDENTIAL_KEYS & set(parse_qs(parts.query)))


def check_no_credentials(location: Optional[str], key: str, fail: Fail) -> None:
    """A storage location in the config never carries credentials: config.json, manifests,
    logs and stats would keep them."""
    if location and carries_credentials(location):
        fail(key, "the URI carries credentials, which config.json, manifests and logs would "
             "keep", CREDENTIALS_FIX)
