"""Incremental training: an import against a previous entity dictionary, and a grown graph
trained from the previous checkpoint (pbg_ray.incremental)."""

import collections
import dataclasses

import numpy as np
import pytest

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.demo import grown_graph
from pbg_ray.importer.dictionaries import fill_smallest
from pbg_ray.importer.graph_import import import_graph
from pbg_ray.incremental.growth import grow_partition, init_rows, neighbor_means, read_npy
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import load_entity_counts, load_entity_names, load_relation_names
from pbg_ray.model.params import init_params, params_from_checkpoint, params_to_checkpoint
from pbg_ray.training.trainer import Trainer
from pbg_ray.types import Bucket
from tests.importer.util import decoded, random_rows, write_text
from tests.util import (
    assert_streams_partitions, assert_valid_checkpoint, config_dict, peak_growth,
    write_random_graph)

NPARTS = 2


def grown_config(root, inputs, previous=None, outputs=("train",), importer=(), **overrides):
    """One node type in NPARTS partitions and one relation, imported from `inputs`
    into root/entities and root/<output> per input."""
    data = config_dict(
        root, entities={"node": {"num_partitions": NPARTS}},
        relations=[{"name": "link", "lhs": "node", "rhs": "node", "operator": "translation"}],
        edge_paths=[str(root / outputs[0])], eval_edge_paths=[str(root / o) for o in outputs[1:]],
        global_emb=False, dimension=16, comparator="dot", loss_fn="softmax", lr=0.1,
        batch_size=100, num_batch_negs=50, num_uniform_negs=50, eval_fraction=0.0,
        eval_num_batch_negs=50, eval_num_uniform_negs=50)
    data["importer"] = dict(inputs=[str(p) for p in inputs], previous_entity_path=previous,
                            **dict(importer))
    data.update(overrides)
    return ConfigSchema.from_dict(data)


def names_of(config, entity="node"):
    return [load_entity_names(config.entity_path, entity, p)
            for p in range(config.entities[entity].num_partitions)]


# --- the importer -----------------------------------------------------------------


def test_fill_smallest_raises_the_smallest_partitions_first():
    assert fill_smallest(np.array([5, 2, 9]), 4).tolist() == [1, 3, 0]  # 6, 5, 9 -> ... 6, 6, 9
    assert fill_smallest(np.array([5, 2, 9]), 0).tolist() == [0, 0, 0]
    assert fill_smallest(np.array([3, 3]), 5).tolist() == [3, 2]
    assert fill_smallest(np.array([10, 0, 4, 7]), 13).tolist() == [0, 8, 4, 1]  # 10, 8, 8, 8


@pytest.mark.oracle
def test_import_against_a_previous_dictionary_keeps_known_ids(tmp_path):
    from torchbiggraph.graph_storages import FileEntityStorage

    day0 = random_rows(300, seed=0, num_names=40)
    first = grown_config(tmp_path / "day0", [write_text(tmp_path / "day0.tsv", [
        (l, "link", r) for l, _, r in day0])])
    import_graph(first)
    before = {p: p.read_bytes() for p in (tmp_path / "day0").rglob("*") if p.is_file()}
    known = names_of(first)

    # Day 1: edges among known names and 15 new ones, more of them in partition 1's range.
    rng = np.random.default_rng(1)
    old_names = [n for part in known for n in part]
    new_names = [f"new-{i}" for i in range(15)]
    day1 = [(old_names[rng.integers(len(old_names))], "link", new_names[i % 15]) for i in range(60)]
    day1 += [(old_names[rng.integers(len(old_names))], "link", old_names[rng.integers(len(old_names))])
             for _ in range(20)]
    second = grown_config(tmp_path / "day1", [write_text(tmp_path / "day1.tsv", day1)],
                          previous=first.entity_path,
                          importer={"previous_edge_paths": first.edge_paths})
    stats = import_graph(second)

    grown = names_of(second)
    for part, names in enumerate(known):
        assert grown[part][:len(names)] == names  # known (partition, offset) never change
    assert sorted(n for part in grown for n in part) == sorted(old_names + new_names)
    counts = np.array([len(p) for p in known])
    assert [len(p) for p in grown] == (counts + fill_smallest(counts, 15)).tolist()
    assert stats["new_entities"] == {"node": 15} and stats["inputs"][0]["previous_edges"] == 300
    # The output buckets hold the previous edges first, then the new ones, by name.
    assert decoded(second, second.edge_paths[0]) == collections.Counter(
        [(l, "link", r) for l, _, r in day0] + day1)
    for lhs_p in range(NPARTS):
        for rhs_p in range(NPARTS):
            old = read_edges(first.edge_paths[0], Bucket(lhs_p, rhs_p))
            new = read_edges(second.edge_paths[0], Bucket(lhs_p, rhs_p))
            np.testing.assert_array_equal(new.lhs[:len(old)], old.lhs)
            np.testing.assert_array_equal(new.rhs[:len(old)], old.rhs)
    # The previous import is untouched, and torchbiggraph reads the grown one.
    assert {p: p.read_bytes() for p in (tmp_path / "day0").rglob("*") if p.is_file()} == before
    assert FileEntityStorage(second.entity_path).load_names("node", 1) == grown[1]


