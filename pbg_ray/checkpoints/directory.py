"""Checkpoints in PBG's v1 layout, written so that a crash never leaves a bad one.

Inside `checkpoint_path`:
  checkpoint_version.txt           the newest complete version N (written last)
  config.json                      the run's config
  model.vN.h5                      group `model`: relations/{idx}/operator/{side}/{param}
                                   and entities/{type}/global_embedding, each dataset
                                   with its `state_dict_key`; optional optimizer/state_dict
  embeddings_{type}_{part}.vN.h5   float32 `embeddings` [N, dim] + optimizer/state_dict
  training_stats.json              one JSON object per line
  epoch_{k}/                       preserved versions (checkpoint_preservation_interval)
  best/                            the version best on validation (validation.edge_paths)

Every file is written under a temporary name and renamed; version N+1 becomes
current only when checkpoint_version.txt is replaced, after all its files exist.
Optimizer state blobs are state dicts in torch.save's format, as torchbiggraph writes
them, so either program resumes the other's run (torch_format.py reads and writes them
without torch: tensors are numpy arrays here).

This is the file layer: the rest of pbg_ray reaches it through CheckpointManager
(manager.py), which owns one and speaks in versions.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import h5py
import numpy as np

from pbg_ray.checkpoints import torch_format
from pbg_ray.checkpoints.position import Position
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.files import (
    PathLike, reading, write_bytes_atomic, write_bytes_in_place, write_failed, write_text_atomic)
from pbg_ray.io.storage import (
    FORMAT_VERSION, FORMAT_VERSION_ATTR, ObjectLock, ObjectPath, StoragePath, append_text,
    dataset_kind, dataset_type, link_or_copy, open_v1_h5, storage_path)
from pbg_ray.types import EntityName, Partition

STATE_DICT_KEY_ATTR = "state_dict_key"
EMBEDDING_DATASET = "embeddings"
MODEL_STATE_DICT_GROUP = "model"
OPTIMIZER_STATE_DICT_DATASET = "optimizer/state_dict"
VERSION_FILE = "checkpoint_version.txt"
CONFIG_FILE = "config.json"
STATS_FILE = "training_stats.json"
BEST_DIR = "best"
LOCK_FILE = ".pbg_ray.lock"
_VERSIONED_FILE = re.compile(r".*\.v(\d+)\.h5")

# Public dataset names <-> PBG's model state dict keys ("private" names).
_NAME_TEMPLATES = [
    ("relations/{idx}/operator/{side}/{param}", "{side}_operators.{idx}.{param}"),
    ("entities/{type}/global_embedding", "global_embs.emb_{type}"),
]


def _rename(name: str, source: int, target: int) -> Optional[str]:
    """`name` matched against the templates at index `source`, written with those at `target`."""
    for templates in _NAME_TEMPLATES:
        pieces = re.split(r"\{(\w+)\}", templates[source])
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^./]+)"
                        for i, p in enumerate(pieces))
        match = re.fullmatch(regex, name)
        if match:
            return templates[target].format(**match.groupdict())
    return None


def state_dict_key(public_name: str) -> str:
    """The torchbiggraph model state dict key of a public parameter name."""
    key = _rename(public_name, 0, 1)
    if key is None:
        raise ValueError(f"not a model parameter name: {public_name!r}")
    return key


def public_name(private_key: str) -> Optional[str]:
    """The public parameter name of a torchbiggraph model state dict key (None if it is
    not one, e.g. an entity embedding)."""
    return _rename(private_key, 1, 0)


def serialize_optim_state(state: Optional[Mapping[str, Any]]) -> Optional[bytes]:
    return None if state is None else torch_format.dumps(state)


def deserialize_optim_state(blob: Optional[bytes], where: str) -> Optional[Dict[str, Any]]:
    if blob is None:
        return None
    try:
        return torch_format.loads(blob)
    except Exception as err:  # noqa: BLE001  whatever is wrong with the bytes, name the file
        raise PbgRayError(f"{where}: the optimizer state blob can't be read ({err}). "
                          "The file is damaged; restore it or start from an earlier version.") from None


def row_adagrad_state(sums: np.ndarray, lr: float, step: int = 0) -> Dict[str, Any]:
    """PBG's RowAdagrad state dict for one partition: one accumulator per row. sums: [N]."""
    return {
        "state": {0: {"step": step, "sum": np.asarray(sums, np.float32)}},
        "param_groups": [{"lr": lr, "lr_decay": 0, "weight_decay": 0, "params": [0]}],
    }


