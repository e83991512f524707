import subprocess
import sys

import numpy as np
import ray.cloudpickle

from pbg_ray.engine.bucket_task import partition_keys, split_held_out, start_trainer_worker
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
