"""import_graph, the importer's phases together: raw files in, PBG v1 layout out (and
torchbiggraph reads it); and python -m pbg_ray.import_edges."""

import collections
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbg_ray.importer import import_graph
from pbg_ray.importer.staging import MANIFEST
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import load_dynamic_rel_count, load_entity_names, load_relation_names
from pbg_ray.types import Bucket
from tests.importer.util import (
    RELATIONS, decoded, error_of, make, random_rows, write_parquet, write_text)
from tests.util import config_dict


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz", ".csv", ".csv.gz", ".tsv.bz2", ".csv.zst",
                                    ".tsv.lz4", ".parquet"])
def test_round_trip_by_index(tmp_path, suffix):
    rows = random_rows(300)
    path = tmp_path / f"edges{suffix}"
    source = (write_parquet(path, rows, compression="gzip") if suffix == ".parquet"
              else write_text(path, rows, delimiter="," if ".csv" in suffix else "\t"))
    config = make(tmp_path, [source])
    stats = import_graph(config)
    assert decoded(config, config.edge_paths[0]) == collections.Counter(rows)
    assert stats["inputs"][0]["edges"] == 300
    all_names = [n for p in range(2) for n in load_entity_names(config.entity_path, "node", p)]
    assert sorted(all_names) == sorted({n for r in rows for n in (r[0], r[2])})
    assert abs(len(load_entity_names(config.entity_path, "node", 0)) - len(all_names) / 2) <= 0.5
    assert not list(tmp_path.rglob(".import-*")), "staging left behind"


def test_columns_by_name_with_weights_and_the_same_ids_from_any_format(tmp_path):
    rows = [(lhs, rel, rhs, 0.5 + i % 3)
            for i, (lhs, rel, rhs) in enumerate(random_rows(200, seed=1))]
    ordered = [(r[2], r[3], r[0], r[1]) for r in rows]  # columns: dst, weight, src, rel
    csv = write_text(tmp_path / "e.csv", ordered, delimiter=",", header=["dst", "w", "src", "rel"])
    parquet = write_parquet(tmp_path / "e.parquet", ordered, columns=("dst", "w", "src", "rel"))
    names_by_format = []
    for name, source in (("csv", csv), ("parquet", parquet)):
        config = make(tmp_path / name, [source], lhs_col="src", rel_col="rel", rhs_col="dst",
                      weight_col="w")
        import_graph(config)
        assert decoded(config, config.edge_paths[0], weights=True) == collections.Counter(rows)
        names_by_format.append([load_entity_names(config.entity_path, "node", p) for p in range(2)])
    # A canonical order before the seeded shuffle: the same names get the same ids.
    assert names_by_format[0] == names_by_format[1]


def test_min_counts_and_dynamic_relations(tmp_path):
    rows = [("a", "r1", "b")] * 3 + [("a", "r2", "c"), ("b", "r3", "a"), ("b", "r3", "d")]
    source = write_text(tmp_path / "e.tsv", rows)
    config = make(tmp_path, [source], entities={"node": {"num_partitions": 1}},
                  relations=[{"name": "any", "lhs": "node", "rhs": "node",
                              "operator": "translation"}],
                  dynamic_relations=True, entity_min_count=2, relation_type_min_count=2)
    stats = import_graph(config)
    # a: 5 sightings, b: 5, c: 1 (dropped), d: 1 (dropped); r2 occurs once (dropped).
    assert sorted(load_entity_names(config.entity_path, "node", 0)) == ["a", "b"]
    assert sorted(load_relation_names(config.entity_path)) == ["r1", "r3"]
    assert load_dynamic_rel_count(config.entity_path) == 2
    assert decoded(config, config.edge_paths[0]) == collections.Counter(
        [("a", "r1", "b")] * 3 + [("b", "r3", "a")])
    assert stats["inputs"][0]["dropped_rare"] == 2


def typed_rows():
    """400 edges of three relations between three entity types (user, item, tag)."""
    entities = {"user": {"num_partitions": 2}, "item": {"num_partitions": 2},
                "tag": {"num_partitions": 1}}
    relations = [{"name": "follows", "lhs": "user", "rhs": "user"},
                 {"name": "likes", "lhs": "user", "rhs": "item"},
                 {"name": "tagged", "lhs": "item", "rhs": "tag"}]
    rng = np.random.default_rng(2)
    pick = {"user": [f"u{i}" for i in range(30)], "item": [f"i{i}" for i in range(20)],
            "tag": ["t0", "t1"]}
    rows = []
    for _ in range(400):
        rel = relations[rng.integers(3)]
        rows.append((pick[rel["lhs"]][rng.integers(len(pick[rel["lhs"]]))], rel["name"],
                     pick[rel["rhs"]][rng.integers(len(pick[rel["rhs"]]))]))
    return entities, relations, rows


def test_fixed_relations_pick_entity_types_and_later_inputs_reuse_dictionaries(tmp_path):
    entities, relations, rows = typed_rows()
    known = rows[:50]
    unseen = [("u-new", "follows", "u1"), ("i1", "tagged", "t-new")]
    train = write_text(tmp_path / "train.tsv", rows)
    test = write_text(tmp_path / "test.tsv", known + unseen)
    config = make(tmp_path, [train, test], entities=entities, relations=relations)
    stats = import_graph(config)
    assert decoded(config, config.edge_paths[0]) == collections.Counter(rows)
    assert decoded(config, config.eval_edge_paths[0]) == collections.Counter(known)
    assert stats["inputs"][1]["dropped_unseen"] == 2
    assert stats["entities"] == {"user": 30, "item": 20, "tag": 2}
    # The unpartitioned tag type's edges are spread over all buckets (v1 spec).
    assert all(len(read_edges(config.edge_paths[0], Bucket(0, r)).rel) for r in range(2))


