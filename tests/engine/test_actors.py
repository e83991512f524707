"""The partition store actor on a real local Ray: what it keeps, writes and hands out."""

import numpy as np
import ray

from pbg_ray.config import ConfigSchema
from pbg_ray.engine.actors import PartitionStore
from pbg_ray.io.checkpoint import CheckpointStorage, row_adagrad_sums

from conftest import config_dict

KEYS = [("user", 0), ("user", 1), ("tag", 0)]  # user is partitioned, tag is not


def stored(store, key):
    """(embeddings, sums) the store hands out for `key` now."""
    return ray.get(ray.get(store.get.remote(key))[0])


def test_disk_store_swaps_out_only_what_no_bucket_in_flight_uses(ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, ray={"placement": "disk"}))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    store = PartitionStore.remote(config, 1)
    ray.get([store.add.remote(key, ("random", 10, 0)) for key in KEYS])
    trained = {}
    for key in KEYS:
        embs, sums = stored(store, key)
        trained[key] = (embs + 1, sums + 1)
        ray.get(store.update.remote(key, [ray.put(trained[key])], False))

    # user 0 is used by the next bucket: only user 1 is written, as version 1's file.
    ray.get(store.swap_out.remote([("user", 0)]))
    assert [k for k in KEYS if storage.partition_file(1, *k).exists()] == [("user", 1)]
    # Read ahead for the next bucket; the caller gets no ref that would keep it alive.
    assert ray.get(store.read_ahead.remote(("user", 1))) is None
    for key in KEYS:  # user 1 came back from its file, the others never left
        np.testing.assert_array_equal(stored(store, key)[0], trained[key][0])
    # Swapped in but not trained again: dropped without another write.
    before = storage.partition_file(1, "user", 1).stat().st_mtime_ns
    ray.get(store.swap_out.remote([]))
    assert storage.partition_file(1, "user", 1).stat().st_mtime_ns == before

    # Deltas (concurrent buckets on tag) add up, and the sum is what the next bucket gets.
    ones = (np.ones_like(trained["tag", 0][0]), np.ones_like(trained["tag", 0][1]))
    ray.get([store.update.remote(("tag", 0), [ray.put(ones)], True) for _ in range(2)])
    expected = {**trained, ("tag", 0): (trained["tag", 0][0] + 2, trained["tag", 0][1] + 2)}
    np.testing.assert_array_equal(stored(store, ("tag", 0))[1], expected["tag", 0][1])

    ray.get(store.save.remote(1, {}))
    for key in KEYS:
        embs, state = storage.load_entity_partition(1, *key)
        np.testing.assert_array_equal(embs, expected[key][0])
        np.testing.assert_array_equal(row_adagrad_sums(state, len(embs), key), expected[key][1])