def test_dynamic_relations_keep_their_ids_and_new_ones_are_appended(tmp_path):
    relations = [{"name": "any", "lhs": "node", "rhs": "node", "operator": "translation"}]
    rows0 = [("a", "r1", "b"), ("b", "r2", "c")]
    first = grown_config(tmp_path / "day0", [write_text(tmp_path / "d0.tsv", rows0)],
                         relations=relations, dynamic_relations=True)
    import_graph(first)
    rows1 = [("c", "r3", "d"), ("a", "r2", "d"), ("d", "r0", "a")]
    second = grown_config(tmp_path / "day1", [write_text(tmp_path / "d1.tsv", rows1)],
                          previous=first.entity_path, relations=relations, dynamic_relations=True)
    import_graph(second)
    before = load_relation_names(first.entity_path)
    after = load_relation_names(second.entity_path)
    assert after[:2] == before and sorted(after[2:]) == ["r0", "r3"]
    assert decoded(second, second.edge_paths[0]) == collections.Counter(rows1)


def error_of(config):
    with pytest.raises(PbgRayError) as err:
        import_graph(config)
    return str(err.value)


def test_bad_previous_imports_are_refused_and_nothing_is_written(tmp_path):
    source = write_text(tmp_path / "e.tsv", [("a", "link", "b"), ("b", "link", "c")])
    first = grown_config(tmp_path / "day0", [source])
    import_graph(first)
    same = grown_config(tmp_path / "day0", [source], previous=first.entity_path,
                        importer={"overwrite": True})
    assert "never modified in place" in error_of(same)
    more_parts = grown_config(tmp_path / "day1", [source], previous=first.entity_path,
                              entities={"node": {"num_partitions": 3}})
    assert "has 2 partition(s) of entity type 'node', the config 3" in error_of(more_parts)
    reordered = grown_config(tmp_path / "day1", [source], previous=first.entity_path, relations=[
        {"name": "other", "lhs": "node", "rhs": "node"}, {"name": "link", "lhs": "node", "rhs": "node"}])
    assert "don't start with those of the previous import" in error_of(reordered)
    overlapping = grown_config(tmp_path / "day1", [source], previous=first.entity_path,
                               importer={"previous_edge_paths": [str(tmp_path / "day1" / "train")]})
    assert "an output edge path" in error_of(overlapping)
    assert not (tmp_path / "day1").exists() or not list((tmp_path / "day1").rglob("*.*"))


# --- relation parameters of a grown graph -------------------------------------------


def test_new_dynamic_relation_ids_get_fresh_parameters(tmp_path):
    data = config_dict(tmp_path, relations=[
        {"name": "any", "lhs": "user", "rhs": "item", "operator": "diagonal"}],
        entities={"user": {}, "item": {}}, dynamic_relations=True, global_emb=False)
    config = ConfigSchema.from_dict(data)
    rng = np.random.default_rng(0)
    old = init_params(config, 2)
    for name in old.arrays:
        old.arrays[name] += rng.normal(size=old.arrays[name].shape).astype(np.float32)
        old.sums[name] = rng.uniform(size=old.sums[name].shape).astype(np.float32)
    arrays, optim_state = params_to_checkpoint(config, old)
    with pytest.raises(PbgRayError, match="has shape"):
        params_from_checkpoint(config, 3, arrays, optim_state)
    grown = params_from_checkpoint(config, 3, arrays, optim_state, grow=True)
    fresh = init_params(config, 3)
    for name in old.arrays:
        np.testing.assert_array_equal(grown.arrays[name][:2], old.arrays[name])
        np.testing.assert_array_equal(grown.sums[name][:2], old.sums[name])
        np.testing.assert_array_equal(grown.arrays[name][2], fresh.arrays[name][2])
        assert not grown.sums[name][2].any()


