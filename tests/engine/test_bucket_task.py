import os
import subprocess
import sys

import numpy as np
import ray.cloudpickle

from pbg_ray.engine.bucket_task import (
    PartitionCopies, partition_keys, split_held_out, start_trainer_worker)
from pbg_ray.io.edges import EdgeList
from pbg_ray.types import Bucket


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


def test_partition_copies_reuse_a_buffer_per_shape_and_place_until_told_not_to():
    copies = PartitionCopies()
    embs, sums = np.arange(12, dtype=np.float32).reshape(4, 3), np.ones(4, np.float32)
    embs.flags.writeable = sums.flags.writeable = False  # as the object store hands them out
    first = [copies.copy(embs), copies.copy(sums)]
    assert all(a.flags.writeable for a in first)
    np.testing.assert_array_equal(first[0], embs)
    first[0][0, 0] = -1  # the copy, not the original
    assert embs[0, 0] == 0
    copies.next_task(keep=True)
    again = [copies.copy(embs + 1), copies.copy(sums)]
    assert again[0] is first[0] and again[1] is first[1]
    np.testing.assert_array_equal(again[0], embs + 1)
    assert copies.copy(np.zeros((2, 3), np.float32)) is not first[0]  # another shape
    copies.next_task(keep=False)
    assert not copies.buffers  # freed, and the task's copies are not kept either
    np.testing.assert_array_equal(copies.copy(embs), embs)
    assert not copies.buffers


BUFFER = np.zeros(1 << 20, np.float32)  # 4 MB: returned through the object store


@ray.remote(num_cpus=2)
def fill_and_return(value):
    BUFFER[:] = value
    return os.getpid(), BUFFER


def test_a_tasks_returns_are_copied_before_its_worker_runs_the_next_task(ray_session):
    # What PartitionCopies relies on: a task may return the worker's buffers, which the
    # worker's next task overwrites.
    first, second = fill_and_return.remote(1.0), fill_and_return.remote(2.0)
    pid_2, values_2 = ray.get(second)  # the buffer holds 2s from now on
    pid_1, values_1 = ray.get(first)
    assert pid_1 == pid_2  # one worker ran both (each takes both CPUs)
    assert (values_1 == 1).all() and (values_2 == 2).all()
