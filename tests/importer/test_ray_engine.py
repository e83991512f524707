"""The importer on Ray tasks and actors gives what the local importer gives: the same entity
files and the same edges in every bucket, on one node, on object storage, on two nodes and
with its names spilled to disk over several passes."""

import collections
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import ray
from ray.exceptions import WorkerCrashedError

from pbg_ray.cli import user_error
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer import plan, ray_engine
from pbg_ray.importer.ray_engine import choose_engine, import_graph
from pbg_ray.importer.read import RELATIONS
from pbg_ray.io import raw
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import save_entity_count, save_entity_names
from pbg_ray.io.name_keys import name_keys
from pbg_ray.io.storage import storage_path
from pbg_ray.runtime.tasks import TASK_RETRIES
from pbg_ray.types import Bucket
from tests.fault_injection import armed
from tests.importer.util import error_of, make, random_rows, write_parquet, write_text

TYPED = dict(entities={"node": {"num_partitions": 2}, "tag": {}, "unused": {}},
             relations=[{"name": "follows", "lhs": "node", "rhs": "node"},
                        {"name": "likes", "lhs": "node", "rhs": "tag"}])


def buckets(config: ConfigSchema, edge_path: str) -> dict:
    """Each bucket's edges as a multiset of (lhs, rhs, rel[, weight])."""
    parts = config.num_partitions()
    out = {}
    for lhs in range(parts):
        for rhs in range(parts):
            edges = read_edges(edge_path, Bucket(lhs, rhs))
            columns = [edges.lhs, edges.rhs, edges.rel] + (
                [edges.weight] if edges.weight is not None else [])
            out[lhs, rhs] = collections.Counter(zip(*(c.tolist() for c in columns)))
    return out


def entity_files(config: ConfigSchema) -> dict:
    root = storage_path(config.entity_path)
    return {p.name: p.read_bytes() for p in root.iterdir()
            if p.name.startswith(("entity_", "dynamic_rel"))}


def assert_same_import(local: ConfigSchema, other: ConfigSchema, local_stats: dict,
                       other_stats: dict) -> None:
    assert entity_files(local) == entity_files(other)
    for mine, theirs in zip(local.edge_paths + local.eval_edge_paths,
                            other.edge_paths + other.eval_edge_paths):
        assert buckets(local, mine) == buckets(other, theirs)
    drop = ("output", "input")
    assert ([{k: v for k, v in s.items() if k not in drop} for s in local_stats["inputs"]]
            == [{k: v for k, v in s.items() if k not in drop} for s in other_stats["inputs"]])
    assert local_stats["entities"] == other_stats["entities"]


def typed_rows(n, seed):
    """Rows over two relations, `likes` pointing at an unpartitioned tag type, with weights."""
    rows = random_rows(n, seed)
    return [(l, r, f"tag{hash(h) % 5}" if r == "likes" else h, str(i % 7 + 0.5))
            for i, (l, r, h) in enumerate(rows)]


def test_ray_engine_matches_the_local_engine(ray_session, tmp_path):
    rows = typed_rows(600, 0) + [(f"rare{i}", "follows", "n1", "2") for i in range(3)]
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        write_text(shards / (f"part-{i}.tsv" + (".gz" if i == 1 else "")),
                   rows[i * 201:(i + 1) * 201])
    (shards / "part-2.tsv").write_text((shards / "part-2.tsv").read_text() + "bad\trow\n")
    test = write_text(tmp_path / "test.tsv", typed_rows(80, 1) + [("new", "follows", "n1", "1")])
    settings = dict(entity_min_count=3, weight_col=3, skip_bad_rows=True, seed=5)
    local = make(tmp_path / "local", [str(shards), test], **TYPED, engine="local", **settings)
    on_ray = make(tmp_path / "ray", [str(shards), test], **TYPED, engine="ray", **settings)
    local_stats, ray_stats = import_graph(local), import_graph(on_ray)
    assert ray_stats["inputs"][0]["dropped_rare"] > 0 and ray_stats["inputs"][1]["dropped_unseen"]
    assert "part-2.tsv', line 202" in ray_stats["inputs"][0]["bad_row_examples"][0]
    assert_same_import(local, on_ray, local_stats, ray_stats)
    assert all(buckets(on_ray, on_ray.edge_paths[0])[0, r] for r in range(2))  # tags spread
    assert import_graph(on_ray) == ray_stats  # the same import again: nothing to do


def test_one_partition_is_written_by_one_names_writer(ray_session, tmp_path):
    source = write_text(tmp_path / "e.tsv", random_rows(100, 4))
    local = make(tmp_path / "local", [source], entities={"node": {}}, engine="local")
    on_ray = make(tmp_path / "ray", [source], entities={"node": {}}, engine="ray")
    assert_same_import(local, on_ray, import_graph(local), import_graph(on_ray))


