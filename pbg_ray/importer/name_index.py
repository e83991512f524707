"""Names -> dense ids at Arrow speed, through 64-bit integer keys.

A name's key is computed in numpy straight from the Arrow string buffers: names
of up to 7 bytes are packed into the key exactly; longer ones are hashed (bit 63
set, so the two kinds never meet) and carry a second, independent 64-bit hash
that is compared on every sighting, so two different names sharing a key stop
the import instead of silently becoming one entity. Keys go into pandas'
integer hash table, which assigns ids in order of first appearance.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import pyarrow as pa
from pandas._libs import hashtable

from pbg_ray.errors import PbgRayError

_U = np.uint64
_HASHED = _U(1 << 63)
# _BYTE_MASKS[k] keeps the low k bytes of a little-endian word.
_BYTE_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=_U)
_K1, _K2, _K3, _K4 = (_U(0x9E3779B97F4A7C15), _U(0xBF58476D1CE4E5B9),
                      _U(0x94D049BB133111EB), _U(0xFF51AFD7ED558CCD))


def mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (in place): every input bit reaches every output bit."""
    h ^= h >> _U(30)
    h *= _K2
    h ^= h >> _U(27)
    h *= _K3
    h ^= h >> _U(31)
    return h


def name_keys(names: pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """(key, check) uint64 per name of a null-free string array; check is 0 for
    exactly packed names."""
    n = len(names)
    if n == 0:
        return np.empty(0, _U), np.empty(0, _U)
    offsets_type = np.int64 if pa.types.is_large_string(names.type) else np.int32
    buffers = names.buffers()
    offsets = np.frombuffer(buffers[1], offsets_type)[names.offset:names.offset + n + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
    span = int(offsets[-1] - offsets[0])
    # 8 zero bytes of padding so that a word read at any name's start stays inside.
    padded = np.zeros(span + 8, np.uint8)
    padded[:span] = data[offsets[0]:offsets[-1]]
    words = np.ndarray((span + 1,), dtype="<u8", buffer=padded, strides=(1,))
    start = offsets[:-1] - offsets[0]
    length = np.diff(offsets)

    def word(j: int, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """The j-th 8-byte word of each name, bytes past its end zeroed."""
        s, left = (start, length - 8 * j) if rows is None else (start[rows], length[rows] - 8 * j)
        pos = s + 8 * j
        if j:
            np.minimum(pos, span, out=pos)
            np.maximum(left, 0, out=left)
        return words[pos] & _BYTE_MASKS[np.minimum(left, 8)]

    len64 = length.astype(_U)
    w0 = word(0)
    short = length <= 7
    hashed = mix(w0 ^ (len64 * _K1))
    check = mix((w0 + _K4) * (len64 | _U(1)))
    w1 = word(1)
    more = length > 8
    hashed[more] = mix(hashed[more] ^ w1[more])
    check[more] = mix(check[more] + w1[more] * _K4)
    rows = np.flatnonzero(length > 16)
    j = 2
    while len(rows):  # names longer than 16 bytes: one more word per round
        w = word(j, rows)
        hashed[rows] = mix(hashed[rows] ^ w)
        check[rows] = mix(check[rows] + w * _K4)
        j += 1
        rows = rows[length[rows] > 8 * j]
    key = np.where(short, w0 | (len64 << _U(56)), hashed | _HASHED)
    check[short] = 0
    return key, check


class _Growable:
    """A 1-D numpy array that grows by appending (amortized doubling)."""

    def __init__(self, dtype) -> None:
        self._data = np.zeros(1024, dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        need = self.size + len(values)
        if need > len(self._data):
            grown = np.zeros(max(need, 2 * len(self._data)), self._data.dtype)
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

    def add_keyed(self, keys: np.ndarray, checks: np.ndarray, names: pa.Array,
                  counts: Optional[np.ndarray] = None) -> np.ndarray:
        """`add` of names whose (key, check) name_keys already gave."""
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
        self._verify(ids, keys, checks, names)
        self._counts.array[:] += np.bincount(ids, counts, minlength=len(self)).astype(np.int64)
        return ids

    def lookup(self, names: pa.Array) -> np.ndarray:
        """Ids of `names`, -1 for names never added."""
        keys, checks = name_keys(names)
        ids = self._table.lookup(keys)
        self._verify(ids, keys, checks, names)
        return ids

    def _verify(self, ids: np.ndarray, keys: np.ndarray, checks: np.ndarray,
                names: pa.Array) -> None:
        hashed = np.flatnonzero((keys >= _HASHED) & (ids >= 0))
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

    def names(self) -> pa.Array:
        """Every name, by id (large_string: more than 2 GiB of names is fine)."""
        if not self._names:
            return pa.array([], pa.large_string())
        self._names = [pa.concat_arrays(self._names)]
        return self._names[0]