@pytest.mark.oracle
def test_torchbiggraph_reads_a_typed_import(tmp_path):
    entities, relations, rows = typed_rows()
    config = make(tmp_path, [write_text(tmp_path / "train.tsv", rows)], entities=entities,
                  relations=relations)
    import_graph(config)
    from tests.oracle import assert_torchbiggraph_reads_import

    assert_torchbiggraph_reads_import(config)


def test_same_seed_same_result_and_a_rerun_is_a_no_op(tmp_path):
    source = write_text(tmp_path / "e.tsv", random_rows(100))
    config = make(tmp_path, [source], seed=7)
    first = import_graph(config)
    names = load_entity_names(config.entity_path, "node", 0)
    assert import_graph(config) == first  # same import already there: nothing to do
    other = make(tmp_path / "other", [source], seed=7)
    import_graph(other)
    assert load_entity_names(other.entity_path, "node", 0) == names


def test_bad_rows_name_file_and_line_or_are_counted(tmp_path):
    lines = "a\tfollows\tb\n\nc\tlikes\n d\tfollows\te\n"
    path = tmp_path / "e.tsv"
    path.write_text(lines)
    message = error_of(make(tmp_path, [str(path)]))
    assert "e.tsv', line 3" in message and "skip_bad_rows" in message
    assert not list(tmp_path.rglob("*.h5")) and not list(tmp_path.rglob("entity_count_*"))

    path.write_text("a\tfollows\tb\nc\tlikes\t\nd\tfollows\te\n")
    assert "line 2: empty rhs name" in error_of(make(tmp_path, [str(path)]))

    path.write_text("a\tfollows\tb\nc\tlikes\nd\tfollows\te\nf\tfollows\t\n")
    stats = import_graph(make(tmp_path, [str(path)], skip_bad_rows=True))
    assert stats["inputs"][0]["bad_rows"] == 2 and stats["inputs"][0]["edges"] == 2
    assert len(stats["inputs"][0]["bad_row_examples"]) == 2

    weights = tmp_path / "w.parquet"
    pq.write_table(pa.table({"s": ["a", "b"], "r": ["follows", "likes"], "d": ["b", "c"],
                             "w": ["1.5", "heavy"]}), weights)
    message = error_of(make(tmp_path / "w", [str(weights)], weight_col="w"))
    assert "row group 0, row 1" in message and "weight is not a number" in message


def test_missing_column_empty_file_unknown_relation(tmp_path):
    source = write_text(tmp_path / "e.tsv", [("a", "follows", "b")])
    assert "has 3 column(s); importer.weight_col=5 is out of range" in error_of(
        make(tmp_path, [source], weight_col=5))
    parquet = write_parquet(tmp_path / "e.parquet", [("a", "follows", "b")])
    assert "has no column 'dts' (did you mean 'dst'?)" in error_of(
        make(tmp_path, [parquet], lhs_col="src", rel_col="rel", rhs_col="dts"))
    (tmp_path / "empty.tsv").write_text("")
    assert "is empty" in error_of(make(tmp_path, [str(tmp_path / "empty.tsv")]))
    header_only = write_text(tmp_path / "h.csv", [], delimiter=",", header=["s", "r", "d"])
    assert "holds no edges" in error_of(
        make(tmp_path, [header_only], lhs_col="s", rel_col="r", rhs_col="d"))
    bad_rel = write_text(tmp_path / "r.tsv", [("a", "follows", "b"), ("a", "folows", "b")])
    message = error_of(make(tmp_path, [bad_rel]))
    assert "line 2: unknown relation name 'folows' (did you mean 'follows'?)" in message


def test_a_different_graph_in_the_output_is_refused_and_a_failed_import_changes_nothing(tmp_path):
    first = write_text(tmp_path / "a.tsv", random_rows(50, seed=1))
    config = make(tmp_path, [first])
    import_graph(config)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "tsv" not in p.name}
    second = write_text(tmp_path / "b.tsv", random_rows(50, seed=2))
    assert "already hold a different graph" in error_of(make(tmp_path, [second]))
    broken = tmp_path / "c.tsv"
    broken.write_text("a\tfollows\tb\nbroken line\n")
    error_of(make(tmp_path, [str(broken)], overwrite=True))
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "tsv" not in p.name}
    assert after == before
    stats = import_graph(make(tmp_path, [second], overwrite=True))
    assert json.loads((tmp_path / "entities" / MANIFEST).read_text())["stats"] == stats


def test_entry_point(tmp_path):
    source = write_text(tmp_path / "e.tsv", random_rows(20))
    data = config_dict(tmp_path, entities={"node": {"num_partitions": 1}}, global_emb=False,
                       relations=[{"name": r, "lhs": "node", "rhs": "node"} for r in RELATIONS])
    module = tmp_path / "pbg_config.py"
    module.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "pbg_ray.import_edges", str(module),
                                        *args],
                                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    proc = run(f"importer.inputs=[{source}]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["inputs"][0]["edges"] == 20
    proc = run(f"importer.inputs=[{source}]", "importer.rhs_col=9", "importer.overwrite=true")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "importer.rhs_col=9 is out of range" in proc.stderr