@pytest.mark.slow
def test_ray_engine_grows_a_previous_import_with_dynamic_relations(ray_session, tmp_path):
    old = write_text(tmp_path / "old.tsv", random_rows(200, 0, num_names=30))
    new = write_text(tmp_path / "new.tsv", random_rows(300, 1, num_names=50))
    one = [{"name": "any", "lhs": "node", "rhs": "node"}]
    first = make(tmp_path / "first", [old], relations=one, dynamic_relations=True,
                 engine="local")
    import_graph(first)
    grown = {}
    for engine in ("local", "ray"):
        config = make(tmp_path / engine, [new], relations=one, dynamic_relations=True,
                      engine=engine,
                      entity_min_count=2, previous_entity_path=first.entity_path,
                      previous_edge_paths=first.edge_paths)
        grown[engine] = config, import_graph(config)
    assert grown["ray"][1]["new_entities"] == grown["local"][1]["new_entities"]
    assert grown["ray"][1]["inputs"][0]["previous_edges"] == 200
    assert_same_import(*grown["local"][:1], *grown["ray"][:1], grown["local"][1], grown["ray"][1])


def test_a_bad_row_stops_the_ray_engine_naming_shard_and_line(ray_session, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_text(shards / "part-0.tsv", random_rows(20))
    (shards / "part-1.tsv").write_text("a\tfollows\tb\n\tfollows\tc\n")
    config = make(tmp_path, [str(shards)], engine="ray")
    message = error_of(config)
    assert message.startswith("input file ") and "part-1.tsv', line 2: empty lhs name" in message
    assert "\n" not in message and "Traceback" not in message
    assert not any(p.name.startswith(".import") for p in tmp_path.rglob("*"))  # nothing staged
    assert not (tmp_path / "train").exists() or not list((tmp_path / "train").iterdir())


def test_a_read_whose_worker_dies_on_every_try_stops_the_import_in_one_line(ray_session,
                                                                           tmp_path):
    # As a read task that outgrows its memory is killed again on each of Ray's retries:
    # the import stops after TASK_RETRIES of them and the command says so in one line.
    shards = tmp_path / "shards"
    shards.mkdir()
    write_text(shards / "part-0.tsv", random_rows(20))
    config = make(tmp_path, [str(shards)], engine="ray")
    with armed("importer.read_shard", action="kill", repeat=True) as fired:
        with pytest.raises(WorkerCrashedError) as raised:
            import_graph(config)
        assert fired() == TASK_RETRIES + 1
    message = str(user_error(raised.value))
    assert message.startswith("a Ray task's worker died on each of its tries (Ray: The worker "
                              "died unexpectedly while executing this task)")
    assert "ray.num_cpus" in message and "\n" not in message
    assert not any(p.name.startswith(".import") for p in tmp_path.rglob("*"))  # nothing staged
    assert not (tmp_path / "train").exists() or not list((tmp_path / "train").iterdir())


def test_auto_picks_the_ray_engine_for_large_inputs_only(tmp_path):
    source = write_text(tmp_path / "e.tsv", random_rows(10))
    assert choose_engine(make(tmp_path, [source])) == "local"
    assert choose_engine(make(tmp_path, [source], ray_min_bytes=10)) == "ray"
    assert choose_engine(make(tmp_path, [source], engine="ray")) == "ray"


@pytest.mark.s3
@pytest.mark.slow
def test_parquet_shards_on_object_storage_with_the_ray_engine(ray_session, s3_root, tmp_path):
    rows = random_rows(400, 3)
    local_shards = tmp_path / "shards"
    local_shards.mkdir()
    fs, _ = pafs.FileSystem.from_uri(s3_root)
    base, query = s3_root.split("?")
    for i in range(4):
        path = write_parquet(local_shards / f"part-{i}.parquet", rows[i * 100:(i + 1) * 100])
        with fs.open_output_stream(f"{base[5:]}/raw/part-{i}.parquet") as out:
            out.write(Path(path).read_bytes())
    columns = dict(lhs_col="src", rel_col="rel", rhs_col="dst")
    local = make(tmp_path / "local", [str(local_shards)], engine="local", **columns)
    on_ray = make(tmp_path / "ray", [f"{base}/raw?{query}"], engine="ray", **columns)
    on_ray.entity_path = f"{base}/graph/entities?{query}"
    on_ray.edge_paths = [f"{base}/graph/train?{query}"]
    local_stats, ray_stats = import_graph(local), import_graph(on_ray)
    assert ray_stats["inputs"][0]["shards"] == 4 and ray_stats["inputs"][0]["format"] == "parquet"
    assert_same_import(local, on_ray, local_stats, ray_stats)
    listed = fs.get_file_info(pafs.FileSelector(f"{base[5:]}/graph", recursive=True))
    assert not [i.path for i in listed if ".import-" in i.path]  # staging removed


@pytest.mark.multinode
@pytest.mark.slow
def test_two_nodes_import_what_one_process_imports(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    rows = typed_rows(800, 2)
    for i in range(4):
        write_text(shards / f"part-{i}.tsv", rows[i * 200:(i + 1) * 200])
    local = make(tmp_path / "local", [str(shards)], **TYPED, engine="local", weight_col=3)
    # auto: the inputs are far below importer.ray_min_bytes, so only the cluster's second
    # node makes it choose the Ray engine.
    on_ray = make(tmp_path / "ray", [str(shards)], **TYPED, engine="auto", weight_col=3)
    local_stats = import_graph(local)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("multinode_import.py")),
                           json.dumps(on_ray.to_dict())], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["engine"] == "ray"
    assert summary["nodes"] == 2 and len(summary["task_nodes"]) == 2
    assert_same_import(local, on_ray, local_stats, summary["stats"])


