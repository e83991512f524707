"""A bucket's train task: held-out edges, partition keys, the warm-up task, a swapped
partition trained as one sent through the object store, and what it returns through the
object store."""

import os
import subprocess
import sys

import numpy as np
import ray.cloudpickle

from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_state
from pbg_ray.checkpoints.sources import CheckpointSource
from pbg_ray.model.params import init_params, partition_keys
from pbg_ray.evaluation import distributed
from pbg_ray.training import bucket_task
from pbg_ray.checkpoints.position import Position
from pbg_ray.training.bucket_task import (
    BucketWork, run_bucket, split_held_out, start_trainer_worker)
from pbg_ray.training.partition_buffer import PartitionBuffer
from pbg_ray.training.bucket_sources import RandomSource, SwapFile
from pbg_ray.types import Bucket, EdgeList
from tests.util import write_random_graph


def edges(n):
    return EdgeList(np.arange(n), np.arange(n) + 1000, np.zeros(n, np.int64))


def test_held_out_edges_are_the_same_every_epoch_and_never_trained():
    e = edges(1000)
    held_1, train_1 = split_held_out(e, 0.1, [0, 1, 0])
    held_2, train_2 = split_held_out(e, 0.1, [0, 1, 0])
    assert len(held_1) == 100 and len(train_1) == 900
    np.testing.assert_array_equal(held_1.lhs, held_2.lhs)
    assert not set(held_1.lhs) & set(train_1.lhs)
    assert sorted(set(held_1.lhs) | set(train_1.lhs)) == list(range(1000))
    np.testing.assert_array_equal(train_1.rhs, train_1.lhs + 1000)  # columns stay aligned
    other, _ = split_held_out(e, 0.1, [1, 1, 0])  # another bucket holds out other edges
    assert not np.array_equal(np.sort(other.lhs), np.sort(held_1.lhs))


def test_no_held_out_edges_when_fraction_is_zero():
    held, train = split_held_out(edges(50), 0.0, [0])
    assert len(held) == 0 and sorted(train.lhs) == list(range(50))


def test_partition_keys(make_config):
    config = make_config()  # user, item: 2 partitions; tag unpartitioned
    assert partition_keys(config, Bucket(1, 0)) == [("user", 1), ("item", 1), ("user", 0),
                                                     ("item", 0), ("tag", 0)]


def test_the_warm_up_task_imports_what_train_tasks_need():
    # Ray ships a remote function by value (cloudpickle), so a worker imports only what
    # the function names. Load and run the warm-up as a fresh worker would.
    shipped = ray.cloudpickle.dumps(start_trainer_worker._function)
    check = ("import sys, ray.cloudpickle; f = ray.cloudpickle.loads(sys.stdin.buffer.read()); "
             "before = 'torch' in sys.modules; f(); "
             "print(before, 'torch' in sys.modules, 'pbg_ray.model.kernel' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", check], input=shipped, capture_output=True,
                         check=True).stdout.decode().split()
    assert out == ["False", "True", "True"]


def test_the_bucket_tasks_ship_with_the_globals_they_name():
    """Ray ships them by value with the globals their wrappers name: the process's pending
    heap trim (release_free_heap) goes as the receiving process's own, its lock unpickled."""
    for task in (bucket_task.train_bucket_task, distributed.evaluate_bucket_task):
        assert callable(ray.cloudpickle.loads(ray.cloudpickle.dumps(task._function)))


def test_a_swapped_partition_trains_as_one_sent_through_the_object_store(make_config):
    """Disk placement's SwapFile: read from its source, trained, written to its staged
    file; the same numbers as the partition handed over in memory."""
    config = make_config(eval_fraction=0.0)
    write_random_graph(config, num_edges=400)
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    bucket = Bucket(1, 0)
    keys = partition_keys(config, bucket)
    parts = {key: RandomSource(50, 0).load(config, key) for key in keys}
    for key, (embs, sums) in parts.items():
        storage.save_entity_partition(1, *key, embs, row_adagrad_state(sums + 1, config.lr))
        parts[key] = (embs, sums + 1)
    params = init_params(config, 3)

    def run(partitions, copies=None):
        work = BucketWork(bucket, config.edge_paths[0], Position.of(0, 1, 1, 1), 3, tuple(keys),
                          (False,) * len(keys))
        return run_bucket(config, work, params, partitions, 1, "cpu", copies=copies)

    _, in_memory_delta, _, *in_memory = run([parts[key] for key in keys])
    swaps = [SwapFile(CheckpointSource(config.checkpoint_path, 1), str(storage.swap_file("test", i)),
                      f"lease {i}") for i, key in enumerate(keys)]
    copies = PartitionBuffer()
    _, delta, _, *results = run(swaps, copies)
    assert results == swaps
    for name in params.arrays:
        np.testing.assert_array_equal(delta.arrays[name], in_memory_delta.arrays[name])
    for key, swap, (embs, sums) in zip(keys, swaps, in_memory):
        assert not np.array_equal(embs, parts[key][0])  # trained
        # Its source is untouched: a task that dies after writing has changed nothing.
        np.testing.assert_array_equal(storage.load_entity_partition(1, *key)[0], parts[key][0])
        # Its swap file holds what the in-memory run returned.
        got_embs, got_sums = swap.written.load(config, key)
        np.testing.assert_array_equal(got_embs, embs)
        np.testing.assert_array_equal(got_sums, sums)

    # The next bucket on these partitions, from what the first wrote: read from the swap
    # files, or in the worker that wrote them, from the arrays it kept (the files gone).
    again = [SwapFile(swap.written, str(storage.swap_file("test", 10 + i)), f"again {i}")
             for i, swap in enumerate(swaps)]
    _, read_delta, _, *_ = run(again)
    read = [swap.written.load(config, key) for key, swap in zip(keys, again)]
    for swap in swaps:
        os.unlink(swap.staged)
    copies.next_task(keep=True, parts={0, 1},
                     leases={key: swap.source for key, swap in zip(keys, again)})
    _, held_delta, _, *_ = run(again, copies)
    for name in params.arrays:
        np.testing.assert_array_equal(held_delta.arrays[name], read_delta.arrays[name])
    for key, swap, (embs, sums) in zip(keys, again, read):
        got_embs, got_sums = swap.written.load(config, key)
        np.testing.assert_array_equal(got_embs, embs)
        np.testing.assert_array_equal(got_sums, sums)


BUFFER = np.zeros(1 << 20, np.float32)  # 4 MB: returned through the object store


@ray.remote(num_cpus=2)
def fill_and_return(value):
    BUFFER[:] = value
    return os.getpid(), BUFFER


def test_a_tasks_returns_are_copied_before_its_worker_runs_the_next_task(ray_session):
    # What PartitionBuffer relies on: a task may return the worker's buffers, which the
    # worker's next task overwrites.
    first, second = fill_and_return.remote(1.0), fill_and_return.remote(2.0)
    pid_2, values_2 = ray.get(second)  # the buffer holds 2s from now on
    pid_1, values_1 = ray.get(first)
    assert pid_1 == pid_2  # one worker ran both (each takes both CPUs)
    assert (values_1 == 1).all() and (values_2 == 2).all()
