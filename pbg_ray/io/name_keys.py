"""64-bit integer keys of names, computed in numpy straight from the Arrow string buffers:
names of up to 7 bytes are packed into the key exactly; longer ones are hashed (bit 63
set, so the two kinds never meet) and carry a second, independent 64-bit hash (the
check) that tells two names sharing a key apart. The importer's dictionaries
(importer/name_index.py) and the names a model is queried by (evaluation/entity_names.py)
find names by these keys.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import pyarrow as pa

_U = np.uint64
HASHED = _U(1 << 63)  # the bit of hashed keys
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
    rows = np.flatnonzero(length > 8)
    j = 1
    while len(rows):  # names longer than 8 bytes: one more word per round
        w = word(j, rows)
        hashed[rows] = mix(hashed[rows] ^ w)
        check[rows] = mix(check[rows] + w * _K4)
        j += 1
        rows = rows[length[rows] > 8 * j]
    key = np.where(short, w0 | (len64 << _U(56)), hashed | HASHED)
    check[short] = 0
    return key, check