def test_a_shard_is_read_into_blocks_of_whole_batches_then_its_figures(ray_session,
                                                                         tmp_path, monkeypatch):
    """A shard longer than a block is read as several blocks of whole batches, its
    figures last; the route of each block gives its edges their buckets."""
    monkeypatch.setattr(raw, "PARQUET_BATCH_ROWS", 50)
    rows = random_rows(500, 0, num_names=200)
    path = write_parquet(tmp_path / "edges.parquet", rows)
    distinct = len({name for lhs, _, rhs in rows for name in (lhs, rhs)})
    config = make(tmp_path / "out", [path], entity_min_count=5)
    shard = ray.remote(ray_engine.DictionaryShard).remote(config, 0, 1)
    *blocks, read = ray_engine._read_shard._function(config, 0, path, [shard], 120, 1, None)
    assert [len(b.lhs) for b in blocks] == [150, 150, 150, 50]
    assert (read.input, read.figures.num_rows, read.blocks, read.unresolved) == (0, 500, 4, 0)
    keyed = ray.get(shard.keyed.remote(0))
    assert len(keyed[0]) == distinct and keyed[1].sum() == 2 * len(rows)
    places, kept = ray_engine._dictionary._function(config, 0, False, [shard], keyed)
    assert len(places) == distinct and 0 < kept < distinct  # the rare ones: dropped
    assert (places == ray_engine.DROPPED).sum() == distinct - kept
    routed = [ray_engine._route_block._function(config, 2, [0], b, places) for b in blocks]
    assert sum(figures["dropped"] for figures, *_ in routed) > 0
    assert sum(len(edges["lhs"]) for _, *writers in routed for edges in writers) == sum(
        len(b.lhs) - figures["dropped"] for b, (figures, *_) in zip(blocks, routed))


def test_a_read_gets_each_batchs_own_ids_while_sending_the_next_over_passes(
        ray_session, tmp_path, monkeypatch):
    """A read sends a batch's names to the dictionary shards before it gathers the ids of
    the batch before: over many batches, and passes of a shard that takes the names of
    one call per pass, every edge ends with the ids of its own names and relation."""
    monkeypatch.setattr(raw, "PARQUET_BATCH_ROWS", 40)
    rows = random_rows(400, 3, num_names=300)
    path = write_parquet(tmp_path / "edges.parquet", rows)
    config = make(tmp_path / "out", [path], dynamic_relations=True,
                  relations=[{"name": "any", "lhs": "node", "rhs": "node"}])
    shard = ray.remote(ray_engine.DictionaryShard).remote(config, 0, 1, names_bytes=1,
                                                          spill_dir=str(tmp_path))
    previous = None
    for passes in range(1, 100):
        *blocks, read = ray_engine._read_shard._function(config, 0, path, [shard], 10 ** 6,
                                                         passes, previous)
        ray.get(shard.pass_done.remote())
        if not read.unresolved:
            break
        previous = [ray.put(block) for block in blocks]
    assert passes > 3 and len(blocks) == 1
    (block,) = blocks
    keys = {t: ray.get(shard.keyed.remote(t))[0] for t in (0, RELATIONS)}
    for side, name_type, column in (("lhs", 0, 0), ("rel", RELATIONS, 1), ("rhs", 0, 2)):
        names = pa.array([row[column] for row in rows])
        keys_of = keys[name_type]
        assert keys_of[getattr(block, side)].tolist() == name_keys(names)[0].tolist()


