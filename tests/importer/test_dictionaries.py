"""The dictionaries phase: min counts, canonical order, seeded shuffle, partitions and
offsets, and growth from a previous import's dictionaries."""

import numpy as np
import pyarrow as pa
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import import_graph
from pbg_ray.importer.dictionaries import (
    build_dictionaries, extend_names, load_previous, partition_names)
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.importer.read import IdReader
from pbg_ray.io.entities import save_entity_count, save_entity_names
from tests.importer.util import make, write_text


def index_of(names):
    index = NameIndex("test names")
    index.add(pa.array(names))
    return index


def rng(seed=0):
    return np.random.default_rng(seed)


def test_partitions_are_contiguous_ranges_of_the_frequent_names_shuffled():
    names = [f"n{i}" for i in range(10)] + ["n0", "n1", "n2"] * 2 + ["a-long-name-x"] * 3
    dictionary = partition_names(index_of(names), 3, 2, rng())
    kept = ["n0", "n1", "n2", "a-long-name-x"]  # seen at least twice
    assert sorted(n for part in dictionary.names for n in part) == sorted(kept)
    assert [len(part) for part in dictionary.names] == [2, 1, 1]  # ceil(p n / P) boundaries
    index = index_of(names)
    for name, i in zip(index.names().to_pylist(), range(len(index))):
        if name in kept:
            assert dictionary.names[dictionary.part[i]][dictionary.offset[i]] == name
        else:
            assert dictionary.part[i] == -1  # dropped: too rare


def test_the_partitioning_depends_on_the_seed_and_not_on_the_row_order():
    names = [f"name-{i}" for i in range(200)]
    first = partition_names(index_of(names), 4, 1, rng(3)).names
    assert partition_names(index_of(names[::-1]), 4, 1, rng(3)).names == first
    assert partition_names(index_of(names), 4, 1, rng(4)).names != first
    assert sorted(n for part in first for n in part) == sorted(names)


def test_extension_keeps_known_offsets_and_fills_the_smallest_partitions():
    previous = [["a", "b", "c"], ["d"]]
    # Known names first (as load_previous seeds them), then the new names as read.
    index = index_of(["a", "b", "c", "d"])
    index.add(pa.array(["x", "y", "y", "z", "z", "rare"]))
    grown = extend_names(index, previous, 2, rng())
    # Known names keep their partition and offset, though seen fewer than 2 times here;
    assert grown.names[0][:3] == ["a", "b", "c"] and grown.names[1][:1] == ["d"]
    assert grown.part[:4].tolist() == [0, 0, 0, 1] and grown.offset[:4].tolist() == [0, 1, 2, 0]
    # of the new ones only y and z were seen twice: both go to the smaller partition 1.
    assert sorted(grown.names[1][1:]) == ["y", "z"] and len(grown.names[0]) == 3
    assert grown.part[index.lookup(pa.array(["x", "rare"]))].tolist() == [-1, -1]


def test_a_previous_import_seeds_the_first_ids(tmp_path):
    day0 = make(tmp_path / "day0", [write_text(tmp_path / "a.tsv", [("a", "follows", "b"),
                                                                     ("c", "likes", "b")])])
    import_graph(day0)
    config = make(tmp_path / "day1", [], previous_entity_path=day0.entity_path)
    reader = IdReader(config)
    previous = load_previous(config, reader)
    seeded = [n for part in previous.entities["node"] for n in part]
    assert sorted(seeded) == ["a", "b", "c"]
    assert reader.entity_index["node"].names().to_pylist() == seeded  # ids 0, 1, 2


def test_a_previous_dictionary_naming_an_entity_twice_is_refused(tmp_path):
    for part, names in enumerate([["a", "b"], ["b"]]):
        save_entity_names(tmp_path / "old", "node", part, names)
        save_entity_count(tmp_path / "old", "node", part, len(names))
    config = make(tmp_path, [], previous_entity_path=str(tmp_path / "old"))
    with pytest.raises(PbgRayError, match="entity type 'node' lists a name twice"):
        load_previous(config, IdReader(config))


def test_relations_below_their_min_count_are_dropped_and_none_left_is_refused(tmp_path):
    rows = [("a", "r1", "b")] * 3 + [("a", "r2", "b")]
    source = write_text(tmp_path / "e.tsv", rows)
    dynamic = dict(dynamic_relations=True,
                   relations=[{"name": "any", "lhs": "node", "rhs": "node"}])
    config = make(tmp_path, [source], relation_type_min_count=2, **dynamic)
    reader = IdReader(config)
    reader.read(0, tmp_path / "spill.bin")
    dictionaries = build_dictionaries(config, reader, load_previous(config, reader))
    assert dictionaries.relation_names == ["r1"]
    assert dictionaries.relation_ids.tolist() == [0, -1]  # ids as read: r1, r2
    config = make(tmp_path, [source], relation_type_min_count=4, **dynamic)
    reader = IdReader(config)
    reader.read(0, tmp_path / "spill.bin")
    with pytest.raises(PbgRayError, match="no relation type occurs "
                                          "importer.relation_type_min_count=4 times"):
        build_dictionaries(config, reader, load_previous(config, reader))
