"""The one exception type for mistakes a user can make and fix."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional, Tuple, Type, Union


class PbgRayError(Exception):
    """Bad input (config, files, CLI arguments): the message names the key,
    file or value at fault and says how to fix it."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest candidate, or '' if none is near."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def in_chain(err: Optional[BaseException],
             types: Union[Type[BaseException], Tuple[Type[BaseException], ...]]
             ) -> Optional[BaseException]:
    """The first exception of `types` among `err` and what it wraps: a Ray task's error's
    `cause`, else the exception it was raised from."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, types):
            return err
        seen.add(id(err))
        err = getattr(err, "cause", None) or err.__cause__
    return None