def test_grown_partitions_keep_known_rows_and_refuse_a_shrunk_graph(tmp_path):
    config = grown_config(tmp_path, [])
    rng = np.random.default_rng(0)
    embs, sums = rng.normal(size=(5, 16)).astype(np.float32), rng.uniform(size=5).astype(np.float32)
    given = np.full((3, 16), np.nan, np.float32)
    given[1] = 7.0  # a new row with known neighbours; the others have none
    np.save(tmp_path / "new_rows.npy", given)
    grown, grown_sums = grow_partition(config, ("node", 0), embs, sums, 8,
                                       str(tmp_path / "new_rows.npy"), "init file")
    assert grown[:5].tobytes() == embs.tobytes() and grown_sums[:5].tobytes() == sums.tobytes()
    assert (grown[6] == 7).all() and not grown_sums[5:].any()
    assert 0 < np.abs(grown[[5, 7]]).max() < 10 * config.init_scale
    with pytest.raises(PbgRayError, match="holds 5 entities .* entity_path counts only 3"):
        grow_partition(config, ("node", 0), embs, sums, 3, None, "init file")
    with pytest.raises(PbgRayError, match="incremental.known_lr_scale: needs init_path"):
        grown_config(tmp_path, [], incremental={"known_lr_scale": 0.5})


# --- a grown graph trained from its previous checkpoint -------------------------------


@pytest.fixture(scope="module")
def day0(tmp_path_factory, ray_session):
    """A planted-community graph, its 10% growth, and a checkpoint of the old graph."""
    root = tmp_path_factory.mktemp("incremental")
    splits = grown_graph(1000, 20000, growth=0.1, num_communities=40, seed=3)
    files = {name: write_text(root / f"{name}.tsv", rows) for name, rows in splits.items()}
    old = grown_config(root / "day0", [files["old_train"], files["old_test"]],
                       outputs=("train", "test"), num_epochs=3)
    import_graph(old)
    Trainer(old).run()
    new = grown_config(root / "day1", [files["new_train"], files["new_test"], files["old_test"]],
                       previous=old.entity_path, outputs=("train", "new_test", "old_test"))
    import_graph(new)
    return root, old, new


def update_config(root, old, new, name, **incremental):
    return ConfigSchema.from_dict({**new.to_dict(), "checkpoint_path": str(root / name),
                                   "init_path": old.checkpoint_path, "num_epochs": 4,
                                   "incremental": incremental})


def mrr_chance(config):
    """E[1 / rank] of a positive ranked uniformly among its sampled negatives."""
    n = config.eval_num_batch_negs + config.eval_num_uniform_negs + 1
    return sum(1 / k for k in range(1, n + 1)) / n


@pytest.mark.oracle
def test_frozen_update_keeps_known_rows_and_learns_the_new_entities(day0):
    from tests.oracle import assert_torchbiggraph_loads

    root, old, new = day0
    # Known entities' ids never change: the old held-out edges import to the same buckets.
    for lhs_p in range(NPARTS):
        for rhs_p in range(NPARTS):
            a = read_edges(old.eval_edge_paths[0], Bucket(lhs_p, rhs_p))
            b = read_edges(new.eval_edge_paths[1], Bucket(lhs_p, rhs_p))
            assert np.array_equal(a.lhs, b.lhs) and np.array_equal(a.rhs, b.rhs)

    config = update_config(root, old, new, "frozen", known_lr_scale=0.0, new_entity_edges_only=True)
    trainer = Trainer(config)
    result = trainer.run()
    assert_valid_checkpoint(config, result.version)  # v1
    assert_torchbiggraph_loads(config, result.version)
    before = CheckpointManager(old.checkpoint_path)
    after = CheckpointManager(config.checkpoint_path)
    known = init_rows(config, before, before.version())
    for part in range(NPARTS):
        old_embs, old_state = before.read_partition(before.version(), "node", part)
        embs, state = after.read_partition(result.version, "node", part)
        n = known["node", part]
        assert n == len(old_embs) < len(embs)
        assert embs[:n].tobytes() == old_embs.tobytes()  # bit-identical
        assert state["state"][0]["sum"][:n].tobytes() == old_state["state"][0]["sum"].tobytes()
        assert (state["state"][0]["sum"][n:] > 0).mean() > 0.9  # the new rows trained
    old_model, _ = before.read_model(before.version())
    new_model, _ = after.read_model(result.version)
    assert all(np.array_equal(old_model[k], new_model[k]) for k in old_model)

    # The new entities' held-out edges score far above chance; the old ones still do.
    chance = mrr_chance(config)
    new_mrr = trainer.evaluate(config.eval_edge_paths[0])["mrr"]
    old_mrr = trainer.evaluate(config.eval_edge_paths[1])["mrr"]
    assert new_mrr > 5 * chance and old_mrr > 5 * chance, (new_mrr, old_mrr, chance)


