"""Export and predict's batch mode as Ray tasks, one per partition (runtime/partition_jobs.py):
the same files and answers as the library's single-process path, to local paths and to a
real S3-compatible server; a failed export leaves no _SUCCESS and none of its files."""

import collections
import dataclasses
import json
import re
import zipfile

import numpy as np
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest

from pbg_ray.checkpoints.exporter import export_checkpoint
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation import entity_names
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.io.embedding_tables import SUCCESS_FILE
from pbg_ray.io.entities import save_entity_names
from pbg_ray.io.storage import join, storage_path
from pbg_ray.predict import main as predict_main
from pbg_ray.runtime.partition_jobs import RayPartitionMap, partition_map, predictor_map
from tests.util import partitioned_checkpoint

FORMATS = ["tsv", "parquet", "bundle"]


@pytest.fixture
def checkpoint(tmp_path):
    """Four partitions of a few hundred entities each."""
    return partitioned_checkpoint(tmp_path / "graph", 4, 1200, 16, num_edges=100)


def exported(config, fmt, output, run=None):
    config.export.format, config.export.output = fmt, str(output)
    config.export.variants = ["fp32", "int8"] if fmt == "bundle" else ["fp32"]
    return export_checkpoint(config, run) if run else export_checkpoint(config)


def contents(output):
    """{relative name: bytes} of an export (a bundle's members, each on its own)."""
    root = storage_path(str(output))
    fs, base = pafs.FileSystem.from_uri(str(root)) if "://" in str(root) else (
        pafs.LocalFileSystem(), str(root))
    found = {}
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        name = info.path[len(base):].lstrip("/")
        with fs.open_input_stream(info.path) as f:
            data = f.read()
        if name.endswith(".zip"):
            with zipfile.ZipFile(__import__("io").BytesIO(data)) as z:
                found.update({f"{name}:{m}": z.read(m) for m in z.namelist()})
        else:
            found[name] = data
    return found


def without_places(files):
    """An export's files but _SUCCESS, and the export settings (which name the output) left
    out of a bundle's configs."""
    def settled(name, data):
        if not name.endswith("config.json"):
            return data
        return {k: v for k, v in json.loads(data).items() if k != "export"}
    return {k: settled(k, v) for k, v in files.items() if k != SUCCESS_FILE}


