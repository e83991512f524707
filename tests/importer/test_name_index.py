"""NameIndex: names -> dense ids in order of first appearance, with counts and clash checks,
on both of its hash tables: _key_table.c's and pandas' (where the C one is not built)."""

import numpy as np
import pyarrow as pa
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import name_index
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.io.name_keys import name_keys

NAMES = ["b", "a-name-longer-than-sixteen-bytes", "a", "", "bb", "ab", "exactly7", "eight-by"]


@pytest.fixture(params=["c", "pandas"])
def table(request, monkeypatch):
    """Which hash table NameIndex uses: PBG_RAY_C_KERNELS=0 turns the C one off."""
    if request.param == "pandas":
        monkeypatch.setenv("PBG_RAY_C_KERNELS", "0")
    return request.param


def test_the_c_table_is_built():
    # pip builds it wherever a C compiler is found, as on every machine CI runs on.
    assert isinstance(name_index.key_table(), name_index._CTable)


def test_ids_in_order_of_first_appearance_with_counts(table):
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


def test_two_names_with_one_key_stop_the_import(table, monkeypatch):
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


def test_both_tables_agree_with_a_dict_across_many_growths(table):
    # 60,000 distinct keys, packed and hashed, in batches of repeats: the C table grows
    # (rehashes) from 1,024 slots a few times over.
    rng = np.random.default_rng(7)
    names = np.array([f"n{i}" if i % 2 else f"a-long-name-{i:012d}" for i in range(60_000)])
    index, reference, counts = NameIndex("test names"), {}, {}
    for size in (10, 3_000, 20_000, 50_000, 80_000):
        batch = names[rng.integers(0, len(names), size)]
        weight = rng.integers(0, 3, size)
        ids = index.add(pa.array(batch), weight)
        for name, w in zip(batch.tolist(), weight.tolist()):
            reference.setdefault(name, len(reference))
            counts[name] = counts.get(name, 0) + w
        assert ids.tolist() == [reference[n] for n in batch.tolist()]
    known = list(reference)
    assert index.names().to_pylist() == known
    assert index.counts.tolist() == [counts[n] for n in known]
    keys, checks = name_keys(pa.array(known))
    assert index.keys().tolist() == keys.tolist()
    assert index.checks().tolist() == checks.tolist()
    unknown = [n for n in names.tolist() if n not in reference][:100] + known[:100]
    assert index.lookup(pa.array(unknown)).tolist() == [reference.get(n, -1) for n in unknown]
    # Without growing, names the index lacks get -1 and are not counted; known ones are.
    grown = index.add_keyed(*name_keys(pa.array(unknown)), pa.array(unknown), grow=False)
    assert grown.tolist() == [reference.get(n, -1) for n in unknown]
    assert len(index) == len(known)
    assert index.counts[:100].tolist() == [counts[n] + 1 for n in known[:100]]
    keyed = index.close()
    assert [k.tolist() for k in keyed] == [keys.tolist(), [counts[n] + (i < 100) for i, n in
                                                          enumerate(known)], checks.tolist()]
    assert len(index) == len(known) and index.names().to_pylist() == known


def test_a_clash_within_one_batch_stops_the_import(table, monkeypatch):
    real = name_index.name_keys
    monkeypatch.setattr(name_index, "name_keys",
                        lambda names: (np.full(len(names), (1 << 63) | 7, np.uint64),
                                       real(names)[1]))
    index = NameIndex("entity type 'item'")
    with pytest.raises(PbgRayError, match="entity type 'item': the names "
                       "'second-long-name-of-many-bytes' and 'first-long-name-of-many-bytes'"):
        index.add(pa.array(["first-long-name-of-many-bytes", "first-long-name-of-many-bytes",
                            "second-long-name-of-many-bytes"]))