def test_two_names_sharing_a_key_stop_the_dictionary_shard_naming_both(tmp_path):
    """A dictionary shard compares every sighting's second hash: two names given one key
    (by hand here: a real collision is a chance of one in 10^19) are named in one line."""
    config = make(tmp_path / "out", [])
    shard = ray_engine.DictionaryShard(config, 0, 1)
    names = pa.array(["entity-number-one", "entity-number-two"])
    keys, checks = name_keys(names)
    with pytest.raises(PbgRayError) as caught:
        shard.add(0, ("read", "edges.tsv", 0, 0), np.full(2, keys[0]), checks, names, None)
    message = str(caught.value)
    assert "entity type 'node'" in message and "'entity-number-one'" in message
    assert "'entity-number-two'" in message and "same 64-bit key" in message


def test_a_dictionary_shard_counts_a_read_call_once(tmp_path):
    """A read task run again after its worker died sends its calls again: their names
    keep their ids and are not counted twice."""
    shard = ray_engine.DictionaryShard(make(tmp_path / "out", []), 1, 2)
    names = pa.array(["a", "b", "a"])
    keys, checks = name_keys(names)
    first = shard.add(0, ("read", "part-0", 0, 0), keys, checks, names, None)
    assert first.tolist() == [1, 3, 1]  # index ids 0, 1 of shard 1 of 2
    again = shard.add(0, ("read", "part-0", 0, 0), keys, checks, names, None)
    assert again.tolist() == first.tolist()
    shard.add(0, ("read", "part-1", 0, 0), keys[:1], checks[:1], names[:1], None)
    keyed_keys, counts, _ = shard.keyed(0)
    assert keyed_keys.tolist() == keys[:2].tolist() and counts.tolist() == [3, 1]


def test_a_read_task_killed_after_counting_imports_what_the_local_engine_does(
        ray_session, tmp_path):
    # The first read task dies once its first batch's names are counted; Ray runs it
    # again. With entity_min_count=2 a name counted twice would be kept where the local
    # engine drops it.
    rows = random_rows(300, 2, num_names=150)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        write_text(shards / f"part-{i}.tsv", rows[i * 150:(i + 1) * 150])
    local = make(tmp_path / "local", [str(shards)], engine="local", entity_min_count=2)
    on_ray = make(tmp_path / "ray", [str(shards)], engine="ray", entity_min_count=2)
    local_stats = import_graph(local)
    with armed("importer.batch_named", action="kill") as fired:
        ray_stats = import_graph(on_ray)
        assert fired() == 1
    assert_same_import(local, on_ray, local_stats, ray_stats)


def test_a_dictionary_shard_that_dies_stops_the_import_in_one_line(ray_session, tmp_path):
    source = write_text(tmp_path / "e.tsv", random_rows(20))
    config = make(tmp_path, [source], engine="ray")
    with armed("importer.shard_add", action="kill") as fired:
        with pytest.raises(Exception) as raised:
            import_graph(config)
        assert fired() == 1
    message = str(user_error(raised.value))
    assert message.startswith("a Ray actor's worker died (Ray: The actor died unexpectedly")
    assert "ray.num_cpus" in message and "\n" not in message
    assert not any(p.name.startswith(".import") for p in tmp_path.rglob("*"))  # nothing staged


def test_names_over_two_dictionary_shards_import_as_in_one_process(ray_session, tmp_path,
                                                                  monkeypatch):
    # One shard per CPU: the 2 CPUs of the test's Ray give two, each with about half the
    # names, relation names included.
    monkeypatch.setattr(plan, "CPUS_PER_SHARD", 1)
    source = write_text(tmp_path / "e.tsv", random_rows(400, 5, num_names=120))
    one = [{"name": "any", "lhs": "node", "rhs": "node"}]
    settings = dict(relations=one, dynamic_relations=True, entity_min_count=2)
    local = make(tmp_path / "local", [source], engine="local", **settings)
    on_ray = make(tmp_path / "ray", [source], engine="ray", **settings)
    assert_same_import(local, on_ray, import_graph(local), import_graph(on_ray))


def test_a_previous_dictionary_naming_an_entity_twice_is_refused_by_keys(tmp_path):
    """The Ray engine reads a previous import's names by key: a name listed twice is
    refused as the local engine refuses it, and named."""
    for part, names in enumerate([["a", "an-entity-with-a-long-name"],
                                  ["an-entity-with-a-long-name"]]):
        save_entity_names(tmp_path / "old", "node", part, names)
        save_entity_count(tmp_path / "old", "node", part, len(names))
    config = make(tmp_path, [], previous_entity_path=str(tmp_path / "old"))
    with pytest.raises(PbgRayError, match="entity type 'node' lists a name twice "
                                          "\\('an-entity-with-a-long-name'\\)"):
        ray_engine._dictionary._function(config, 0, True, [])