def test_neighbor_init_starts_new_rows_at_their_neighbours_mean(day0):
    root, old, new = day0
    config = update_config(root, old, new, "unused", new_rows_init="neighbors")
    checkpoint = CheckpointManager(old.checkpoint_path)
    version = checkpoint.version()
    counts = {"node": [len(p) for p in names_of(new)]}
    files = neighbor_means(config, checkpoint, version, counts)
    means = {key: read_npy(path) for key, path in files.items()}
    known = init_rows(config, checkpoint, version)
    tables = {p: checkpoint.read_partition(version, "node", p)[0] for p in range(NPARTS)}
    # Brute force over the new edges: each new node's known neighbours.
    neighbours = collections.defaultdict(list)
    for lhs_p in range(NPARTS):
        for rhs_p in range(NPARTS):
            edges = read_edges(config.edge_paths[0], Bucket(lhs_p, rhs_p))
            for l, r in zip(edges.lhs.tolist(), edges.rhs.tolist()):
                for (p, i), (q, j) in (((lhs_p, l), (rhs_p, r)), ((rhs_p, r), (lhs_p, l))):
                    if i >= known["node", p] and j < known["node", q]:
                        neighbours[p, i].append(tables[q][j])
    assert set(means) == {("node", p) for p in range(NPARTS)}
    for p in range(NPARTS):
        rows = means["node", p]
        assert rows.shape == (counts["node"][p] - known["node", p], config.dimension)
        for i in range(len(rows)):
            found = neighbours.get((p, known["node", p] + i))
            if found:
                np.testing.assert_allclose(rows[i], np.mean(found, axis=0), rtol=1e-5, atol=1e-6)
            else:
                assert np.isnan(rows[i]).all()
    assert sum(len(v) > 0 for v in neighbours.values()) > 0.9 * sum(len(r) for r in means.values())

    # The trainer's sources carry the means as files, which the partitions' loader reads.
    sources, _ = Trainer(config)._sources()
    for p in range(NPARTS):
        embs, _ = sources["node", p].load(config, ("node", p))
        rows, new = means["node", p], embs[known["node", p]:]
        given = np.isfinite(rows).all(axis=1)
        assert given.any() and np.array_equal(new[given], rows[given])


def neighbor_means_in_process(init_path, grown_path):
    """Run by peak_memory: neighbour means of the graph of grown_path's config (a
    checkpoint directory's config.json) from init_path's checkpoint."""
    config = CheckpointManager(grown_path).read_config()
    assert neighbor_means(config, CheckpointManager(init_path), 1, load_entity_counts(config))


@pytest.mark.slow
def test_neighbor_means_memory_follows_the_partition_not_the_table(tmp_path):
    def grown(config, name):
        """The same graph with half as many entities again in each partition."""
        root = tmp_path / "grown" / name
        grown = dataclasses.replace(config, entity_path=str(root / "entities"),
                                    edge_paths=[str(root / "edges")],
                                    checkpoint_path=str(root / "checkpoints"))
        rows = CheckpointManager(config.checkpoint_path).read_partition(1, "node", 0)[0].shape[0]
        write_random_graph(grown, num_edges=500, counts={"node": rows * 3 // 2})
        CheckpointManager(grown.checkpoint_path).write_config(grown)
        return [config.checkpoint_path, grown.checkpoint_path]

    assert_streams_partitions(*peak_growth(
        tmp_path, "tests.incremental.test_incremental:neighbor_means_in_process", grown))
