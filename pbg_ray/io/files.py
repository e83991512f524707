"""Atomic file and directory writes: a reader sees the old one or the complete new one."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Union

from pbg_ray.errors import PbgRayError
from pbg_ray.io.storage import ObjectPath, storage_path, uploading

# A local path or a URI that pyarrow.fs understands (see io/storage.py).
PathLike = Union[str, os.PathLike, ObjectPath]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`.

    The parent directory is created if needed. The data is fsync'ed before the rename, so after a crash `path` holds
    either its previous content or the complete new one. On failure the
    temporary file is removed and nothing at `path` changes. On object storage the
    temporary file is local and uploaded whole on success.
    """
    path = storage_path(path)
    if isinstance(path, ObjectPath):
        with uploading(path) as tmp:
            yield tmp
        return
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


# What h5py and json raise for a file whose bytes are damaged (cut short, overwritten):
# reported as a PbgRayError by `reading`.
DAMAGED_FILE_ERRORS = (OSError, RuntimeError, KeyError, ValueError)


@contextlib.contextmanager
def reading(path: PathLike, what: str) -> Iterator[None]:
    """Report a library's error while reading `path` (its bytes are damaged) as a
    PbgRayError naming the file; the project's own errors and a missing file (which
    callers report in their words) pass unchanged."""
    try:
        yield
    except (PbgRayError, FileNotFoundError):
        raise
    except DAMAGED_FILE_ERRORS as err:
        raise PbgRayError(f"{what} file {str(path)!r} is damaged and can't be read "
                          f"({type(err).__name__}: {err}). Restore it from a copy or write it "
                          "again.") from None


def write_failed(path: PathLike, err: OSError) -> PbgRayError:
    """The error for a write of `path` that failed (disk full, quota, file size limit,
    permissions)."""
    return PbgRayError(f"writing {str(path)!r} failed: {err.strerror or err}. Its previous "
                       "content (if any) is unchanged; free disk space or fix the cause and rerun.")


def write_bytes_atomic(path: PathLike, data) -> None:
    """Write `data` (bytes or a buffer) as `path`, atomically; a failed write raises
    `write_failed`'s PbgRayError and leaves `path` as it was."""
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
    except OSError as err:
        raise write_failed(path, err) from None


def write_text_atomic(path: PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


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
