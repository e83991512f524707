"""Importer inputs: a file, a directory of shards or a glob, local or on object storage."""

import collections
import gzip
import json
import logging

import pyarrow.fs as pafs
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.importer import import_graph
from pbg_ray.io.raw import input_shards
from pbg_ray.io.storage import storage_path
from tests.importer.util import decoded, error_of, make, random_rows, write_text


def shard_dir(root, rows, parts=3):
    """`rows` as `parts` TSV shards in root/shards (the second gzipped), with the files a
    Spark job leaves beside them."""
    shards = root / "shards"
    shards.mkdir(parents=True)
    size = -(-len(rows) // parts)
    for i in range(parts):
        name = f"part-{i:05d}.tsv" + (".gz" if i == 1 else "")
        write_text(shards / name, rows[i * size:(i + 1) * size])
    (shards / "_SUCCESS").write_text("")
    (shards / ".part-00000.tsv.crc").write_text("not an edge file")
    return shards


def test_a_directory_or_a_glob_imports_as_its_shards_together(tmp_path):
    rows = random_rows(300)
    shards = shard_dir(tmp_path, rows)
    assert [s.path.name for s in input_shards(str(shards))] == [
        "part-00000.tsv", "part-00001.tsv.gz", "part-00002.tsv"]
    whole = make(tmp_path / "whole", [write_text(tmp_path / "all.tsv", rows)])
    by_dir = make(tmp_path / "dir", [str(shards)])
    by_glob = make(tmp_path / "glob", [str(shards / "part-*.tsv*")])
    stats = [import_graph(c) for c in (whole, by_dir, by_glob)]
    assert stats[1]["inputs"][0]["shards"] == 3 and stats[1]["inputs"][0]["rows"] == 300
    expected = collections.Counter(rows)
    for config in (whole, by_dir, by_glob):
        assert decoded(config, config.edge_paths[0]) == expected
    # The same seed, the same rows: the same dictionaries, however the rows are split.
    for part in range(2):
        name = f"entity_names_node_{part}.json"
        assert ({(storage_path(c.entity_path) / name).read_text() for c in (whole, by_dir)}
                == {(storage_path(whole.entity_path) / name).read_text()})


def test_a_bad_row_names_its_shard_and_line(tmp_path):
    rows = random_rows(30)
    shards = shard_dir(tmp_path, rows)
    (shards / "part-00002.tsv").write_text("a\tfollows\tb\nc\tfollows\n")
    message = error_of(make(tmp_path, [str(shards)]))
    assert "part-00002.tsv', line 2" in message and "skip_bad_rows" in message
    assert not list((tmp_path / "train").glob("*")) if (tmp_path / "train").exists() else True
    stats = import_graph(make(tmp_path, [str(shards)], skip_bad_rows=True))
    assert stats["inputs"][0]["bad_rows"] == 1
    assert "part-00002.tsv'" in stats["inputs"][0]["bad_row_examples"][0]


def test_compressed_shards_are_told_by_their_first_bytes_whatever_their_names(tmp_path):
    # One shard per codec, half of them named as plain text.
    rows = random_rows(80)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, (codec, suffix) in enumerate([("gzip", ".gz"), ("bz2", ""), ("zstd", ".zst"),
                                         ("lz4", ""), (None, "")]):
        write_text(shards / f"part-{i}.tsv{suffix}", rows[i * 16:(i + 1) * 16], codec=codec)
    config = make(tmp_path, [str(shards)])
    assert import_graph(config)["inputs"][0]["edges"] == 80
    assert decoded(config, config.edge_paths[0]) == collections.Counter(rows)


@pytest.mark.parametrize("kept", [0.01, 0.6])  # in its first line, or after
def test_a_compressed_stream_cut_short_is_one_line_naming_the_file(tmp_path, kept):
    path = tmp_path / "edges.tsv.zst"
    write_text(path, random_rows(20000), codec="zstd")
    whole = path.read_bytes()
    path.write_bytes(whole[:int(len(whole) * kept)])
    message = error_of(make(tmp_path, [str(path)]))
    assert "edges.tsv.zst" in message and "cut short" in message, message
    assert not (tmp_path / "train").exists() or not list((tmp_path / "train").iterdir())


@pytest.mark.parametrize("spec, problem", [("empty", "is an empty directory"),
                                           ("nothing-*.tsv", "matches no file"),
                                           ("missing.tsv", "does not exist")])
def test_an_input_without_files_is_refused(tmp_path, spec, problem):
    (tmp_path / "empty").mkdir()
    message = error_of(make(tmp_path, [str(tmp_path / spec)]))
    assert problem in message and "importer.inputs" in message


def test_credentials_in_an_input_uri_are_refused():
    with pytest.raises(PbgRayError, match="carries credentials") as err:
        input_shards("s3://bucket/edges?access_key=AKIAX&secret_key=hush")
    assert "hush" not in str(err.value)


@pytest.mark.s3
def test_csv_shards_on_object_storage_import_to_object_storage(s3_root, tmp_path, monkeypatch,
                                                                caplog, capsys):
    # Credentials from the environment only (the test server takes any), never written.
    secret = "sEcReT-value-that-must-not-leak"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    rows = random_rows(200)
    local = tmp_path / "local"
    local.mkdir()
    header = ("src", "rel", "dst")
    write_text(local / "part-0.csv", rows[:120], ",", header)
    (local / "part-1.csv.gz").write_bytes(gzip.compress(
        ("src,rel,dst\n" + "".join(",".join(r) + "\n" for r in rows[120:])).encode()))
    base, _ = s3_root.split("?")
    query = "?" + s3_root.split("?")[1]
    fs, _ = pafs.FileSystem.from_uri(s3_root)
    bucket = base[len("s3://"):]
    for name in ("part-0.csv", "part-1.csv.gz"):
        with fs.open_output_stream(f"{bucket}/raw/{name}", compression=None) as out:
            out.write((local / name).read_bytes())
    with fs.open_output_stream(f"{bucket}/raw/_SUCCESS") as out:
        out.write(b"")
    config = make(tmp_path, [f"{base}/raw{query}"], lhs_col="src", rel_col="rel",
                  rhs_col="dst")
    config.entity_path = f"{base}/graph/entities{query}"
    config.edge_paths = [f"{base}/graph/train{query}"]
    caplog.set_level(logging.DEBUG)
    stats = import_graph(config)
    assert stats["inputs"][0]["shards"] == 2
    assert decoded(config, config.edge_paths[0]) == collections.Counter(rows)
    written = [info for info in fs.get_file_info(pafs.FileSelector(f"{bucket}/graph",
                                                                   recursive=True))
               if info.type == pafs.FileType.File]
    assert not [i.path for i in written if ".import-" in i.path]  # staging removed
    for info in written:
        with fs.open_input_stream(info.path) as f:
            assert secret.encode() not in f.read(), info.path
    assert secret not in json.dumps(stats) + caplog.text + "".join(capsys.readouterr())
