"""The kernel's seed and Hogwild threads: a bucket's training follows its seed alone, and
PBG's warm-up (hogwild_delay) trains alone, exactly as one thread does."""

import threading
from typing import Dict

import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.model.kernel import BatchQueue, train_bucket
from pbg_ray.model.params import init_params, init_partition
from pbg_ray.types import Bucket, EdgeList
from tests.util import config_dict

NUM_NODES = 40


def train(tmp_path, seed: int, threads: int = 1, warmup_s: float = 0.0) -> Dict[str, bytes]:
    """The bytes of every table, sum and parameter after one bucket of two relations
    (operators and global embeddings: shared parameters) trained from the same start."""
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, entities={"node": {"num_partitions": 1}},
        relations=[{"name": "r0", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"},
                   {"name": "r1", "lhs": "node", "rhs": "node", "operator": "translation"}],
        comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True))
    rng = np.random.default_rng(0)
    parts = {("node", 0): init_partition(config, "node", NUM_NODES, rng)}
    params = init_params(config, 2)
    edges = EdgeList(rng.integers(NUM_NODES, size=400), rng.integers(NUM_NODES, size=400),
                     rng.integers(2, size=400))
    train_bucket(config, Bucket(0, 0), edges, parts, params, num_threads=threads, seed=seed,
                 warmup_s=warmup_s)
    arrays = {"embs": parts["node", 0][0], "sums": parts["node", 0][1], **params.arrays,
              **{f"{k} sums": v for k, v in params.sums.items()}}
    return {k: v.tobytes() for k, v in arrays.items()}


def test_a_bucket_follows_its_seed_alone(tmp_path):
    first = train(tmp_path, seed=3)
    assert train(tmp_path, seed=3) == first
    other = train(tmp_path, seed=4)
    assert all(other[k] != first[k] for k in ("embs", "sums"))


def test_the_warm_up_trains_alone_as_one_thread_does(tmp_path):
    """A warm-up longer than the bucket: the second thread joins when the batches run
    out, and every update, of the shared parameters too, is the one thread's to the bit
    (same batches, same negatives, same order)."""
    assert train(tmp_path, seed=3, threads=2, warmup_s=3600) == train(tmp_path, seed=3)


def test_batch_queue_hands_out_each_batch_once():
    queue = BatchQueue(3, warmup_s=3600)
    assert [queue.take() for _ in range(4)] == [0, 1, 2, None]
    queue.join()  # the batches ran out: the warm-up ends at once
    stopped = BatchQueue(5)
    assert stopped.take() == 0
    stopped.close()
    assert stopped.take() is None


def hogwild_threads() -> set:
    return {t.ident for t in threading.enumerate() if t.name.startswith("hogwild")}


def test_buckets_reuse_the_same_hogwild_threads(tmp_path):
    """A bucket's helper threads outlive it and the next bucket trains on them (a new
    thread per bucket would take another malloc arena each time)."""
    train(tmp_path, seed=3, threads=2)
    first = hogwild_threads()
    train(tmp_path, seed=4, threads=2)
    assert first and hogwild_threads() == first
