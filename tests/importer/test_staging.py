"""The staging and commit phase: nothing half-written in place, the manifest last."""

import json

import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import import_graph, staging
from pbg_ray.importer.staging import MANIFEST, ImportTarget
from tests.importer.util import make, random_rows, write_text


def contents(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.suffix != ".tsv"}


def staged_graph(stages, tag="new"):
    """A stand-in for what the other phases write: one bucket per output, entity files."""
    for stage in stages.edges:
        (stage / "edges_0_0.h5").write_text(f"{tag} bucket")
        (stage / "spill.bin").write_text("not a graph file")
    (stages.entities / "entity_count_node_0.txt").write_text("1")
    (stages.entities / "entity_names_node_0.json").write_text(json.dumps([tag]))


@pytest.fixture
def imported(tmp_path):
    """A graph imported under tmp_path: an entity path, a train and an eval edge path."""
    source = write_text(tmp_path / "a.tsv", random_rows(50))
    config = make(tmp_path, [source, source])
    import_graph(config)
    return config


def test_a_failure_before_the_commit_leaves_the_outputs_as_they_were(tmp_path, imported):
    target = ImportTarget(make(tmp_path, imported.importer.inputs, overwrite=True))
    before = contents(tmp_path)
    with pytest.raises(RuntimeError, match="routing failed"):
        with staging.staging(target) as stages:
            assert all(stage.parent == out for stage, out in zip(stages.edges, target.edge_paths))
            staged_graph(stages)
            raise RuntimeError("routing failed")
    assert contents(tmp_path) == before
    assert not list(tmp_path.rglob(".import-*"))


def test_commit_moves_buckets_then_entity_files_then_the_manifest(tmp_path, monkeypatch, imported):
    target = ImportTarget(make(tmp_path, imported.importer.inputs, overwrite=True))
    moved = []
    move_into = staging.move_into
    monkeypatch.setattr(staging, "move_into",
                        lambda path, to: moved.append(to.name) or move_into(path, to))
    write_text_atomic = staging.write_text_atomic
    monkeypatch.setattr(staging, "write_text_atomic",
                        lambda path, text: moved.append(path.name) or write_text_atomic(path, text))
    with staging.staging(target) as stages:
        staged_graph(stages)
        target.commit(stages, {"edges": 2})
    assert moved == ["edges_0_0.h5", "edges_0_0.h5", "entity_count_node_0.txt",
                     "entity_names_node_0.json", MANIFEST]
    # The old graph's files are gone, the new ones in place, and no staging is left.
    assert sorted(p.name for p in target.graph_files()) == sorted(moved)
    assert (tmp_path / "eval1" / "edges_0_0.h5").read_text() == "new bucket"
    assert target.done() == {"edges": 2}
    assert not list(tmp_path.rglob(".import-*")) and not list(tmp_path.rglob("spill.bin"))


def test_a_commit_cut_short_leaves_no_manifest(tmp_path, monkeypatch, imported):
    target = ImportTarget(make(tmp_path, imported.importer.inputs, overwrite=True))

    def fail_on_entities(path, to):
        if to.name.startswith("entity_"):
            raise OSError("disk full")
        path.rename(to)

    monkeypatch.setattr(staging, "move_into", fail_on_entities)
    with pytest.raises(OSError, match="disk full"):
        with staging.staging(target) as stages:
            staged_graph(stages)
            target.commit(stages, {"edges": 2})
    # Half replaced, and it doesn't look complete: it is no import's graph.
    assert not (tmp_path / "entities" / MANIFEST).exists()
    with pytest.raises(PbgRayError, match="not imported by pbg_ray"):
        ImportTarget(make(tmp_path, imported.importer.inputs)).done()


def test_the_same_import_is_done_and_a_different_one_refused(tmp_path, imported):
    assert ImportTarget(make(tmp_path / "elsewhere", imported.importer.inputs)).done() is None
    stats = ImportTarget(imported).done()
    assert stats is not None and stats["inputs"][0]["rows"] == 50
    other = make(tmp_path, imported.importer.inputs, seed=1)
    with pytest.raises(PbgRayError, match="already hold a different graph"):
        ImportTarget(other).done()
    overwrite = make(tmp_path, imported.importer.inputs, seed=1, overwrite=True)
    assert ImportTarget(overwrite).done() is None
