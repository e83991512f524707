"""Names -> dense ids at Arrow speed, through 64-bit integer keys (io/name_keys.py).

A hashed name's second hash is compared on every sighting, so two different names
sharing a key stop the import instead of silently becoming one entity. Keys go into a
hash table that assigns ids in order of first appearance and counts each id's
occurrences: the C table of _key_table.c (one cache line a name, a batch's misses
overlapped: the Ray engine's dictionary shards spend their time in these lookups), else,
where it is not built, pandas' integer hash table with arrays by id.
"""

from __future__ import annotations

import mmap
from typing import Callable, Iterator, List, Optional, Tuple, Union

import numpy as np
import pyarrow as pa
from pandas._libs import hashtable

from pbg_ray.errors import PbgRayError
from pbg_ray.io.name_keys import name_keys
from pbg_ray.model.native import extension


def _zeros(length: int, dtype, width: int = 1) -> np.ndarray:
    """np.zeros((length, width)) in its own anonymous mapping, squeezed where width is 1.
    numpy asks the kernel for transparent huge pages for large arrays, and in the
    kernel's default `madvise` mode each is then assembled at its first touch: filling
    the tables grown here that way took longer than the lookups into them."""
    dtype = np.dtype(dtype)
    array = np.frombuffer(mmap.mmap(-1, max(1, length * width) * dtype.itemsize), dtype)
    return array.reshape(length, width) if width > 1 else array[:length]


