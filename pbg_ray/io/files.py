"""Atomic file writes: a reader sees the old file or the complete new one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, os.PathLike]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`.

    The parent directory is created if needed. The data is fsync'ed before the rename, so after a crash `path` holds
    either its previous content or the complete new one. On failure the
    temporary file is removed and nothing at `path` changes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
