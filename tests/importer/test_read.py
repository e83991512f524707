"""The read phase: raw rows -> ids per entity type -> spill records."""

import numpy as np
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer.read import EntityTypes, IdReader
from tests.importer.util import make, write_text

TYPED = dict(entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 1}},
             relations=[{"name": "follows", "lhs": "user", "rhs": "user"},
                        {"name": "likes", "lhs": "user", "rhs": "item"}])


def spilled(reader, path):
    return np.fromfile(path, reader.spill_dtype)


def test_each_entity_type_numbers_its_names_in_order_of_first_appearance(tmp_path):
    rows = [("u1", "likes", "x"), ("u2", "follows", "u1"), ("x", "follows", "u3"),
            ("u2", "likes", "u1")]
    config = make(tmp_path, [write_text(tmp_path / "e.tsv", rows)], **TYPED)
    reader = IdReader(config)
    stats = reader.read(0, tmp_path / "spill.bin")
    assert stats["rows"] == 4 and "dropped_unseen" not in stats
    # "x" is an item in row 1 and a user in row 3; "u1" a user and then an item.
    assert reader.entity_index["user"].names().to_pylist() == ["u1", "u2", "x", "u3"]
    assert reader.entity_index["item"].names().to_pylist() == ["x", "u1"]
    assert reader.entity_index["user"].counts.tolist() == [2, 2, 1, 1]
    records = spilled(reader, tmp_path / "spill.bin")
    assert records["lhs"].tolist() == [0, 1, 2, 1]
    assert records["rhs"].tolist() == [0, 0, 3, 1]
    assert records["rel"].tolist() == [1, 0, 0, 1]
    assert "weight" not in records.dtype.names


def test_later_inputs_look_names_up_and_leave_unseen_ones_out(tmp_path):
    first = write_text(tmp_path / "a.tsv", [("a", "follows", "b"), ("b", "likes", "c")])
    second = write_text(tmp_path / "b.tsv", [("c", "likes", "a"), ("new", "follows", "a"),
                                             ("b", "follows", "a")])
    reader = IdReader(make(tmp_path, [first, second]))
    reader.read(0, tmp_path / "0.bin")
    stats = reader.read(1, tmp_path / "1.bin")
    assert stats["dropped_unseen"] == 1
    assert reader.entity_index["node"].names().to_pylist() == ["a", "b", "c"]  # nothing learned
    records = spilled(reader, tmp_path / "1.bin")
    assert records[["lhs", "rel", "rhs"]].tolist() == [(2, 1, 0), (1, 0, 0)]


def test_dynamic_relations_are_learned_and_weights_kept(tmp_path):
    rows = [("a", "r2", "b", 0.5), ("b", "r1", "a", 2.0), ("a", "r2", "a", 1.5)]
    config = make(tmp_path, [write_text(tmp_path / "e.tsv", rows)], dynamic_relations=True,
                  relations=[{"name": "any", "lhs": "node", "rhs": "node"}], weight_col=3)
    reader = IdReader(config)
    reader.read(0, tmp_path / "spill.bin")
    assert reader.relation_index.names().to_pylist() == ["r2", "r1"]
    records = spilled(reader, tmp_path / "spill.bin")
    assert records["rel"].tolist() == [0, 1, 0]
    assert records["weight"].tolist() == [0.5, 2.0, 1.5]


def test_an_unknown_relation_names_its_line_or_is_counted(tmp_path):
    source = write_text(tmp_path / "e.tsv", [("a", "follows", "b"), ("a", "folows", "b")])
    with pytest.raises(PbgRayError, match="line 2: unknown relation name 'folows' "
                                          r"\(did you mean 'follows'\?\)"):
        IdReader(make(tmp_path, [source])).read(0, tmp_path / "spill.bin")
    reader = IdReader(make(tmp_path, [source], skip_bad_rows=True))
    stats = reader.read(0, tmp_path / "spill.bin")
    assert stats["bad_rows"] == 1 and len(spilled(reader, tmp_path / "spill.bin")) == 1


def test_entity_types_of_edges(tmp_path):
    config = make(tmp_path, [], **TYPED)
    types = EntityTypes.of(config)
    assert types.names == ["user", "item"]
    assert types.of_edges("rhs", np.array([1, 0, 1])).tolist() == [1, 0, 1]
    assert types.of_edges("lhs", np.array([1, 0, 1])).tolist() == [0, 0, 0]
    dynamic = EntityTypes(["user", "item"], np.array([1]), np.array([0]), dynamic=True)
    assert dynamic.of_edges("lhs", np.array([5, 7])).tolist() == [1, 1]  # relation 0's types
