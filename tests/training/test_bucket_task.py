"""A bucket's train task: held-out edges, partition keys, the warm-up task, the worker's
partition copies (reused buffers, read-ahead, write-behind and its markers, hand-over) and what it
returns through the object store."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import ray.cloudpickle

from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_state
from pbg_ray.errors import PbgRayError
from pbg_ray.io.edges import edges_file, read_edges
from pbg_ray.model.params import init_params
from pbg_ray.training import bucket_task
from pbg_ray.training.bucket_task import (
    PartitionCopies, partition_keys, run_bucket, split_held_out, start_trainer_worker, writable)
from pbg_ray.training.sources import (
    OnDisk, SwapFile, WriterDied, load_partition, wait_written, written_marker)
from pbg_ray.types import Bucket, EdgeList
from tests.util import ManualClock, write_random_graph


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
    for task in (bucket_task.train_bucket_task, bucket_task.evaluate_bucket_task):
        assert callable(ray.cloudpickle.loads(ray.cloudpickle.dumps(task._function)))


def test_partition_copies_reuse_their_buffers_until_told_not_to():
    copies = PartitionCopies()
    embs, sums = np.arange(12, dtype=np.float32).reshape(4, 3), np.ones(4, np.float32)
    embs.flags.writeable = sums.flags.writeable = False  # as the object store hands them out
    first = writable((embs, sums), copies.empty)
    assert all(a.flags.writeable for a in first)
    np.testing.assert_array_equal(first[0], embs)
    first[0][0, 0] = -1  # the copy, not the original
    assert embs[0, 0] == 0
    copies.next_task(keep=True)
    again = writable((embs + 1, sums), copies.empty)
    assert np.shares_memory(again[0], first[0]) and np.shares_memory(again[1], first[1])
    np.testing.assert_array_equal(again[0], embs + 1)
    copies.next_task(keep=True)
    # Partitions differ by a few rows: one buffer serves tables of every size up to its own.
    smaller, second = copies.empty((3, 3), np.float32), copies.empty((5, 3), np.float32)
    assert smaller.shape == (3, 3) and np.shares_memory(smaller, first[0])
    assert not np.shares_memory(second, first[0])  # the second table's own buffer
    copies.next_task(keep=True)
    grown = copies.empty((6, 3), np.float32)  # larger than both buffers: the larger grows
    assert grown.shape == (6, 3)
    assert not np.shares_memory(grown, first[0]) and not np.shares_memory(grown, second)
    assert np.shares_memory(copies.empty((4, 3), np.float32), first[0])  # the smallest that fits
    copies.next_task(keep=False)
    assert not copies.free and not copies.used  # freed, and the task's copies are not kept either
    np.testing.assert_array_equal(writable((embs, sums), copies.empty)[0], embs)
    assert not copies.used


def test_partition_copies_keep_written_partitions_and_read_the_next_ones_ahead(
        make_config, tmp_path):
    """The worker's partition buffer in disk placement: a partition written behind its
    task is held for the next task whose lease names what was written; the next bucket's
    partitions are read ahead; what the driver does not say to keep is dropped."""
    config = make_config()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    copies = PartitionCopies()
    user0, user1 = ("user", 0), ("user", 1)
    first = SwapFile(("random", 40, 0), str(storage.swap_file("t", 0)), "lease-1")
    trained = copies.load(config, user0, first)  # read: not held
    assert copies.reads == 1
    trained[0][:] += 1
    copies.write_behind(config, user0, first, trained, {})
    # Any reader of what the task wrote waits for the write behind it.
    np.testing.assert_array_equal(load_partition(config, user0, first.written)[0], trained[0])
    second = SwapFile(first.written, str(storage.swap_file("t", 1)), "lease-2")
    ahead = SwapFile(("random", 30, 0), str(storage.swap_file("t", 2)), "lease-3")
    copies.read_ahead(config, [(user1, OnDisk(ahead.source))])
    assert copies.reads == 2
    copies.next_task(keep=True, parts={0, 1}, leases={user0: second.source,
                                                      user1: ahead.source})
    other = copies.empty(trained[0].shape, np.float32)  # held buffers are not handed out
    assert not np.shares_memory(other, trained[0])
    again = copies.load(config, user0, second)
    assert again[0] is trained[0] and again[1] is trained[1]  # the arrays it wrote
    read_ahead = copies.load(config, user1, ahead)
    np.testing.assert_array_equal(read_ahead[0], load_partition(config, user1, ahead.source)[0])
    assert copies.reads == 2  # neither read again
    copies.write_behind(config, user0, second, again, {})
    copies.write_behind(config, user1, ahead, read_ahead, {})
    copies.next_task(keep=True, parts={1})  # partition 0 is not kept: its buffers are freed
    assert set(copies.held) == {(user1, ahead.written)}
    assert any(np.shares_memory(copies.empty(trained[0].shape, np.float32), trained[0])
               for _ in range(2))
    np.testing.assert_array_equal(load_partition(config, user0, second.written)[0], trained[0])
    copies.next_task(keep=False)  # nothing is kept
    assert not copies.held and not copies.used and not copies.free


def test_a_partition_held_for_a_later_task_is_written_only_if_no_task_takes_it(
        make_config, tmp_path):
    """A partition a later task of the trainer trains too is held for it unwritten (its
    marker says pending): taken by that task, it is never written; kept in the buffer
    while the worker's next task trains others, it stays unwritten with one trainer
    (write-back) and is written then with several (the task it was held for runs
    elsewhere); dropped from the buffer, it is written then; at the end of the trainer's
    pass (write_held) at once; asked for by a reader in another process (Ray ran the
    next task on another worker), at once; with no next task, after HAND_OVER_WAIT_S.
    Every write begun is counted once. The wait is measured by a clock only the test
    moves."""
    clock = ManualClock()
    config = make_config()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    copies = PartitionCopies(clock=clock)
    user0 = ("user", 0)

    def pending(lease):
        return written_marker(lease.staged).read_text().startswith(f"{lease.token}\npending ")

    first = SwapFile(("random", 40, 0), str(storage.swap_file("t", 0)), "lease-1")
    trained = copies.load(config, user0, first)
    trained[0][:] += 1
    assert not copies.write_behind(config, user0, first, trained, {}, hand_over=True)
    assert pending(first)
    # Taken by the task it was held for: trained on in place, never written.
    second = SwapFile(first.written, str(storage.swap_file("t", 1)), "lease-2")
    copies.next_task(keep=True, parts={0}, leases={user0: second.source})
    again = copies.load(config, user0, second)
    assert again[0] is trained[0]
    assert pending(first) and copies.take_io() == {"reads": 1, "writes": 0}
    # The worker's next task trains other partitions and the buffer keeps this one: unwritten.
    again[0][:] += 1
    assert not copies.write_behind(config, user0, second, again, {}, hand_over=True)
    copies.next_task(keep=True, parts={0, 1}, leases={}, write_back=True)
    assert pending(second) and copies.take_io() == {"reads": 0, "writes": 0}
    # Dropped from the buffer: written as the next task starts.
    copies.next_task(keep=True, parts={1}, leases={}, write_back=True)
    np.testing.assert_array_equal(load_partition(config, user0, second.written)[0], again[0])
    assert copies.take_io() == {"reads": 0, "writes": 1}
    # The trainer's pass ends: what is held is written at once.
    third = SwapFile(second.written, str(storage.swap_file("t", 2)), "lease-3")
    last = copies.load(config, user0, third)
    assert not copies.write_behind(config, user0, third, last, {}, hand_over=True)
    copies.write_held()
    np.testing.assert_array_equal(load_partition(config, user0, third.written)[0], last[0])
    # Several trainers: held for the next task, which this worker's next task is not.
    fourth = SwapFile(third.written, str(storage.swap_file("t", 3)), "lease-4")
    again = copies.load(config, user0, fourth)
    assert not copies.write_behind(config, user0, fourth, again, {}, hand_over=True)
    copies.next_task(keep=True, parts={0, 1}, leases={})
    np.testing.assert_array_equal(load_partition(config, user0, fourth.written)[0], again[0])
    assert copies.take_io() == {"reads": 1, "writes": 2}
    # Read by another process, which asks for it: written at once, long before the wait
    # runs out; a task here that comes for it after that waits for the write.
    asked = SwapFile(fourth.written, str(storage.swap_file("t", 5)), "lease-asked")
    held = copies.load(config, user0, asked)
    held[0][:] += 1
    assert not copies.write_behind(config, user0, asked, held, {}, hand_over=True)
    assert not asked.asked()
    reader = ("import sys; from pbg_ray.training.sources import wait_written; "
              "wait_written(sys.argv[1], sys.argv[2], timeout=30.0)")
    subprocess.run([sys.executable, "-c", reader, asked.staged, asked.token], check=True,
                   cwd=os.getcwd(), timeout=60)
    assert asked.asked()
    np.testing.assert_array_equal(load_partition(config, user0, asked.written)[0], held[0])
    assert copies.take_io() == {"reads": 0, "writes": 1}
    fifth = SwapFile(asked.written, str(storage.swap_file("t", 4)), "lease-5")
    copies.next_task(keep=True, parts={0}, leases={user0: fifth.source})
    kept = copies.load(config, user0, fifth)
    assert kept[0] is held[0]
    # No next task: unwritten until HAND_OVER_WAIT_S has passed, then written.
    assert not copies.write_behind(config, user0, fifth, kept, {}, hand_over=True)
    clock.advance(bucket_task.HAND_OVER_WAIT_S / 2)
    clock.wait_reads(2)  # the hand-over looked at the time, and decided, since the move
    assert pending(fifth) and copies.take_io() == {"reads": 0, "writes": 0}
    clock.advance(bucket_task.HAND_OVER_WAIT_S)
    np.testing.assert_array_equal(load_partition(config, user0, fifth.written)[0], kept[0])
    assert copies.take_io() == {"reads": 0, "writes": 1}
    copies.next_task(keep=False)


def test_a_read_ahead_that_failed_fails_only_the_task_that_takes_it(make_config):
    """A read ahead of a swap file whose writer died (a pass that failed, trained again)
    raises nothing where the worker drops it; kept for a task, that task reads the file
    itself and gets its own error."""
    config = make_config()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    copies = PartitionCopies()
    user1 = ("user", 1)
    lost = SwapFile(("random", 30, 0), str(storage.swap_file("t", 0)), "lease-1")
    lost.begin_write()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    written_marker(lost.staged).write_text(f"lease-1\npending {socket.gethostname()} {gone}")
    copies.read_ahead(config, [(user1, OnDisk(lost.written))])
    copies.next_task(keep=True, parts={0}, leases={})  # dropped: nobody's error
    assert not copies.held
    copies.read_ahead(config, [(user1, OnDisk(lost.written))])
    copies.next_task(keep=True, parts={1}, leases={user1: lost.written})  # kept, failed
    assert not copies.held
    with pytest.raises(WriterDied, match="died before the write was done"):
        copies.load(config, user1, SwapFile(lost.written, str(storage.swap_file("t", 1)), "l2"))
    copies.next_task(keep=False)


def test_the_next_buckets_edges_are_read_while_this_one_trains(make_config):
    """A task given its trainer's next bucket (`following`) reads that bucket's edges in
    the background; the next task trains on them without reading its file (gone here),
    and a task of another bucket reads its own file, whatever was read ahead."""
    config = make_config(eval_fraction=0.0)
    write_random_graph(config, num_edges=400)
    first, second = Bucket(1, 0), Bucket(0, 1)
    params = init_params(config, 3)
    copies = PartitionCopies()

    def run(bucket, following=None):
        keys = partition_keys(config, bucket)
        partitions = [load_partition(config, key, ("random", 50, 0)) for key in keys]
        return run_bucket(config, bucket, config.edge_paths[0], 0, 1, 0, 3, keys, params,
                          partitions, [False] * len(keys), 1, "cpu", copies=copies,
                          following=following)[0]

    path = edges_file(config.edge_paths[0], second)
    count = len(read_edges(config.edge_paths[0], second))
    assert run(first, following=second)["stats"]["count"] == len(
        read_edges(config.edge_paths[0], first))
    copies.edges_ahead[1].result()  # read by now
    moved = path.with_name(path.name + ".away")
    os.replace(path, moved)
    assert run(second)["stats"]["count"] == count  # from what was read ahead
    assert copies.edges_ahead is None
    os.replace(moved, path)
    run(first, following=second)
    assert run(first)["stats"]["count"] == len(read_edges(config.edge_paths[0], first))
    copies.next_task(keep=False)


def test_a_reader_of_a_swap_file_waits_for_its_write_or_learns_it_never_ends(tmp_path):
    staged = str(tmp_path / ".partition.h5.tmp-swap-x-0")
    marker = written_marker(staged)
    marker.write_text("tok\ndone")
    wait_written(staged, "tok")
    with pytest.raises(WriterDied, match="does not hold the values of lease other"):
        wait_written(staged, "other")
    marker.write_text("tok\nfailed writing x: disk full")
    with pytest.raises(PbgRayError, match="writing x: disk full"):
        wait_written(staged, "tok")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    marker.write_text(f"tok\npending {socket.gethostname()} {gone}")
    with pytest.raises(WriterDied, match="died before the write was done"):
        wait_written(staged, "tok")
    marker.write_text(f"tok\npending {socket.gethostname()} {os.getpid()}")  # alive: waits
    with pytest.raises(WriterDied, match="did not finish in 0 s"):
        wait_written(staged, "tok", timeout=0.05)


def test_a_swapped_partition_trains_as_one_sent_through_the_object_store(make_config):
    """Disk placement's SwapFile: read from its source, trained, written to its staged
    file; the same numbers as the partition handed over in memory."""
    config = make_config(eval_fraction=0.0)
    write_random_graph(config, num_edges=400)
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    bucket = Bucket(1, 0)
    keys = partition_keys(config, bucket)
    parts = {key: load_partition(config, key, ("random", 50, 0)) for key in keys}
    for key, (embs, sums) in parts.items():
        storage.save_entity_partition(1, *key, embs, row_adagrad_state(sums + 1, config.lr))
        parts[key] = (embs, sums + 1)
    params = init_params(config, 3)

    def run(partitions, copies=None):
        return run_bucket(config, bucket, config.edge_paths[0], 0, 1, 0, 3, keys, params,
                          partitions, [False] * len(keys), 1, "cpu", copies=copies)

    _, in_memory_delta, *in_memory = run([parts[key] for key in keys])
    swaps = [SwapFile(("checkpoint", config.checkpoint_path, 1), str(storage.swap_file("test", i)),
                      f"lease {i}") for i, key in enumerate(keys)]
    copies = PartitionCopies()
    _, delta, *results = run(swaps, copies)
    assert results == swaps
    for name in params.arrays:
        np.testing.assert_array_equal(delta.arrays[name], in_memory_delta.arrays[name])
    for key, swap, (embs, sums) in zip(keys, swaps, in_memory):
        assert not np.array_equal(embs, parts[key][0])  # trained
        # Its source is untouched: a task that dies after writing has changed nothing.
        np.testing.assert_array_equal(storage.load_entity_partition(1, *key)[0], parts[key][0])
        # Its swap file holds what the in-memory run returned.
        got_embs, got_sums = load_partition(config, key, swap.written)
        np.testing.assert_array_equal(got_embs, embs)
        np.testing.assert_array_equal(got_sums, sums)

    # The next bucket on these partitions, from what the first wrote: read from the swap
    # files, or in the worker that wrote them, from the arrays it kept (the files gone).
    again = [SwapFile(swap.written, str(storage.swap_file("test", 10 + i)), f"again {i}")
             for i, swap in enumerate(swaps)]
    _, read_delta, *_ = run(again)
    read = [load_partition(config, key, swap.written) for key, swap in zip(keys, again)]
    for swap in swaps:
        os.unlink(swap.staged)
    copies.next_task(keep=True, parts={0, 1},
                     leases={key: swap.source for key, swap in zip(keys, again)})
    _, held_delta, *_ = run(again, copies)
    for name in params.arrays:
        np.testing.assert_array_equal(held_delta.arrays[name], read_delta.arrays[name])
    for key, swap, (embs, sums) in zip(keys, again, read):
        got_embs, got_sums = load_partition(config, key, swap.written)
        np.testing.assert_array_equal(got_embs, embs)
        np.testing.assert_array_equal(got_sums, sums)


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
