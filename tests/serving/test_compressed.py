"""IVF-PQ serving (serve.index=ivfpq): a partition is held as its codes only, its vectors
read from the checkpoint's embeddings file for the index's hits, which are rescored with
the model's own scores; exact search streams the file; serve.index=auto takes it where the
vectors and their indexes do not fit the memory budget."""

import dataclasses
import logging

import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.questions import exact_top_k
from pbg_ray.runtime.budget import MemoryBudget
from pbg_ray.serving.index import PQ_MIN_ROWS, candidate_vectors, index_bytes, index_kind
from pbg_ray.serving.launch import index_for_budget, serving_plan
from pbg_ray.serving.shards import STREAM_ROWS, ShardTables, StoredRows
from tests.serving.util import build_all
from tests.util import config_dict, random_checkpoint, write_random_graph

DIM = 32
ROWS = STREAM_ROWS + 3000  # the exact search streams two blocks


def clustered_checkpoint(root, parts: int, rows: int, **serve) -> ConfigSchema:
    """One type of `parts` partitions of `rows` clustered rows each (what trained
    embeddings look like), served with IVF-PQ, its indexes built."""
    config = ConfigSchema.from_dict(config_dict(
        root, entities={"node": {"num_partitions": parts}}, dimension=DIM, comparator="dot",
        global_emb=False,
        relations=[{"name": "to", "lhs": "node", "rhs": "node", "operator": "none"}],
        serve={"index": "ivfpq", **serve}))
    write_random_graph(config, num_edges=50, counts={"node": rows})
    random_checkpoint(config)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(64, DIM)).astype(np.float32)
    for part in range(parts):
        table = centers[rng.integers(64, size=rows)] + 0.3 * rng.normal(size=(rows, DIM))
        CheckpointStorage(config.checkpoint_path).save_entity_partition(
            1, "node", part, table.astype(np.float32), None)
    build_all(config)
    return config


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> ConfigSchema:
    """One partition of ROWS rows, every list probed: what the codes miss is the
    rescoring's to fix."""
    return clustered_checkpoint(tmp_path_factory.mktemp("ivfpq"), 1, ROWS, ivf_lists=32,
                                ivf_probes=32)


def test_a_partition_under_ivfpq_is_held_as_its_codes_and_answers_with_exact_scores(compressed):
    shards = ShardTables(compressed, 1, 0)
    assert not shards.tables and ("node", 0) in shards.stored
    assert shards.sets["node", 0, None].vectors is None
    stored = CheckpointStorage(compressed.checkpoint_path).load_entity_partition(1, "node", 0)[0]
    queries = np.random.default_rng(1).normal(size=(40, DIM)).astype(np.float32)
    scores, offsets = shards.search(("node", 0, None), queries, 10)
    exact = queries @ stored.T
    np.testing.assert_allclose(scores, np.take_along_axis(exact, offsets, 1), rtol=1e-5)
    truth = np.argsort(-exact, axis=1)[:, :10]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(offsets, truth)])
    assert recall >= 0.9, recall
    np.testing.assert_array_equal(shards.rows("node", 0, [5, 2, 5]), stored[[5, 2, 5]])


