"""NameIndex: names -> dense ids in order of first appearance, with counts and clash checks."""

import numpy as np
import pyarrow as pa
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import name_index
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.io.name_keys import name_keys

NAMES = ["b", "a-name-longer-than-sixteen-bytes", "a", "", "bb", "ab", "exactly7", "eight-by"]


def test_ids_in_order_of_first_appearance_with_counts():
    index = NameIndex("test names")
    ids = index.add(pa.array(["b", "a", "b", "c-is-a-long-name", "a", "b"]))
    assert ids.tolist() == [0, 1, 0, 2, 1, 0]
    assert index.add(pa.array(["d", "a"])).tolist() == [3, 1]
    assert index.counts.tolist() == [3, 3, 1, 1]
    assert index.names().to_pylist() == ["b", "a", "c-is-a-long-name", "d"]
    assert index.lookup(pa.array(["d", "unknown", "b"])).tolist() == [3, -1, 0]
    assert index.counts.tolist() == [3, 3, 1, 1]  # lookups don't count


def test_keys_depend_on_the_name_only():
    keys, _ = name_keys(pa.array(NAMES))
    assert len(set(keys.tolist())) == len(NAMES)
    # A sliced array, a large_string array and another order give each name the same key.
    sliced, _ = name_keys(pa.array(["x"] + NAMES).slice(1))
    large, _ = name_keys(pa.array(NAMES, pa.large_string()))
    reversed_keys, _ = name_keys(pa.array(NAMES[::-1]))
    assert sliced.tolist() == large.tolist() == keys.tolist() == reversed_keys[::-1].tolist()


def test_two_names_with_one_key_stop_the_import(monkeypatch):
    real = name_index.name_keys

    def clashing(names):
        keys, checks = real(names)
        return np.full_like(keys, (1 << 63) | 12345), checks  # every name one hashed key

    monkeypatch.setattr(name_index, "name_keys", clashing)
    index = NameIndex("entity type 'user'")
    index.add(pa.array(["first-long-name-of-many-bytes"]))
    with pytest.raises(PbgRayError, match="entity type 'user': the names "
                       "'second-long-name-of-many-bytes' and 'first-long-name-of-many-bytes' "
                       "have the same 64-bit key"):
        index.add(pa.array(["second-long-name-of-many-bytes"]))