def same_export(ours, theirs):
    """The files of two exports are identical but for where they are."""
    assert SUCCESS_FILE in ours and SUCCESS_FILE in theirs
    assert without_places(ours) == without_places(theirs)
    summary = json.loads(ours[SUCCESS_FILE])
    assert summary == {**json.loads(theirs[SUCCESS_FILE]),
                       **{k: summary[k] for k in ("files", "file", "file_bytes") if k in summary}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_ray_export_matches_the_single_process_one(ray_session, checkpoint, tmp_path, fmt):
    exported(checkpoint, fmt, tmp_path / "local")
    result = exported(checkpoint, fmt, tmp_path / "ray", partition_map(checkpoint))
    ours = contents(tmp_path / "ray")
    same_export(ours, contents(tmp_path / "local"))
    if fmt == "parquet":  # a dataset of one file per partition
        assert sorted(n for n in ours if n.startswith("entities/")) == [
            f"entities/node_{p}.parquet" for p in range(4)]
        table = ds.dataset(str(tmp_path / "ray" / "entities")).to_table()
        assert table.num_rows == result["entities"] == sum(1200 // 4 + p for p in range(4))
        assert sorted(set(table.column("partition").to_pylist())) == [0, 1, 2, 3]


@pytest.mark.s3
def test_exports_to_object_storage_are_the_local_files(ray_session, checkpoint, tmp_path, s3_root):
    for fmt in FORMATS:
        exported(checkpoint, fmt, tmp_path / fmt)
        output = join(s3_root, f"exports/{fmt}")
        exported(checkpoint, fmt, output, partition_map(checkpoint))
        same_export(contents(output), contents(tmp_path / fmt))
    # A warehouse reads the Parquet export where it lies: a dataset of one file per partition.
    fs, base = pafs.FileSystem.from_uri(join(s3_root, "exports/parquet/entities"))
    table = ds.dataset(base, filesystem=fs).to_table()
    assert table.num_rows == sum(1200 // 4 + p for p in range(4))
    embeddings = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert embeddings.shape == (table.num_rows, 16)


def test_a_failed_export_leaves_no_marker_and_none_of_its_files(ray_session, checkpoint, tmp_path):
    output = tmp_path / "out"
    exported(checkpoint, "parquet", output, partition_map(checkpoint))
    assert (output / SUCCESS_FILE).is_file()
    save_entity_names(checkpoint.entity_path, "node", 2, ["just-one"])  # damages partition 2
    with pytest.raises(PbgRayError, match=r"'node' partition 2: 1 names in entity_path but 302 "):
        exported(checkpoint, "parquet", output, RayPartitionMap({"num_cpus": 1}, 2))
    assert not (output / SUCCESS_FILE).exists()
    assert not list(output.rglob("*.parquet")), "files of the failed export were left"


def test_predict_tasks_take_the_cluster_cpus_spread_over_the_partitions(ray_session, checkpoint):
    # On 2 CPUs, 4 partitions: a CPU a task where training's took 2, so that one task reads
    # its partition while another scores; one partition: ray.cpus_per_trainer's 2 at most.
    two = dataclasses.replace(checkpoint, ray=dataclasses.replace(checkpoint.ray,
                                                                  cpus_per_trainer=2.0))
    assert predictor_map(two).options["num_cpus"] == 1
    whole = dataclasses.replace(two, entities={"node": dataclasses.replace(
        two.entities["node"], num_partitions=1)})
    assert predictor_map(whole).options["num_cpus"] == 2
    half = dataclasses.replace(two, ray=dataclasses.replace(two.ray, cpus_per_trainer=0.5))
    assert predictor_map(half).options["num_cpus"] == 0.5


def write_queries(path, rows):
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.s3
def test_predict_batch_writes_the_single_queries_answers(ray_session, checkpoint, tmp_path,
                                                         s3_root, capsys):
    model = Predictor.load(checkpoint.checkpoint_path)
    names = [f"node-{p}-{i}" for p in range(4) for i in (0, 7, 150)]
    queries = join(s3_root, "queries.tsv")
    storage_path(queries).write_text("".join(f"{n}\tto\n" for n in names))
    output = join(s3_root, "answers/top.jsonl")
    predict_main([checkpoint.checkpoint_path, "top-rhs", "--queries", queries, "-k", "5",
                  "--exclude", checkpoint.edge_paths[0], "--output", output])
    assert json.loads(capsys.readouterr().out) == {"queries": len(names), "failed": 0,
                                                   "output": output}
    answers = [json.loads(line) for line in storage_path(output).read_text().splitlines()]
    assert [(a["lhs"], a["relation"]) for a in answers] == [(n, "to") for n in names]
    for answer, name in zip(answers, names):
        same_ranking(answer["hits"], model.top_rhs(name, "to", k=5, exclude=checkpoint.edge_paths))


def same_ranking(ours, theirs):
    """The same entities in the same order (`ours` a line's hits, `theirs` the API's),
    scores equal up to rounding (a batch of queries is scored by one matrix product, a
    single query by its own)."""
    assert [h["name"] for h in ours] == [h.name for h in theirs]
    np.testing.assert_allclose([h["score"] for h in ours], [h.score for h in theirs], rtol=1e-5)


def test_predict_batch_of_each_command_to_stdout(ray_session, checkpoint, tmp_path, capsys):
    model = Predictor.load(checkpoint.checkpoint_path)
    triples = [("node-0-1", "to", "node-3-2"), ("node-2-5", "to", "node-1-9")]
    predict_main([checkpoint.checkpoint_path, "score", "--queries", write_queries(tmp_path / "s", triples)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(a["lhs"], a["relation"], a["rhs"]) for a in lines] == triples
    np.testing.assert_allclose([a["score"] for a in lines], model.score(triples), rtol=1e-5)
    predict_main([checkpoint.checkpoint_path, "neighbors", "--queries",
                  write_queries(tmp_path / "n", [("node-1-4",), ("node-3-0",)]), "-k", "3"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for line, name in zip(lines, ("node-1-4", "node-3-0")):
        same_ranking(line["hits"], model.neighbors(name, k=3))
    predict_main([checkpoint.checkpoint_path, "top-lhs", "--queries",
                  write_queries(tmp_path / "l", [("to", "node-2-2")]), "-k", "4"])
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    same_ranking(line["hits"], model.top_lhs("to", "node-2-2", k=4))


def test_predict_batch_reads_each_names_file_once(ray_session, checkpoint, tmp_path, capsys,
                                                  monkeypatch):
    # Its questions name entities of every partition, and so do its answers: with every
    # partition's names kept (they fit the budget), no names file is read a second time.
    reads = collections.Counter()
    read = entity_names.load_entity_names

    def counted(path, entity, part):
        reads[part] += 1
        return read(path, entity, part)

    monkeypatch.setattr(entity_names, "load_entity_names", counted)
    queries = write_queries(tmp_path / "q", [(f"node-{p}-3", "to") for p in range(4)])
    predict_main([checkpoint.checkpoint_path, "top-rhs", "--queries", queries, "-k", "20"])
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    named = {int(hit["name"].split("-")[1]) for a in answers for hit in a["hits"]}
    assert named == {0, 1, 2, 3}
    assert reads == {0: 1, 1: 1, 2: 1, 3: 1}


def test_predict_batch_answers_the_good_lines_and_names_the_bad_ones(ray_session, checkpoint,
                                                                     tmp_path, capsys):
    """Each bad line (too few fields, an unknown entity or relation) gets its error, in the
    output and on stderr with its number; the good ones are answered; exit status 1."""
    model = Predictor.load(checkpoint.checkpoint_path)
    lines = [("node-0-1", "to"), ("node-0-2",), ("node-9-9", "to"), ("node-1-1", "too"),
             ("node-2-3", "to")]
    queries = write_queries(tmp_path / "mixed", lines)
    with pytest.raises(SystemExit) as exit_info:
        predict_main([checkpoint.checkpoint_path, "top-rhs", "--queries", queries, "-k", "3"])
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    answers = [json.loads(line) for line in out.splitlines()]
    assert [a["line"] for a in answers] == [1, 2, 3, 4, 5]
    for answer, (name, relation) in ((answers[0], lines[0]), (answers[4], lines[4])):
        same_ranking(answer["hits"], model.top_rhs(name, relation, k=3))
    assert "1 tab-separated field(s), top-rhs needs 2" in answers[1]["error"]
    assert answers[2]["error"].startswith("unknown node entity 'node-9-9'")
    assert "unknown relation 'too' (did you mean 'to'?)" in answers[3]["error"]
    reported = [line for line in err.splitlines() if line.startswith("pbg_ray: error:")]
    assert [re.search(r", line (\d+):", line).group(1) for line in reported] == ["2", "3", "4"]
    assert "3 of 5 questions failed; the others are answered" in err


def test_predict_batch_refuses_bad_queries(checkpoint, tmp_path, capsys):
    for argv, message in [
            (["top-rhs", "--queries", str(tmp_path / "none")], r"--queries file .*none' does not exist"),
            (["top-rhs", "node-0-1", "to", "--output", "x"], r"--output needs --queries FILE"),
            (["top-rhs", "node-0-1"], r"top-rhs needs LHS RELATION, or --queries FILE")]:
        with pytest.raises(SystemExit) as exit_info:
            predict_main([checkpoint.checkpoint_path, *argv])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err)