def row_adagrad_sums(state: Optional[Mapping[str, Any]], num_rows: int, where: str) -> Optional[np.ndarray]:
    """The [num_rows] accumulator out of a RowAdagrad state dict (None if there is none)."""
    if state is None:
        return None
    try:
        sums = state["state"][0]["sum"]
    except (KeyError, TypeError, IndexError):
        # An optimizer that never stepped has no per-parameter state yet.
        if isinstance(state, Mapping) and state.get("state") == {}:
            return None
        raise PbgRayError(f"{where}: optimizer state is not a RowAdagrad state dict.") from None
    sums = np.asarray(sums)
    if sums.shape != (num_rows,):
        raise PbgRayError(f"{where}: optimizer state has shape {sums.shape}, expected "
                          f"({num_rows},) for {num_rows} embeddings.")
    return sums.astype(np.float32, copy=False)


def checkpoint_metadata(config: ConfigSchema, position: Position) -> Dict[str, Any]:
    """The top-level attributes of a checkpoint's files written after the pass at
    `position` (PBG's: the config as JSON and where in the loop the pass was)."""
    return {"config/json": json.dumps(config.to_dict()), **position.attributes(),
            "iteration/edge_path": config.edge_paths[position.edge_path_idx]}


def recovery(damaged: StoragePath) -> str:
    """How to go on from a damaged file of a checkpoint version: the complete versions its
    checkpoint keeps in epoch_{k}/ (checkpoint_preservation_interval), to read or to start
    a run from, or training again."""
    directory = damaged.parent
    root = directory.parent if directory.name.startswith("epoch_") else directory
    kept = {}
    for snapshot in sorted(root.glob("epoch_*")):
        try:
            kept[snapshot] = int(CheckpointStorage(snapshot).version_file().read_text())
        except (OSError, ValueError):
            continue  # not a complete snapshot
    match = _VERSIONED_FILE.fullmatch(damaged.name)
    kept = {path: v for path, v in kept.items() if match is None or v != int(match.group(1))}
    if not kept:
        return (f"No other version of {str(root)!r} is kept (checkpoint_preservation_interval "
                "keeps one every so many epochs): train again, from init_path if another "
                "checkpoint has the model.")
    newest = max(kept, key=kept.get)
    return (f"Versions kept in epoch_*/ of {str(root)!r}: {sorted(kept.values())}. Read one "
            "(eval.version, export.version, serve.version, predict --version), or start a "
            f"run from one (init_path={str(newest)!r}); else train again.")


