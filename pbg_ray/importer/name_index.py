"""Names -> dense ids at Arrow speed, through 64-bit integer keys (io/name_keys.py).

A hashed name's second hash is compared on every sighting, so two different names
sharing a key stop the import instead of silently becoming one entity. Keys go into
pandas' integer hash table, which assigns ids in order of first appearance.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
from pandas._libs import hashtable

from pbg_ray.errors import PbgRayError
from pbg_ray.io.name_keys import HASHED, name_keys


class _Growable:
    """A 1-D numpy array that grows by appending (by half its room at a time)."""

    def __init__(self, dtype) -> None:
        self._data = np.zeros(1024, dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        need = self.size + len(values)
        if need > len(self._data):
            grown = np.zeros(max(need, len(self._data) * 3 // 2), self._data.dtype)
            grown[:self.size] = self._data[:self.size]
            self._data = grown
        self._data[self.size:need] = values
        self.size = need

    @property
    def array(self) -> np.ndarray:
        """A view of the current contents (valid until the next extend)."""
        return self._data[:self.size]


class NameIndex:
    """Distinct names -> ids 0, 1, ... in order of first appearance, with
    occurrence counts and the names themselves (for the dictionary files)."""

    def __init__(self, what: str) -> None:
        self.what = what  # e.g. "entity type 'user'", for messages
        self._table = hashtable.UInt64HashTable()
        self._keys = _Growable(np.uint64)
        self._checks = _Growable(np.uint64)
        self._counts = _Growable(np.int64)
        self._names: List[pa.Array] = []

    def __len__(self) -> int:
        return self._checks.size

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
        if grow:
            ids = self._grown(keys, checks, names)
            found = slice(None)  # every name has its id
        else:
            ids = self._table.lookup(keys)
            found = np.flatnonzero(ids >= 0)
        self._verify(ids, keys, checks, names)
        # ufunc.at touches the ids seen; a bincount would write every id of the index.
        np.add.at(self._counts.array, ids[found],
                  1 if counts is None else np.asarray(counts, np.int64)[found])
        return ids

    def _grown(self, keys: np.ndarray, checks: np.ndarray, names: pa.Array) -> np.ndarray:
        """The ids of `keys`, the names new to the index added (uncounted)."""
        prior = len(self)
        # A fresh vector per call: pandas hands out a view of it and then refuses to grow it.
        ids = self._table.get_labels(keys, hashtable.UInt64Vector(), prior, -1)
        new = np.flatnonzero(ids >= prior)
        if len(new):
            labels = ids[new]
            # New ids are handed out in increasing order: a first sighting is a new maximum.
            first = new[labels > np.concatenate(([prior - 1], np.maximum.accumulate(labels)[:-1]))]
            self._keys.extend(keys[first])
            self._checks.extend(checks[first])
            self._counts.extend(np.zeros(len(first), np.int64))
            self._names.append(names.take(pa.array(first)).cast(pa.large_string()))
        return ids

    def nbytes(self) -> int:
        """The bytes the index holds: its hash table, its arrays with their room, its names."""
        return (self._table.sizeof()
                + sum(a._data.nbytes for a in (self._keys, self._checks, self._counts))
                + sum(chunk.nbytes for chunk in self._names))

    def close(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Once every name is in: (keys, counts, checks) by id, handed over; the index
        keeps its names only (drain_names, names), no hash table."""
        keyed = self.keys(), self.counts, self.checks()
        self._table = self._keys = self._counts = self._checks = None
        return keyed

    def lookup(self, names: pa.Array) -> np.ndarray:
        """Ids of `names`, -1 for names never added."""
        keys, checks = name_keys(names)
        ids = self._table.lookup(keys)
        self._verify(ids, keys, checks, names)
        return ids

    def _verify(self, ids: np.ndarray, keys: np.ndarray, checks: np.ndarray,
                names: pa.Array) -> None:
        hashed = np.flatnonzero((keys >= HASHED) & (ids >= 0))
        clash = hashed[self._checks.array[ids[hashed]] != checks[hashed]]
        if len(clash):
            name = names[int(clash[0])].as_py()
            other = self.names().take(pa.array([int(ids[clash[0]])]))[0].as_py()
            raise PbgRayError(f"{self.what}: the names {name!r} and {other!r} have the same 64-bit "
                              "key, a chance of about one in 10^19 per pair. Rename one of them.")

    @property
    def counts(self) -> np.ndarray:
        """Occurrences of each id so far."""
        return self._counts.array

    def checks(self) -> np.ndarray:
        """The second hash of each id (0 for exactly packed names), compared on every sighting."""
        return self._checks.array

    def keys(self) -> np.ndarray:
        """The key of each id: a canonical order of the names that doesn't depend
        on the order of rows or batches."""
        return self._keys.array

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
