"""The partition store actor on a real local Ray: what it keeps, writes and hands out, and
the drawn rows' gradients a pass left it to apply."""

import os

import numpy as np
import pytest
import ray

from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_sums
from pbg_ray.checkpoints.position import Position
from pbg_ray.config import ConfigSchema
from pbg_ray.model.beyond import RowGradients
from pbg_ray.training.partition_store import PartitionStore
from pbg_ray.training.bucket_sources import RandomSource, SwapFile, written_marker
from tests.util import config_dict

KEYS = [("user", 0), ("user", 1), ("tag", 0)]  # user is partitioned, tag is not


def stored(store, key):
    """(embeddings, sums) the store hands out for `key` now."""
    return ray.get(ray.get(store.get.remote(key))[0])


def test_disk_store_leases_swap_files_and_adopts_only_those_of_finished_tasks(ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, ray={"placement": "disk"}))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    store = PartitionStore.remote(config, 1)
    ray.get([store.add.remote(key, RandomSource(10, 0)) for key in KEYS])
    initial = {key: stored(store, key) for key in KEYS}
    trained = {key: (embs + 1, sums + 1) for key, (embs, sums) in initial.items()}

    # The partitioned type's partitions are leased as swap files, read from their source.
    swap = ray.get(store.lease.remote(("user", 0)))
    assert isinstance(swap, SwapFile) and swap.source == RandomSource(10, 0)
    np.testing.assert_array_equal(swap.load(config, ("user", 0))[0], initial["user", 0][0])
    assert isinstance(ray.get(store.lease.remote(("tag", 0))), list)  # an object-store ref
    # A task that died after writing its swap file: its file is never taken.
    dead = ray.get(store.lease.remote(("user", 1)))
    dead.write(config, *trained["user", 1], {})
    # A task that finished: its swap file holds the newest values from now on, and the
    # next task writes another one.
    swap.write(config, *trained["user", 0], {})
    ray.get(store.update.remote(("user", 0), [ray.put(swap)], False))
    again = ray.get(store.lease.remote(("user", 0)))
    assert again.source == swap.written and again.staged not in (swap.staged, dead.staged)
    np.testing.assert_array_equal(stored(store, ("user", 0))[0], trained["user", 0][0])
    again.write(config, *(a + 1 for a in trained["user", 0]), {})
    ray.get(store.update.remote(("user", 0), [ray.put(again)], False))
    # The dead task's bucket again: from the partition's source, into the swap file that
    # no longer holds anything needed.
    retry = ray.get(store.lease.remote(("user", 1)))
    assert retry.source == RandomSource(10, 0) and retry.staged == swap.staged
    retry.write(config, *trained["user", 1], {})
    ray.get(store.update.remote(("user", 1), [ray.put(retry)], False))
    expected = {**initial, ("user", 0): tuple(a + 1 for a in trained["user", 0]),
                ("user", 1): trained["user", 1]}
    assert not any(storage.partition_file(1, *key).exists() for key in KEYS)  # until save

    # Deltas (concurrent buckets on tag) add up, and the sum is what the next bucket gets.
    ones = (np.ones_like(initial["tag", 0][0]), np.ones_like(initial["tag", 0][1]))
    ray.get([store.update.remote(("tag", 0), [ray.put(ones)], True) for _ in range(2)])
    expected["tag", 0] = tuple(a + 1 + 1 for a in initial["tag", 0])
    np.testing.assert_array_equal(stored(store, ("tag", 0))[1], expected["tag", 0][1])

    ray.get(store.save.remote(1, {}))
    for key in KEYS:
        embs, state = storage.load_entity_partition(1, *key)
        np.testing.assert_array_equal(embs, expected[key][0])
        np.testing.assert_array_equal(row_adagrad_sums(state, len(embs), key), expected[key][1])
    # The newest swap files became version 1's (their markers gone); the dead task's is
    # written over next.
    assert sorted(str(p) for p in storage.path.glob(".*tmp*")) == sorted(
        [dead.staged, str(written_marker(dead.staged))])
    assert ray.get(store.lease.remote(("user", 0))).staged == dead.staged

    # Once version 2 is current, version 1's files of swapped partitions are spare swap
    # files, except one an epoch snapshot links to (written over, it would change too).
    ray.get(store.save.remote(2, {}))
    os.link(storage.partition_file(1, "user", 1), tmp_path / "snapshot.h5")
    recycled = os.stat(storage.partition_file(1, "user", 0)).st_ino
    ray.get(store.recycle.remote(1))
    assert not storage.partition_file(1, "user", 0).exists()
    assert storage.partition_file(1, "user", 1).exists() and storage.partition_file(1, "tag", 0).exists()
    leased = [ray.get(store.lease.remote(("user", 0))).staged for _ in range(2)]
    assert recycled in [os.stat(path).st_ino for path in leased]


@pytest.mark.parametrize("placement", ["memory", "disk"])
def test_row_gradients_left_at_a_pass_s_end_are_the_partition_s_newest_values(
        ray_session, tmp_path, placement):
    """Gradients of drawn rows that no task of the pass applied, applied by the store in
    order: what it hands out next, and what it saves."""
    config = ConfigSchema.from_dict(config_dict(tmp_path, ray={"placement": placement}))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    store = PartitionStore.remote(config, 1)
    ray.get([store.add.remote(key, RandomSource(10, 0)) for key in KEYS])
    key = ("user", 1)
    embs, sums = (np.array(a) for a in stored(store, key))
    rng = np.random.default_rng(0)
    gradients = [RowGradients(offsets, rng.normal(0, 1, (len(offsets), embs.shape[1])
                                                  ).astype(np.float32),
                              rng.uniform(0.1, 1, len(offsets)).astype(np.float32))
                 for offsets in (np.array([0, 3, 7]), np.array([3, 4]))]
    for drawn in gradients:
        drawn.apply(embs, sums, config.lr)
    ray.get(store.apply_row_gradients.remote(key, gradients, Position.of(0, 1, 1, 1), None))
    got = stored(store, key)
    np.testing.assert_array_equal(got[0], embs)
    np.testing.assert_array_equal(got[1], sums)
    ray.get(store.save.remote(1, {}))
    saved, state = storage.load_entity_partition(1, *key)
    np.testing.assert_array_equal(saved, embs)
    np.testing.assert_allclose(row_adagrad_sums(state, len(saved), key), sums, rtol=1e-6)