class CheckpointStorage:
    """Reads and writes one checkpoint directory (a local path or a URI, see io/storage.py)."""

    def __init__(self, path: PathLike) -> None:
        self.path = storage_path(path).absolute()

    # --- file names -----------------------------------------------------

    def version_file(self, path: Optional[StoragePath] = None) -> StoragePath:
        return (path or self.path) / VERSION_FILE

    def config_file(self, path: Optional[StoragePath] = None) -> StoragePath:
        return (path or self.path) / CONFIG_FILE

    def stats_file(self) -> StoragePath:
        return self.path / STATS_FILE

    def model_file(self, version: int, path: Optional[StoragePath] = None) -> StoragePath:
        return (path or self.path) / f"model.v{version}.h5"

    def partition_file(self, version: int, entity: EntityName, part: Partition,
                       path: Optional[StoragePath] = None) -> StoragePath:
        return (path or self.path) / f"embeddings_{entity}_{part}.v{version}.h5"

    def snapshot_path(self, epoch_idx: int) -> StoragePath:
        return self.path / f"epoch_{epoch_idx}"

    def best_path(self) -> StoragePath:
        return self.path / BEST_DIR

    def version_files(self, version: int, config: ConfigSchema) -> List[StoragePath]:
        """Every file that version `version` of this config consists of."""
        files = [self.model_file(version)]
        for entity, econf in config.entities.items():
            files += [self.partition_file(version, entity, part) for part in range(econf.num_partitions)]
        return files

    # --- version --------------------------------------------------------

    def prepare(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def _refuse_lock(self, holder: str) -> None:
        raise PbgRayError(
            f"checkpoint_path {str(self.path)!r} is in use by another training run "
            f"({holder}). Wait for it to finish, or use another checkpoint_path.") from None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold this directory for one training run. The lock is an flock, which
        the kernel drops when its process dies, so a crashed run's leftover lock
        file never blocks the next run. On object storage it is an ObjectLock,
        which a crashed run's heartbeat stops renewing."""
        if isinstance(self.path, ObjectPath):
            self.prepare()
            lock = ObjectLock(self.path / LOCK_FILE)
            holder = lock.acquire()
            if holder is not None:
                self._refuse_lock(holder)
            try:
                yield
            finally:
                lock.release()
            return
        created = not self.path.exists()
        self.prepare()
        lock_file = self.path / LOCK_FILE
        with open(lock_file, "a+") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                self._refuse_lock(f.read().strip() or "another process")
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
            f.flush()
            try:
                yield
            finally:
                # A run that made the directory and wrote nothing leaves none behind
                # (removed while still locked, so no other run holds this lock file).
                if created and [p.name for p in self.path.iterdir()] == [LOCK_FILE]:
                    lock_file.unlink()
                    self.path.rmdir()
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def remove_leftovers(self, version: int) -> None:
        """Delete what an interrupted run may have left: temporary files and the
        files of versions other than the current one (half-written next
        versions, or a previous version not yet dropped)."""
        for path in self.path.iterdir():
            match = _VERSIONED_FILE.fullmatch(path.name)
            if path.name.startswith(".") and ".tmp-" in path.name:
                path.unlink(missing_ok=True)
            elif match and int(match.group(1)) != version:
                path.unlink(missing_ok=True)

    def load_version(self) -> int:
        """The newest complete version, 0 if there is none yet."""
        try:
            text = self.version_file().read_text().strip()
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as err:
            raise PbgRayError(f"{str(self.version_file())!r} can't be read ({err}). Write the "
                              "newest complete version number into it.") from None
        if not text:
            return 0
        try:
            version = int(text)
        except ValueError:
            raise PbgRayError(f"{str(self.version_file())!r} must hold one integer, found "
                              f"{text[:40]!r}. Write the newest complete version number into it.") from None
        if version < 0:
            raise PbgRayError(f"{str(self.version_file())!r} holds a negative version ({version}).")
        return version

    def save_version(self, version: int, directory: Optional[StoragePath] = None) -> None:
        """Make `version` current. Call only once all of its files are written."""
        write_text_atomic(self.version_file(directory), f"{version}\n")

    def check_version(self, version: int, config: ConfigSchema) -> None:
        """Refuse a version whose files are not all there."""
        missing = [p.name for p in self.version_files(version, config) if not p.is_file()]
        if missing:
            raise PbgRayError(
                f"{str(self.version_file())!r} names version {version}, but "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                f"{'is' if len(missing) == 1 else 'are'} missing from {str(self.path)!r}. "
                "The checkpoint is incomplete: restore the files or point checkpoint_path elsewhere.")

    # --- config and stats -----------------------------------------------

    def save_config(self, config: ConfigSchema, directory: Optional[StoragePath] = None) -> None:
        write_text_atomic(self.config_file(directory), json.dumps(config.to_dict(), indent=4))

    def load_config(self) -> ConfigSchema:
        path = self.config_file()
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise PbgRayError(f"{str(path)!r} is missing: {str(self.path)!r} is not a checkpoint "
                              "directory.") from None
        except ValueError as err:
            raise PbgRayError(f"{str(path)!r} is not valid JSON: {err}") from None
        return ConfigSchema.from_dict(data, source=str(path), warn=False)

    def append_stats(self, stats: List[Dict[str, Any]]) -> None:
        try:
            append_text(self.stats_file(), "".join(json.dumps(s) + "\n" for s in stats))
        except OSError as err:
            raise write_failed(self.stats_file(), err) from None

    def keep_stats(self, keep: Callable[[Dict[str, Any]], bool]) -> None:
        """Rewrite training_stats.json, if there is one, with only the lines `keep` accepts
        (and without the partial last line of a run killed while appending)."""
        if self.stats_file().exists():
            kept = [s for s in self.load_stats() if keep(s)]
            write_text_atomic(self.stats_file(), "".join(json.dumps(s) + "\n" for s in kept))

    def load_stats(self) -> Iterator[Dict[str, Any]]:
        """The lines of training_stats.json. A last line without its newline is what a run
        killed while appending left (its pass never became current): it is left out."""
        path = self.stats_file()
        try:
            with reading(path, "training stats"):
                text = path.read_text()
        except FileNotFoundError:
            return
        for number, line in enumerate(text.split("\n")[:-1], 1):
            try:
                stats = json.loads(line)
            except ValueError as err:
                raise PbgRayError(f"{str(path)!r}, line {number}: not a JSON object ({err}). "
                                  "Delete that line (the file only holds statistics).") from None
            yield stats

    # --- HDF5 files -----------------------------------------------------

    @staticmethod
    def _write_h5(path: StoragePath, metadata: Mapping[str, Any], optim_state,
                  fill: Callable[[h5py.File], None] = lambda hf: None,
                  bulk: Optional[Tuple[str, np.ndarray]] = None, in_place: bool = False) -> None:
        """`fill` creates the datasets; `bulk` (name, C-contiguous array) is the one large
        dataset, created last and written from the array itself."""
        # The file's structure is built in memory, then written with plain writes: a
        # failed write inside the HDF5 library (disk full) leaves the file impossible to
        # close and h5py then crashes the process, while a plain write just raises.
        # The bulk dataset gets its space in the image but no bytes (HDF5 allocates it
        # early and never fills it); its bytes go straight from the array to the file, so
        # the file is never copied in memory.
        image = _FileImage()
        with h5py.File(image, "w") as hf:
            hf.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
            for key, value in metadata.items():
                hf.attrs[key] = value
            fill(hf)
            blob = serialize_optim_state(optim_state)
            if blob is not None:
                hf.create_dataset(OPTIMIZER_STATE_DICT_DATASET,
                                  data=np.frombuffer(blob, dtype=np.dtype("V1")))
            if bulk is not None:
                name, array = bulk
                if array.size:
                    image.leave_out(_allocate_dataset(hf, name, array), array)
                else:
                    hf.create_dataset(name, data=array)
        (write_bytes_in_place if in_place else write_bytes_atomic)(path, *image.buffers())

    @staticmethod
    def _open_h5(path: StoragePath, what: str) -> h5py.File:
        return open_v1_h5(path, what, "Check checkpoint_path (or init_path) and "
                          "checkpoint_version.txt.", "A pre-1.0 PBG run converts with python "
                          "-m pbg_ray.migrate.", lambda: recovery(path))

    @staticmethod
    def _read_optim(hf: h5py.File) -> Optional[Dict[str, Any]]:
        if OPTIMIZER_STATE_DICT_DATASET not in hf:
            return None
        return deserialize_optim_state(hf[OPTIMIZER_STATE_DICT_DATASET][...].tobytes(), hf.filename)

    def save_entity_partition(self, version: int, entity: EntityName, part: Partition,
                              embeddings: np.ndarray, optim_state: Optional[Mapping[str, Any]],
                              metadata: Mapping[str, Any] = {}) -> None:
        """embeddings: float32 [N, dim]; optim_state: e.g. `row_adagrad_state(...)`."""
        self.write_entity_partition(self.partition_file(version, entity, part), embeddings,
                                    optim_state, metadata)

    @classmethod
    def write_entity_partition(cls, path: PathLike, embeddings: np.ndarray,
                               optim_state: Optional[Mapping[str, Any]],
                               metadata: Mapping[str, Any] = {}, in_place: bool = False) -> None:
        """An embeddings file at `path` (see save_entity_partition). `in_place`: written
        over the file's own bytes, neither atomic nor fsync'ed (see write_bytes_in_place):
        for swap files, which nothing reads before their write has succeeded."""
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        cls._write_h5(storage_path(path), metadata, optim_state,
                      bulk=(EMBEDDING_DATASET, embeddings), in_place=in_place)

    def swap_file(self, owner: str, number: int) -> StoragePath:
        """Swap file `number` of `owner` (disk placement's partition stores, see
        training.bucket_sources.SwapFile); remove_leftovers deletes those left behind."""
        return self.path / f".partition.h5.tmp-swap-{owner}-{number}"

    def swap_files(self, owner: str) -> List[StoragePath]:
        """The swap files of `owner` that are there."""
        return list(self.path.glob(f".partition.h5.tmp-swap-{owner}-*"))

    def load_entity_partition(self, version: int, entity: EntityName, part: Partition,
                              empty: Callable[..., np.ndarray] = np.empty
                              ) -> Tuple[np.ndarray, Optional[Dict[str, Any]]]:
        """(float32 embeddings [N, dim], optimizer state dict or None). The embeddings
        are read into `empty(shape, dtype)`."""
        return self.read_entity_partition(self.partition_file(version, entity, part), empty)

    @classmethod
    def read_entity_partition(cls, path: PathLike, empty: Callable[..., np.ndarray] = np.empty
                              ) -> Tuple[np.ndarray, Optional[Dict[str, Any]]]:
        """The embeddings file at `path` (see load_entity_partition)."""
        path = storage_path(path)
        with reading(path, "embeddings", lambda: recovery(path)), \
                cls._open_h5(path, "embeddings") as hf:
            ds = _embeddings_dataset(hf, path)
            embeddings = empty(ds.shape, np.float32)
            if ds.size:
                ds.read_direct(embeddings)
            return embeddings, cls._read_optim(hf)

    @classmethod
    def count_entity_rows(cls, path: PathLike) -> int:
        """The number of rows of the embeddings file at `path` (its metadata alone)."""
        path = storage_path(path)
        with reading(path, "embeddings", lambda: recovery(path)), \
                cls._open_h5(path, "embeddings") as hf:
            return int(_embeddings_dataset(hf, path).shape[0])

    @classmethod
    def read_entity_rows(cls, path: PathLike, offsets: np.ndarray) -> np.ndarray:
        """float32 [len(offsets), dim]: the rows at `offsets` (any order, repeats allowed) of
        the embeddings file at `path`, read alone (one HDF5 selection of the rows), so a
        few rows of a large partition cost a few small reads."""
        path = storage_path(path)
        wanted, where = np.unique(np.asarray(offsets, np.int64), return_inverse=True)
        with reading(path, "embeddings", lambda: recovery(path)), \
                cls._open_h5(path, "embeddings") as hf:
            ds = _embeddings_dataset(hf, path)
            outside = wanted[(wanted < 0) | (wanted >= ds.shape[0])]
            if len(outside):
                raise PbgRayError(f"embeddings file {str(path)!r} holds {ds.shape[0]} rows; row "
                                  f"{outside[0]} was asked for. The entity files and the "
                                  "checkpoint differ: check entity_path and checkpoint_path.")
            rows = (ds[wanted].astype(np.float32, copy=False) if len(wanted)
                    else np.empty((0, ds.shape[1]), np.float32))
        return rows[where]

    def save_model(self, version: int, params: Mapping[str, np.ndarray],
                   optim_state: Optional[Mapping[str, Any]],
                   metadata: Mapping[str, Any] = {}) -> None:
        """params: public name (relations/0/operator/rhs/diagonal, ...) -> array."""

        def fill(hf: h5py.File) -> None:
            group = hf.create_group(MODEL_STATE_DICT_GROUP, track_order=True)
            for public_name, value in params.items():
                ds = group.create_dataset(public_name, data=np.asarray(value))
                ds.attrs[STATE_DICT_KEY_ATTR] = state_dict_key(public_name)

        self._write_h5(self.model_file(version), metadata, optim_state, fill)

    def load_model(self, version: int) -> Tuple[Dict[str, np.ndarray], Optional[Dict[str, Any]]]:
        """(public name -> array, optimizer state dict or None)."""
        params: Dict[str, np.ndarray] = {}
        path = self.model_file(version)
        with reading(path, "model", lambda: recovery(path)), self._open_h5(path, "model") as hf:
            if MODEL_STATE_DICT_GROUP in hf:
                def visit(name: str, obj) -> None:
                    if isinstance(obj, h5py.Dataset):
                        params[name] = obj[...]
                hf[MODEL_STATE_DICT_GROUP].visititems(visit)
            return params, self._read_optim(hf)

    # --- version lifecycle ------------------------------------------------

    def drop_version(self, version: int, config: ConfigSchema) -> None:
        for path in self.version_files(version, config):
            path.unlink(missing_ok=True)

    def preserve_version(self, version: int, snapshot: StoragePath, config: ConfigSchema) -> None:
        """Keep a copy of `version` in `snapshot` (an epoch_{k}/ or best/ directory; hard
        links where the filesystem allows: no bytes copied, and dropping the original later
        is safe). A version it held before goes first, its version file first of all, so
        that the directory is never a complete checkpoint of mixed versions."""
        kept = CheckpointStorage(snapshot)
        previous = kept.load_version()
        if previous:
            kept.version_file().unlink()
            for path in kept.version_files(previous, config):
                path.unlink(missing_ok=True)
        snapshot.mkdir(parents=True, exist_ok=True)
        for src in self.version_files(version, config):
            link_or_copy(src, snapshot / src.name)
        self.save_config(config, snapshot)
        self.save_version(version, snapshot)


class _FileImage:
    """An HDF5 file as h5py builds it in memory (a file-like object for its "fileobj"
    driver), less the bytes of one dataset, which are written from their array instead
    (`leave_out`). HDF5 may put metadata after that dataset: a BytesIO would store the
    dataset's whole range, zeros, to get there (a partition's size, filled while holding
    the GIL); here the bytes after it are kept apart, at their distance from its end."""

    def __init__(self) -> None:
        self.head, self.tail = io.BytesIO(), io.BytesIO()
        self.left_out: Optional[Tuple[int, np.ndarray]] = None  # (offset, array)
        self.pos = self.size = 0

    def leave_out(self, offset: int, array: np.ndarray) -> None:
        """The bytes [offset, offset + array.nbytes) are `array`'s, and not stored here."""
        self.left_out = (offset, array)
        end = offset + array.nbytes
        self.tail.write(self.head.getbuffer()[end:])  # what HDF5 wrote past it so far
        self.head.truncate(offset)

    def _at(self, n: int) -> Tuple[io.BytesIO, int]:
        """The buffer that holds the `n` bytes at the position, and where in it."""
        if self.left_out is None or self.pos + n <= self.left_out[0]:
            return self.head, self.pos
        end = self.left_out[0] + self.left_out[1].nbytes
        if self.pos >= end:
            return self.tail, self.pos - end
        raise PbgRayError(f"internal error: HDF5 accessed bytes {self.pos}-{self.pos + n} of a "
                          "dataset it allocates and never fills; please report it.")

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos + {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        buf, at = self._at(n)
        buf.seek(at)
        buf.write(data)
        self.pos += n
        self.size = max(self.size, self.pos)
        return n

    def read(self, n: int = -1) -> bytes:
        n = max(0, self.size - self.pos) if n < 0 else n
        buf, at = self._at(n)
        buf.seek(at)
        data = buf.read(n)
        self.pos += n
        return data + bytes(n - len(data))  # bytes never written read as zeros

    def truncate(self, size: Optional[int] = None) -> int:
        self.size = self.pos if size is None else size
        return self.size

    def flush(self) -> None:
        pass

    def buffers(self) -> List[Any]:
        """The file's bytes, in order: the image's, and the left-out array's in its place."""
        def exactly(buf: io.BytesIO, n: int) -> List[Any]:  # bytes never written are zeros
            data = buf.getbuffer()[:n]
            return [data, bytes(n - len(data))]

        if self.left_out is None:
            return exactly(self.head, self.size)
        offset, array = self.left_out
        return [*exactly(self.head, offset), memoryview(array).cast("B"),
                *exactly(self.tail, max(0, self.size - offset - array.nbytes))]


def _embeddings_dataset(hf: h5py.File, path: StoragePath) -> h5py.Dataset:
    """An embeddings file's 'embeddings' dataset, checked to be a 2-D float array."""
    ds = hf.get(EMBEDDING_DATASET)
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 2 or dataset_kind(ds) != "f":
        found = ("nothing" if ds is None else dataset_type(ds)
                 if isinstance(ds, h5py.Dataset) else "a group")
        raise PbgRayError(f"embeddings file {str(path)!r}: dataset 'embeddings' must be a "
                          f"2-D float array [entities, dimension], found {found}.")
    return ds


def _allocate_dataset(hf: h5py.File, name: str, array: np.ndarray) -> int:
    """Create dataset `name` of `array`'s shape and dtype, contiguous, with its space
    allocated now and never filled; returns its byte offset in the file."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)  # as h5py's create_dataset
    dataset = h5py.h5d.create(hf.id, name.encode(), h5py.h5t.py_create(array.dtype),
                              h5py.h5s.create_simple(array.shape), dcpl=dcpl)
    return dataset.get_offset()

