"""Atomic file and directory writes: a reader sees the old one or the complete new one."""

from __future__ import annotations

import contextlib
import os
import shutil
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


@contextlib.contextmanager
def atomic_directory(path: PathLike) -> Iterator[Path]:
    """Yield an empty staging directory next to `path`; on success it is renamed to `path`
    (which must be absent or an empty directory), on failure removed. Readers never see
    a half-written `path`."""
    path = Path(path)
    # Not ".tmp-": cleaners of leftover temporary *files* (CheckpointStorage) skip it.
    stage = path.with_name(f".{path.name}.staging-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)  # left by a killed earlier attempt of this pid
    stage.mkdir(parents=True)
    try:
        yield stage
        os.rename(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