def test_partitions_under_ivfpq_read_and_rescore_the_best_proposals_of_them_all(tmp_path):
    """A shard group's IVF-PQ partitions are searched together: each index proposes k x
    pq_rerank hits, and only the best k x pq_rerank of all of them per query are read from
    the files (a disk read each, out of core) and rescored exactly, not that many per
    partition; the answer keeps the recall of exact search's."""
    config = clustered_checkpoint(tmp_path, 3, PQ_MIN_ROWS, ivf_lists=16, ivf_probes=16)
    shards = ShardTables(config, 1, 0)
    read = []
    for stored in shards.stored.values():
        stored.take = lambda offsets, take=stored.take: read.append(len(offsets)) or take(offsets)
    queries = np.random.default_rng(1).normal(size=(20, DIM)).astype(np.float32)
    found = shards.search_group("node", [0, 1, 2], None, queries, 10)
    assert sum(read) <= len(queries) * 10 * config.serve.pq_rerank + 3  # (+ row 0 of each)
    tables = [CheckpointStorage(config.checkpoint_path).load_entity_partition(1, "node", p)[0]
              for p in range(3)]
    exact = np.concatenate([queries @ table.T for table in tables], axis=1)
    scores = np.concatenate([s for s, _ in found], axis=1)
    offsets = np.concatenate([o + p * PQ_MIN_ROWS for p, (_, o) in enumerate(found)], axis=1)
    np.testing.assert_allclose(scores[offsets >= 0],
                               np.take_along_axis(exact, offsets.clip(0), 1)[offsets >= 0],
                               rtol=1e-5)
    best = np.argsort(-np.where(offsets >= 0, scores, -np.inf), axis=1)[:, :10]
    answer = np.take_along_axis(offsets, best, 1)
    truth = np.argsort(-exact, axis=1)[:, :10]
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(answer, truth)]) >= 0.9
    read.clear()
    for part in range(3):  # one partition at a time reads that many per partition
        shards.search(("node", part, None), queries, 10)
    assert sum(read) > 2 * len(queries) * 10 * config.serve.pq_rerank


def test_exact_search_of_an_ivfpq_partition_streams_the_file_to_the_exact_answer(compressed):
    shards = ShardTables(compressed, 1, 0)
    stored = CheckpointStorage(compressed.checkpoint_path).load_entity_partition(1, "node", 0)[0]
    queries = np.random.default_rng(2).normal(size=(5, DIM)).astype(np.float32)
    banned = [np.array([int(np.argmax(queries[0] @ stored.T))])] + [np.empty(0, np.int64)] * 4
    q = torch.from_numpy(queries)
    vectors = candidate_vectors(shards.scorer, "node", torch.from_numpy(stored), None)
    expected = exact_top_k(shards.scorer, q, vectors, 10, banned)
    found = shards._streamed_top_k(("node", 0, None), q, 10, banned)
    np.testing.assert_array_equal(found[1], expected[1])
    np.testing.assert_allclose(found[0], expected[0], rtol=1e-6)
    assert banned[0][0] not in found[1][0]


def test_stored_rows_read_through_h5py_as_through_the_memory_map(compressed):
    path = CheckpointStorage(compressed.checkpoint_path).partition_file(1, "node", 0)
    mapped, read = StoredRows(path), StoredRows(path)
    assert mapped.mapped is not None
    read.mapped = read.offset = None  # as for a checkpoint in object storage
    offsets = np.array([7, 3, ROWS - 1, 3])
    np.testing.assert_array_equal(read.take(offsets), mapped.take(offsets))
    np.testing.assert_array_equal(read.block(10, 20), mapped.block(10, 20))


def test_small_sets_stay_exact_and_a_code_size_must_divide_the_dimension(compressed):
    assert index_kind(compressed, PQ_MIN_ROWS - 1) == "exact"
    assert index_kind(compressed, PQ_MIN_ROWS) == "ivfpq"
    assert index_bytes(compressed, "ivfpq", 1000, DIM) == 1000 * (16 + 8)  # small: 16 bytes
    odd = dataclasses.replace(compressed, serve=dataclasses.replace(compressed.serve, pq_bytes=7))
    with pytest.raises(PbgRayError, match=r"serve.pq_bytes=7 does not divide the dimension 32"):
        index_bytes(odd, "ivfpq", 1000, DIM)


def test_auto_takes_ivfpq_where_the_vectors_do_not_fit_the_budget(compressed, caplog):
    auto = dataclasses.replace(compressed, serve=dataclasses.replace(
        compressed.serve, index="auto", index_min_rows=1000))
    needs = serving_plan(auto, {"node": [ROWS]}).total
    assert index_for_budget(auto, MemoryBudget(needs, "ray.memory_budget")) is auto
    assert index_for_budget(auto, None) is auto  # a cluster: each node is its own
    with caplog.at_level(logging.WARNING, logger="pbg_ray"):
        chosen = index_for_budget(auto, MemoryBudget(needs - 1, "ray.memory_budget"))
    assert chosen.serve.index == "ivfpq" and "serving with serve.index=ivfpq" in caplog.text
    assert serving_plan(chosen, {"node": [ROWS]}).total < needs