def test_a_full_dictionary_shard_leaves_new_names_unresolved_then_spills_them(tmp_path):
    """Past its names' plan a shard takes no new names for the pass (id -1, not counted),
    while the names it knows keep their ids and counts; at the pass's end it spills them to
    disk and starts empty, the next pass's names getting the ids after them; its keys,
    counts and names read back whole."""
    shard = ray_engine.DictionaryShard(make(tmp_path / "out", []), 1, 2, names_bytes=1,
                                       spill_dir=str(tmp_path))
    first = pa.array(["a", "entity-with-a-long-name", "a"])
    assert shard.add(0, ("read", 1, "p0", 0, 0), *name_keys(first), first, None).tolist() == [
        1, 3, 1]  # index ids 0 and 1 of shard 1 of 2; now over its plan
    later = pa.array(["b", "a", "b"])
    assert shard.add(0, ("read", 1, "p0", 0, 1), *name_keys(later), later, None).tolist() == [
        -1, 1, -1]
    assert shard.pass_done() == 2 and sorted(p.name for p in tmp_path.iterdir()) == [
        "shard1-type0-pass1.arrow", "shard1-type0-pass1.npz"]
    again = pa.array(["b", "b"])
    assert shard.add(0, ("read", 2, "p0", 0, 0), *name_keys(again), again, None).tolist() == [
        5, 5]  # index id 2
    assert shard.pass_done() == 1  # over its plan again
    keys, counts, _ = shard.keyed(0)
    assert keys.tolist() == name_keys(pa.array(["a", "entity-with-a-long-name", "b"]))[
        0].tolist()
    assert counts.tolist() == [3, 1, 2]
    assert shard.name(0, 1) == "entity-with-a-long-name" and shard.name(0, 2) == "b"


def test_a_shard_whose_hash_table_would_grow_past_its_plan_takes_no_new_names(tmp_path):
    """The C hash table grows by doubling, holding its old slots and its new ones at once:
    a shard whose plan that would pass is full before it grows, not after."""
    names = pa.array([f"name-{i}" for i in range(800)])
    shard = ray_engine.DictionaryShard(make(tmp_path / "out", []), 0, 1, names_bytes=40_000,
                                       spill_dir=str(tmp_path))
    index = shard.indexes[0]
    first = names[:700]  # 1,024 slots hold 716 names: no growth yet
    assert shard.add(0, ("read", 1, "p0", 0, 0), *name_keys(first), first,
                     None).tolist() == list(range(700))
    assert index.nbytes() < 40_000 < index.nbytes() + index.growth(100)
    later = names[690:]
    assert shard.add(0, ("read", 1, "p0", 0, 1), *name_keys(later), later,
                     None).tolist() == list(range(690, 700)) + [-1] * 100
    assert index.growth(100) and len(index) == 700


def test_names_over_their_plan_import_over_passes_as_in_one_process(ray_session, tmp_path,
                                                                   monkeypatch, caplog):
    """Dictionary shards whose plan holds a fraction of the names: the reads run again,
    pass after pass, over the shards with names left unresolved, and the import is the
    local engine's (first-input counts, a later input's unseen names, dynamic relations)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    rows = random_rows(1200, 7, num_names=600)
    for i in range(3):
        write_text(shards / f"part-{i}.tsv", rows[i * 400:(i + 1) * 400])
    test = write_text(tmp_path / "test.tsv", random_rows(50, 8, num_names=700))
    one = [{"name": "any", "lhs": "node", "rhs": "node"}]
    settings = dict(relations=one, dynamic_relations=True, entity_min_count=2)
    local = make(tmp_path / "local", [str(shards), test], engine="local", **settings)
    on_ray = make(tmp_path / "ray", [str(shards), test], engine="ray", **settings)
    local_stats = import_graph(local)
    small = plan.ImportPlan("ray", 2, 2, 20_000, None, 0, None)  # two shards, few names
    monkeypatch.setattr(ray_engine, "import_plan", lambda *args: small)
    with caplog.at_level(logging.INFO, logger="pbg_ray"):
        ray_stats = import_graph(on_ray)
    passes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("import: pass")]
    assert len(passes) > 1 and passes[0].startswith("import: pass 1 left the names of "), passes
    assert_same_import(local, on_ray, local_stats, ray_stats)
