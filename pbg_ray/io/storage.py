"""Where pbg_ray's files live: a local path, or a URI that pyarrow.fs understands.

    data/graph, /abs/graph                    a local directory (pathlib.Path)
    file:///abs/graph                         the same, spelled as a URI
    s3://bucket/graph                         Amazon S3 (credentials: the usual AWS chain)
    s3://bucket/graph?endpoint_override=host:9000&scheme=http
                                              an S3-compatible server (MinIO, Ceph, ...)
    gs://bucket/graph                         Google Cloud Storage

`storage_path` turns a config value into a pathlib.Path for local paths (every
local guarantee kept: rename-atomic writes, fsync, hard links, flock) or an
ObjectPath, which offers the part of pathlib's API pbg_ray uses. An ObjectPath's
str() is its full URI, query included, so it survives the trip to Ray workers
through the config and endpoint settings reach every task and actor.

Object stores have no rename, no append and no directories, so:
- a write goes to a local temporary file that is uploaded whole when complete
  (`uploading`); one object's upload is atomic, and a checkpoint version still
  becomes current only when checkpoint_version.txt is uploaded, after its files;
- appending rewrites the object (`append_text`); only small JSON-lines files are appended;
- HDF5 files are read in place through a buffered range reader (`open_h5`),
  so reading one edge chunk fetches only that chunk;
- a run's lock is an object holding its owner and a heartbeat (`ObjectLock`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple, Union
from urllib.parse import urlsplit, urlunsplit

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from pbg_ray.errors import PbgRayError

logger = logging.getLogger("pbg_ray")

READ_BUFFER_BYTES = 1 << 16  # HDF5 reads metadata in small pieces: one range request each
LOCK_TTL_S = 120.0  # a lock object whose heartbeat is older belongs to a dead run
LOCK_HEARTBEAT_S = 20.0


def is_uri(path: Union[str, os.PathLike, "ObjectPath"]) -> bool:
    return isinstance(path, ObjectPath) or (isinstance(path, str) and "://" in path)


@functools.lru_cache(maxsize=None)
def _filesystem(scheme: str, netloc: str, query: str) -> Tuple[pafs.FileSystem, str]:
    """(file system, its path of the URI's root) of one bucket and its options, made once
    per process: an S3 file system holds a client and its connections."""
    uri = urlunsplit((scheme, netloc, "/", query, ""))
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError) as err:
        raise PbgRayError(f"{uri!r} is not a location pyarrow.fs can open ({err}). Use a local "
                          "path or a URI such as s3://bucket/dir, gs://bucket/dir, file:///dir.") from None
    return fs, root.rstrip("/")


class ObjectPath:
    """A file or directory on a pyarrow file system, named by URI (see the module doc)."""

    __slots__ = ("scheme", "netloc", "key", "query")

    def __init__(self, uri: str) -> None:
        parts = urlsplit(uri)
        self.scheme, self.netloc, self.query = parts.scheme, parts.netloc, parts.query
        self.key = parts.path.strip("/")  # the path below the bucket, "" for its root

    @property
    def fs(self) -> pafs.FileSystem:
        return _filesystem(self.scheme, self.netloc, self.query)[0]

    @property
    def fs_path(self) -> str:
        """The path pyarrow's file system calls it (e.g. bucket/dir/file)."""
        root = _filesystem(self.scheme, self.netloc, self.query)[1]
        return f"{root}/{self.key}".rstrip("/") if root else f"/{self.key}"

    def __str__(self) -> str:
        return urlunsplit((self.scheme, self.netloc, "/" + self.key, self.query, ""))

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(self) == str(other)

    # Ordered by URI, also against local Paths (sorting a mix of both).
    def __lt__(self, other: object) -> bool:
        return str(self) < str(other)

    def __gt__(self, other: object) -> bool:
        return str(self) > str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    # --- names ------------------------------------------------------------

    def __truediv__(self, name: str) -> "ObjectPath":
        child = ObjectPath.__new__(ObjectPath)
        child.scheme, child.netloc, child.query = self.scheme, self.netloc, self.query
        child.key = f"{self.key}/{name}".strip("/")
        return child

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def absolute(self) -> "ObjectPath":
        return self  # a URI names one place wherever it is used

    resolve = absolute

    # --- queries ------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Storage failures other than a missing file become one clear line."""
        try:
            yield
        except FileNotFoundError:
            raise
        except OSError as err:
            raise PbgRayError(
                f"can't {action} {str(self)!r}: {err}. Check that the bucket exists, the "
                "credentials (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the node's "
                "role) and the URI's endpoint settings.") from None

    def _type(self) -> pafs.FileType:
        with self._errors("look up"):
            return self.fs.get_file_info(self.fs_path).type

    def exists(self) -> bool:
        return self._type() != pafs.FileType.NotFound

    def size(self) -> int:
        """The object's bytes."""
        with self._errors("look up"):
            return self.fs.get_file_info(self.fs_path).size

    def is_file(self) -> bool:
        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._type() == pafs.FileType.Directory

    def iterdir(self) -> Iterator["ObjectPath"]:
        with self._errors("list"):
            infos = self.fs.get_file_info(pafs.FileSelector(self.fs_path, allow_not_found=True))
        for info in sorted(infos, key=lambda i: i.path):
            yield self / info.base_name

    def glob(self, pattern: str) -> Iterator["ObjectPath"]:
        """Children whose name matches `pattern` (one level, as Path.glob without '/')."""
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    # --- reading and writing ---------------------------------------------------

    def read_bytes(self) -> bytes:
        with self._errors("read"), self.fs.open_input_stream(self.fs_path) as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open_random_access(self) -> io.BufferedReader:
        """A seekable binary reader that fetches ranges on demand."""
        with self._errors("open"):
            return io.BufferedReader(self.fs.open_input_file(self.fs_path), READ_BUFFER_BYTES)

    def upload(self, local: Path) -> None:
        """Replace this object with the content of a local file, in one upload."""
        with self._errors("write"), open(local, "rb") as src, \
                self.fs.open_output_stream(self.fs_path) as dst:
            shutil.copyfileobj(src, dst, 1 << 22)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        with self._errors("write"), self.fs.open_output_stream(self.fs_path) as f:
            f.write(text.encode(encoding))

    def copy_to(self, target: "ObjectPath") -> None:
        """Copy inside the store (S3 copies server-side)."""
        with self._errors("copy"):
            self.fs.copy_file(self.fs_path, target.fs_path)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            with self._errors("delete"):
                self.fs.delete_file(self.fs_path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: object stores have no directories, a key's prefix is one."""


StoragePath = Union[Path, ObjectPath]


def storage_path(path: Union[str, os.PathLike, ObjectPath]) -> StoragePath:
    """A config value as a Path (local paths and file:// URIs) or an ObjectPath."""
    if isinstance(path, (Path, ObjectPath)):
        return path
    path = os.fspath(path)
    if path.startswith("file://"):
        return Path(urlsplit(path).path)
    return ObjectPath(path) if is_uri(path) else Path(path)


def file_size(path: StoragePath) -> int:
    """Bytes of a file, local or stored."""
    if isinstance(path, ObjectPath):
        with path._errors("look up"):
            return path.fs.get_file_info(path.fs_path).size
    return os.path.getsize(path)


def join(base: str, name: str) -> str:
    """`base` (a path or URI, as in the config) / `name`, spelled as `base` is."""
    path = storage_path(base)
    return str(path / name) if isinstance(path, ObjectPath) else os.path.join(base, name)


def sibling(base: str, name: str) -> str:
    """The directory beside `base` (a path or URI, as in the config) named after it with
    `-name` appended (`runs/model` -> `runs/model-lr=0.1`), spelled as `base` is."""
    if is_uri(base):
        parts = urlsplit(base)
        return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}-{name}"))
    return f"{base.rstrip(os.sep)}-{name}"


@contextlib.contextmanager
def uploading(path: ObjectPath) -> Iterator[Path]:
    """Yield a local temporary path; once the block succeeds, its file is uploaded
    as `path`. On failure nothing is uploaded and the temporary file is removed."""
    scratch = Path(tempfile.mkdtemp(prefix="pbg_ray-upload-"))
    try:
        tmp = scratch / path.name
        yield tmp
        path.upload(tmp)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def move_into(local: Path, target: StoragePath) -> None:
    """Move a finished local file to `target`: a rename next to it, else an upload."""
    if isinstance(target, ObjectPath):
        target.upload(local)
        local.unlink()
    else:
        os.replace(local, target)


def replace(source: StoragePath, target: StoragePath) -> None:
    """Rename `source` to `target`, replacing it (an object store copies, then deletes)."""
    if isinstance(source, ObjectPath):
        source.copy_to(target)
        source.unlink()
    else:
        os.replace(source, target)


def link_or_copy(source: StoragePath, target: StoragePath) -> None:
    """Make `target` hold `source`'s content: a hard link where the file system
    allows (no bytes copied), else a copy."""
    target.unlink(missing_ok=True)
    if isinstance(source, ObjectPath):
        source.copy_to(target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def append_text(path: StoragePath, text: str) -> None:
    """Add `text` at the end of a text file (an object store rewrites the object)."""
    if isinstance(path, ObjectPath):
        try:
            old = path.read_text()
        except FileNotFoundError:
            old = ""
        path.write_text(old + text)
        return
    with open(path, "at", encoding="utf-8") as f:
        f.write(text)


class _ObjectH5File(h5py.File):
    """An HDF5 file read in place from object storage; `filename` is its URI."""

    def __init__(self, path: ObjectPath) -> None:
        self._stream = path.open_random_access()
        self._uri = str(path)
        try:
            super().__init__(self._stream, "r")
        except BaseException:
            self._stream.close()
            raise

    @property
    def filename(self) -> str:
        return self._uri

    def close(self) -> None:
        super().close()
        self._stream.close()


def open_h5(path: StoragePath) -> h5py.File:
    """An HDF5 file opened for reading. Raises OSError (h5py's) if it is not one."""
    if isinstance(path, ObjectPath):
        return _ObjectH5File(path)
    return h5py.File(path, "r")


# PBG's I/O format v1: the attribute every edge and checkpoint HDF5 file carries.
FORMAT_VERSION_ATTR = "format_version"
FORMAT_VERSION = 1


def dataset_kind(ds: h5py.Dataset) -> str:
    """numpy's kind of a dataset's values ("f", "i", "u", ...); "" for an HDF5 type that
    numpy has no equivalent of (a time type, say: a damaged or foreign file)."""
    try:
        return ds.dtype.kind
    except TypeError:
        return ""


def dataset_type(ds: h5py.Dataset) -> str:
    """A dataset's shape and type, for messages."""
    kind = dataset_kind(ds)
    return f"shape {ds.shape} dtype {ds.dtype if kind else 'without a numpy equivalent'}"


def open_v1_h5(path: StoragePath, what: str, if_missing: str, if_other_format: str,
               if_damaged: Callable[[], str]) -> h5py.File:
    """An edge or checkpoint HDF5 file of format v1, opened for reading. Refuses a missing,
    unreadable or other-format file with an error naming it, ending with the given fix
    (for a damaged one, what `if_damaged()` says)."""
    if not path.is_file():
        raise PbgRayError(f"{what} file {str(path)!r} is missing. {if_missing}")
    try:
        hf = open_h5(path)
    except OSError as err:
        raise PbgRayError(f"{what} file {str(path)!r} is not a readable HDF5 file: {err}. "
                          f"{if_damaged()}") from None
    version = hf.attrs.get(FORMAT_VERSION_ATTR)
    if version is None or np.ndim(version) != 0 or version != FORMAT_VERSION:
        hf.close()
        found = ("no format_version attribute" if version is None
                 else f"format_version={np.asarray(version).tolist()!r}")
        raise PbgRayError(f"{what} file {str(path)!r} has {found}; only format version "
                          f"{FORMAT_VERSION} is supported. {if_other_format}")
    return hf


class ObjectLock:
    """A lock for object storage, which has no flock: an object naming its holder,
    rewritten by a heartbeat thread while held. A crashed run's lock stops being
    renewed and is taken over once its heartbeat is LOCK_TTL_S old. Object stores
    keep the last write, so two runs starting within the same instant could both
    write it; the read-back after writing leaves one of them holding it."""

    def __init__(self, path: ObjectPath) -> None:
        self.path = path
        self.token = uuid.uuid4().hex
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _read(self) -> Optional[dict]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # unreadable: treat as stale
            return {}

    def _write(self) -> None:
        self.path.write_text(json.dumps(
            {"holder": self.holder, "token": self.token, "heartbeat": time.time()}))

    def acquire(self) -> Optional[str]:
        """Take the lock; if a live run holds it, return that run's description instead."""
        current = self._read()
        if current and current.get("token") != self.token:
            age = time.time() - float(current.get("heartbeat", 0))
            if age < LOCK_TTL_S:
                return (f"{current.get('holder', 'another process')}, heartbeat {age:.0f} s ago; "
                        f"a lock left by a dead run expires after {LOCK_TTL_S:.0f} s")
        self._write()
        won = self._read()
        if not won or won.get("token") != self.token:
            return (won or {}).get("holder", "another process")
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="pbg_ray lock")
        self._thread.start()
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                self._write()
            except Exception as err:  # a missed beat only shortens the lock's life
                logger.warning("lock heartbeat on %s failed: %s", self.path, err)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        current = self._read()
        if current and current.get("token") == self.token:
            self.path.unlink(missing_ok=True)

