"""Atomic file and directory writes: a reader sees the old one or the complete new one."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Union

from pbg_ray.errors import PbgRayError
from pbg_ray.io.storage import ObjectPath, storage_path, uploading

# A local path or a URI that pyarrow.fs understands (see io/storage.py).
PathLike = Union[str, os.PathLike, ObjectPath]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`.

    The parent directory is created if needed. The data is fsync'ed before the rename,
    so after a crash `path` holds either its previous content or the complete new one.
    On failure the
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
        sync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# What h5py and json raise for a file whose bytes are damaged (cut short, overwritten):
# reported as a PbgRayError by `reading`.
DAMAGED_FILE_ERRORS = (OSError, RuntimeError, KeyError, ValueError)


def restore_it() -> str:
    return "Restore it from a copy or write it again."


@contextlib.contextmanager
def reading(path: PathLike, what: str, fix: Callable[[], str] = restore_it) -> Iterator[None]:
    """Report a library's error while reading `path` (its bytes are damaged) as a
    PbgRayError naming the file and what `fix()` says; the project's own errors and a
    missing file (which callers report in their words) pass unchanged."""
    try:
        yield
    except (PbgRayError, FileNotFoundError):
        raise
    except DAMAGED_FILE_ERRORS as err:
        raise PbgRayError(f"{what} file {str(path)!r} is damaged and can't be read "
                          f"({type(err).__name__}: {err}). {fix()}") from None


def write_failed(path: PathLike, err: OSError) -> PbgRayError:
    """The error for a write of `path` that failed (disk full, quota, file size limit,
    permissions)."""
    return PbgRayError(f"writing {str(path)!r} failed: {err.strerror or err}. Its previous "
                       "content (if any) is unchanged; free disk space or fix the cause and rerun.")


def write_bytes_atomic(path: PathLike, *data) -> None:
    """Write the `data` buffers (bytes, memoryviews, ...) one after another as `path`,
    atomically; a failed write raises `write_failed`'s PbgRayError and leaves `path` as
    it was."""
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                for part in data:
                    f.write(part)
    except OSError as err:
        raise write_failed(path, err) from None


def write_bytes_in_place(path: PathLike, *data) -> None:
    """Write the `data` buffers as `path` over its own bytes: an existing local file keeps
    its blocks, so nothing is allocated (nor freed, which on a disk mounted with online
    discard waits for the device), and its cached pages are simply overwritten. Neither atomic
    nor fsync'ed (`sync_file` does that later): for files nothing reads before the write
    succeeded. On object storage it is an upload. A failed write raises `write_failed`'s
    PbgRayError."""
    path = storage_path(path)
    if isinstance(path, ObjectPath):
        write_bytes_atomic(path, *data)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            offset = 0
            for part in data:
                view = memoryview(part).cast("B")
                while view:  # a write may take only part of a large buffer
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
            os.ftruncate(fd, offset)
        finally:
            os.close(fd)
    except OSError as err:
        raise write_failed(path, err) from None


def sync_file(path: PathLike) -> None:
    """fsync a local file (an upload is whole already)."""
    path = storage_path(path)
    if isinstance(path, ObjectPath):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
