"""torch.save's file format, read and written without importing torch.

PBG v1 checkpoints keep each optimizer state as the bytes `torch.save` writes (a zip
archive: `data.pkl`, a protocol-2 pickle whose tensors point at raw storages stored beside
it as `data/<key>`). The processes that only hold or move partitions (partition stores,
the parameter server, the driver) read and write those blobs through this module, so they
never pay torch's import time and memory; tensors come out as numpy arrays and go in as
numpy arrays (or torch tensors, from callers that have torch). torch.load(...,
weights_only=True) reads what `dumps` writes, and `loads` reads what torch.save writes, for
the types optimizer state dicts hold: dicts, lists, tuples, numbers, strings, None and dense
CPU tensors.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from typing import Any, Dict, List, Tuple

import numpy as np

ARCHIVE = "archive"
_REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
# torch's typed storage classes (as pickled: module torch) and their element types.
_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
             "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
             "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}
_STORAGE_OF = {np.dtype(dtype): name for name, dtype in _STORAGES.items()}


class _Global:
    """A module-level name pickled by reference (pickle's GLOBAL) without importing it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce asks for a callable
        raise TypeError(f"{self.module}.{self.name} stands for torch's; it is never called")


class _Tensor:
    """A numpy array to be pickled as torch pickles a tensor."""

    def __init__(self, array: np.ndarray) -> None:
        # (not np.ascontiguousarray: it makes a 0-dim array, e.g. Adagrad's step, 1-dim)
        self.array = array if array.flags.c_contiguous else array.copy(order="C")


class _Storage:
    """A tensor's storage, pickled as a persistent id naming its record."""

    def __init__(self, key: str, array: np.ndarray) -> None:
        self.key, self.array = key, array


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table takes our types
    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: List[_Storage] = []

    def save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def save_tensor(self, obj: _Tensor) -> None:
        if obj.array.dtype not in _STORAGE_OF:
            raise TypeError(f"no torch storage for arrays of {obj.array.dtype}")
        storage = _Storage(str(len(self.storages)), obj.array)
        self.storages.append(storage)
        strides = tuple(s // obj.array.itemsize for s in obj.array.strides)
        self.save_reduce(_Global(*_REBUILD_TENSOR),
                         (storage, 0, obj.array.shape, strides, False,
                          collections.OrderedDict()), obj=obj)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", _Global("torch", _STORAGE_OF[obj.array.dtype]), obj.key, "cpu",
                    obj.array.size)
        return None

    dispatch[_Global] = save_global_ref
    dispatch[_Tensor] = save_tensor


def _wrap(value: Any) -> Any:
    """`value` with its numpy arrays (and torch tensors, where a caller has torch) as
    tensors to pickle."""
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return _Tensor(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _wrap(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap(v) for v in value)
    return value


def dumps(obj: Any) -> bytes:
    """The bytes torch.save writes for `obj`, its numpy arrays written as tensors."""
    pickled = io.BytesIO()
    pickler = _Pickler(pickled)
    pickler.dump(_wrap(obj))
    records = [("data.pkl", pickled.getvalue()), ("byteorder", b"little"),
               *((f"data/{s.key}", s.array.tobytes()) for s in pickler.storages),
               ("version", b"3\n")]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            # A fixed date: the same state gives the same bytes (checkpoints compare equal).
            archive.writestr(zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0)),
                             data)
    return out.getvalue()


def _rebuild_tensor(storage: np.ndarray, offset: int, size: Tuple[int, ...],
                    stride: Tuple[int, ...], *_: Any) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2 with a numpy array for the storage."""
    itemsize = storage.itemsize
    return np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size),
        strides=tuple(s * itemsize for s in stride)).copy()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix = archive, prefix
        self.loaded: Dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _REBUILD_TENSOR:
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in an optimizer state")

    def persistent_load(self, pid: Any) -> np.ndarray:
        kind, dtype, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        if key not in self.loaded:
            raw = self.archive.read(f"{self.prefix}data/{key}")
            self.loaded[key] = np.frombuffer(raw, dtype=dtype, count=numel)
        return self.loaded[key]


def loads(blob: bytes) -> Any:
    """What torch.load(weights_only=True) reads from `blob`, with numpy arrays for tensors."""
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ValueError("not a torch.save archive (no data.pkl)")
        prefix = pickles[0][: -len("data.pkl")]
        return _Unpickler(archive.read(pickles[0]), archive, prefix).load()