class _Growable:
    """A 1-D numpy array that grows by appending (by half its room at a time)."""

    def __init__(self, dtype) -> None:
        self._data = _zeros(1024, dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        need = self.size + len(values)
        if need > len(self._data):
            grown = _zeros(max(need, len(self._data) * 3 // 2), self._data.dtype)
            grown[:self.size] = self._data[:self.size]
            self._data = grown
        self._data[self.size:need] = values
        self.size = need

    @property
    def array(self) -> np.ndarray:
        """A view of the current contents (valid until the next extend)."""
        return self._data[:self.size]


def _first_sightings(ids: np.ndarray, prior: int) -> np.ndarray:
    """The places in `ids` where an id of `prior` or more occurs first: new ids are handed
    out in increasing order, so a first sighting is a new maximum."""
    new = np.flatnonzero(ids >= prior)
    if not len(new):
        return new
    labels = ids[new]
    return new[labels > np.concatenate(([prior - 1], np.maximum.accumulate(labels)[:-1]))]


class _PandasTable:
    """A table of names' (key, check) -> ids 0, 1, ... in order of first appearance, with
    the occurrences of each id: pandas' UInt64HashTable and arrays by id (where
    _key_table.c is not built; _CTable is the same in C)."""

    def __init__(self) -> None:
        self._table = hashtable.UInt64HashTable()
        self._keys = _Growable(np.uint64)
        self._checks = _Growable(np.uint64)
        self._counts = _Growable(np.int64)

    def __len__(self) -> int:
        return self._keys.size

    def add(self, keys: np.ndarray, checks: np.ndarray, counts: Optional[np.ndarray],
            grow: bool) -> Tuple[np.ndarray, int]:
        """(ids, clash): the ids of the keys (uint64), each occurrence counted (as
        `counts[i]` where given); keys the table lacks get the next ids (`grow`), or -1
        and are not counted. `clash`: the first place whose key the table holds with
        another check (two names, one key), else -1."""
        prior = len(self)
        if grow:
            # A fresh vector per call: pandas hands out a view of it and refuses to grow it.
            ids = self._table.get_labels(keys, hashtable.UInt64Vector(), prior, -1)
            first = _first_sightings(ids, prior)
            self._keys.extend(keys[first])
            self._checks.extend(checks[first])
            self._counts.extend(np.zeros(len(first), np.int64))
            found = slice(None)
        else:
            ids = self._table.lookup(keys)
            found = np.flatnonzero(ids >= 0)
        # ufunc.at touches the ids seen; a bincount would write every id of the table.
        np.add.at(self._counts.array, ids[found],
                  1 if counts is None else np.asarray(counts, np.int64)[found])
        clash = np.flatnonzero((ids >= 0) & (self._checks.array[np.maximum(ids, 0)] != checks))
        return ids, int(clash[0]) if len(clash) else -1

    def columns(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, counts, checks) by id."""
        return self._keys.array, self._counts.array, self._checks.array

    def growth(self, n: int) -> int:
        """The bytes a table that grows to take `n` more names allocates (pandas grows its
        own: not known here, 0)."""
        return 0

    def sizeof(self) -> int:
        """The bytes the table holds, with its room."""
        return self._table.sizeof() + sum(a._data.nbytes for a in (self._keys, self._checks,
                                                                     self._counts))


class _CTable:
    """_PandasTable in _key_table.c: slots of (key, check, id, count), at most MAX_LOAD of
    them full, that this object owns and grows."""

    MAX_LOAD = 0.7

    def __init__(self, c) -> None:
        self._c = c
        self._size = 0
        self._slots = _zeros(1024, np.uint64, 3)

    def __len__(self) -> int:
        return self._size

    def add(self, keys: np.ndarray, checks: np.ndarray, counts: Optional[np.ndarray],
            grow: bool) -> Tuple[np.ndarray, int]:
        keys = np.ascontiguousarray(keys, np.uint64)
        checks = np.ascontiguousarray(checks, np.uint64)
        if counts is not None:
            counts = np.ascontiguousarray(counts, np.int64)
        capacity = self._capacity(len(keys))
        if grow and capacity > len(self._slots):
            slots = _zeros(capacity, np.uint64, 3)
            self._c.rehash(self._slots.ctypes.data, len(self._slots), slots.ctypes.data,
                           capacity)
            self._slots = slots
        ids = np.empty(len(keys), np.int64)
        self._size, clash = self._c.add(
            self._slots.ctypes.data, len(self._slots), keys.ctypes.data, checks.ctypes.data,
            0 if counts is None else counts.ctypes.data, len(keys), ids.ctypes.data,
            self._size, grow)
        return ids, clash

    def columns(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        keys, counts, checks = (np.empty(self._size, t) for t in (np.uint64, np.int64, np.uint64))
        self._c.columns(self._slots.ctypes.data, len(self._slots), keys.ctypes.data,
                        counts.ctypes.data, checks.ctypes.data)
        return keys, counts, checks

    def _capacity(self, n: int) -> int:
        """The slots the table needs to take `n` more names, each a new one."""
        capacity = len(self._slots)
        while self._size + n > self.MAX_LOAD * capacity:
            capacity *= 2
        return capacity

    def growth(self, n: int) -> int:
        capacity = self._capacity(n)
        return capacity * self._slots.itemsize * 3 if capacity > len(self._slots) else 0

    def sizeof(self) -> int:
        return self._slots.nbytes


def key_table() -> Union[_PandasTable, _CTable]:
    """The table of _key_table.c where it is built, else pandas'."""
    c = extension("_key_table", "pbg_ray.importer")
    return _PandasTable() if c is None else _CTable(c)


class NameIndex:
    """Distinct names -> ids 0, 1, ... in order of first appearance, with
    occurrence counts and the names themselves (for the dictionary files)."""

    def __init__(self, what: str) -> None:
        self.what = what  # e.g. "entity type 'user'", for messages
        self._table: Optional[Union[_PandasTable, _CTable]] = key_table()
        self._size = 0  # names, once closed
        self._names: List[pa.Array] = []

    def __len__(self) -> int:
        return len(self._table) if self._table is not None else self._size

    def add(self, names: pa.Array, counts: Optional[np.ndarray] = None) -> np.ndarray:
        """Ids of `names` (a string array), new names getting new ids; counts each occurrence
        (`counts`: as that many occurrences each)."""
        return self.add_keyed(*name_keys(names), names, counts)

    def add_later(self, names: pa.Array,
                  counts: Optional[np.ndarray] = None) -> Callable[[], np.ndarray]:
        """`add` as a call that gives the ids, here ready at once: the form IdReader sends
        names in, which the Ray engine's dictionary shards answer later."""
        ids = self.add(names, counts)
        return lambda: ids

    def add_keyed(self, keys: np.ndarray, checks: np.ndarray, names: pa.Array,
                  counts: Optional[np.ndarray] = None, grow: bool = True) -> np.ndarray:
        """`add` of names whose (key, check) name_keys already gave; without `grow`, names
        the index lacks are not added (id -1) nor counted."""
        prior = len(self)
        ids, clash = self._table.add(keys, checks, counts, grow)
        first = _first_sightings(ids, prior)
        if len(first):
            self._names.append(names.take(pa.array(first)).cast(pa.large_string()))
        if clash >= 0:
            self._clash(names, clash, int(ids[clash]))
        return ids

    def _clash(self, names: pa.Array, at: int, other_id: int) -> None:
        name = names[at].as_py()
        other = self.names().take(pa.array([other_id]))[0].as_py()
        raise PbgRayError(f"{self.what}: the names {name!r} and {other!r} have the same 64-bit "
                          "key, a chance of about one in 10^19 per pair. Rename one of them.")

    def nbytes(self) -> int:
        """The bytes the index holds: its hash table with its room, its names."""
        return self._table.sizeof() + sum(chunk.nbytes for chunk in self._names)

    def growth(self, n: int) -> int:
        """The bytes its hash table allocates to take `n` more names (as it grows it holds
        these and its old slots at once), where known; else 0."""
        return self._table.growth(n)

    def close(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Once every name is in: (keys, counts, checks) by id, handed over; the index
        keeps its names only (drain_names, names), no hash table."""
        keyed, self._size = self._table.columns(), len(self._table)
        self._table = None
        return keyed

    def lookup(self, names: pa.Array) -> np.ndarray:
        """Ids of `names`, -1 for names never added (not counted)."""
        keys, checks = name_keys(names)
        ids, clash = self._table.add(keys, checks, np.zeros(len(keys), np.int64), grow=False)
        if clash >= 0:
            self._clash(names, clash, int(ids[clash]))
        return ids

    @property
    def counts(self) -> np.ndarray:
        """Occurrences of each id so far."""
        return self._table.columns()[1]

    def checks(self) -> np.ndarray:
        """The second hash of each id (0 for exactly packed names), compared on every sighting."""
        return self._table.columns()[2]

    def keys(self) -> np.ndarray:
        """The key of each id: a canonical order of the names that doesn't depend
        on the order of rows or batches."""
        return self._table.columns()[0]

    def drain_names(self) -> Iterator[Tuple[int, pa.Array]]:
        """The names as added, in chunks, each let go once the next is asked for: (the
        id of the first, the chunk's names). The index holds no names after."""
        first = 0
        while self._names:
            chunk = self._names.pop(0)
            yield first, chunk
            first += len(chunk)

    def names(self) -> pa.Array:
        """Every name, by id (large_string: more than 2 GiB of names is fine)."""
        if not self._names:
            return pa.array([], pa.large_string())
        self._names = [pa.concat_arrays(self._names)]
        return self._names[0]
