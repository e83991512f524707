"""A train task's worker's partition buffer: reused buffers, partitions kept and read ahead,
writes behind their tasks, the hand-over of a partition held for the trainer's next task,
and the next bucket's edges read ahead."""

import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.io.edges import edges_file, read_edges
from pbg_ray.model.params import init_params, partition_keys
from pbg_ray.training import hand_over
from pbg_ray.checkpoints.position import Position
from pbg_ray.training.bucket_task import BucketWork, run_bucket
from pbg_ray.training.partition_buffer import PartitionBuffer, writable
from pbg_ray.training.bucket_sources import RandomSource, SwapFile, WriterDied, written_marker
from pbg_ray.types import Bucket
from tests.util import ManualClock, write_random_graph


def test_partition_copies_reuse_their_buffers_until_told_not_to():
    copies = PartitionBuffer()
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
    copies = PartitionBuffer()
    user0, user1 = ("user", 0), ("user", 1)
    first = SwapFile(RandomSource(40, 0), str(storage.swap_file("t", 0)), "lease-1")
    trained = copies.load(config, user0, first)  # read: not held
    assert copies.reads == 1
    trained[0][:] += 1
    copies.write_behind(config, user0, first, trained, {})
    # Any reader of what the task wrote waits for the write behind it.
    np.testing.assert_array_equal(first.written.load(config, user0)[0], trained[0])
    second = SwapFile(first.written, str(storage.swap_file("t", 1)), "lease-2")
    ahead = SwapFile(RandomSource(30, 0), str(storage.swap_file("t", 2)), "lease-3")
    copies.read_ahead(config, [(user1, ahead.source)])
    assert copies.reads == 2
    copies.next_task(keep=True, parts={0, 1}, leases={user0: second.source,
                                                      user1: ahead.source})
    other = copies.empty(trained[0].shape, np.float32)  # held buffers are not handed out
    assert not np.shares_memory(other, trained[0])
    again = copies.load(config, user0, second)
    assert again[0] is trained[0] and again[1] is trained[1]  # the arrays it wrote
    read_ahead = copies.load(config, user1, ahead)
    np.testing.assert_array_equal(read_ahead[0], ahead.source.load(config, user1)[0])
    assert copies.reads == 2  # neither read again
    copies.write_behind(config, user0, second, again, {})
    copies.write_behind(config, user1, ahead, read_ahead, {})
    copies.next_task(keep=True, parts={1})  # partition 0 is not kept: its buffers are freed
    assert set(copies.held) == {(user1, ahead.written)}
    assert any(np.shares_memory(copies.empty(trained[0].shape, np.float32), trained[0])
               for _ in range(2))
    np.testing.assert_array_equal(second.written.load(config, user0)[0], trained[0])
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
    Every write begun is counted once, a wait's that ran out as late too. The wait is measured by a clock only the test
    moves."""
    clock = ManualClock()
    config = make_config()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    copies = PartitionBuffer(clock=clock)
    user0 = ("user", 0)

    def pending(lease):
        return written_marker(lease.staged).read_text().startswith(f"{lease.token}\npending ")

    first = SwapFile(RandomSource(40, 0), str(storage.swap_file("t", 0)), "lease-1")
    trained = copies.load(config, user0, first)
    trained[0][:] += 1
    assert not copies.write_behind(config, user0, first, trained, {}, hand_over=True)
    assert pending(first)
    # Taken by the task it was held for: trained on in place, never written.
    second = SwapFile(first.written, str(storage.swap_file("t", 1)), "lease-2")
    copies.next_task(keep=True, parts={0}, leases={user0: second.source})
    again = copies.load(config, user0, second)
    assert again[0] is trained[0]
    assert pending(first) and copies.take_io() == {"reads": 1, "writes": 0, "late_writes": 0}
    # The worker's next task trains other partitions and the buffer keeps this one: unwritten.
    again[0][:] += 1
    assert not copies.write_behind(config, user0, second, again, {}, hand_over=True)
    copies.next_task(keep=True, parts={0, 1}, leases={}, write_back=True)
    assert pending(second) and copies.take_io() == {"reads": 0, "writes": 0, "late_writes": 0}
    # Dropped from the buffer: written as the next task starts.
    copies.next_task(keep=True, parts={1}, leases={}, write_back=True)
    np.testing.assert_array_equal(second.written.load(config, user0)[0], again[0])
    assert copies.take_io() == {"reads": 0, "writes": 1, "late_writes": 0}
    # The trainer's pass ends: what is held is written at once.
    third = SwapFile(second.written, str(storage.swap_file("t", 2)), "lease-3")
    last = copies.load(config, user0, third)
    assert not copies.write_behind(config, user0, third, last, {}, hand_over=True)
    copies.write_held()
    np.testing.assert_array_equal(third.written.load(config, user0)[0], last[0])
    # Several trainers: held for the next task, which this worker's next task is not.
    fourth = SwapFile(third.written, str(storage.swap_file("t", 3)), "lease-4")
    again = copies.load(config, user0, fourth)
    assert not copies.write_behind(config, user0, fourth, again, {}, hand_over=True)
    copies.next_task(keep=True, parts={0, 1}, leases={})
    np.testing.assert_array_equal(fourth.written.load(config, user0)[0], again[0])
    assert copies.take_io() == {"reads": 1, "writes": 2, "late_writes": 0}
    # Read by another process, which asks for it: written at once, long before the wait
    # runs out; a task here that comes for it after that waits for the write.
    asked = SwapFile(fourth.written, str(storage.swap_file("t", 5)), "lease-asked")
    held = copies.load(config, user0, asked)
    held[0][:] += 1
    assert not copies.write_behind(config, user0, asked, held, {}, hand_over=True)
    assert not asked.asked()
    reader = ("import sys; from pbg_ray.training.bucket_sources import wait_written; "
              "wait_written(sys.argv[1], sys.argv[2], timeout=30.0)")
    subprocess.run([sys.executable, "-c", reader, asked.staged, asked.token], check=True,
                   cwd=os.getcwd(), timeout=60)
    assert asked.asked()
    np.testing.assert_array_equal(asked.written.load(config, user0)[0], held[0])
    assert copies.take_io() == {"reads": 0, "writes": 1, "late_writes": 0}
    fifth = SwapFile(asked.written, str(storage.swap_file("t", 4)), "lease-5")
    copies.next_task(keep=True, parts={0}, leases={user0: fifth.source})
    kept = copies.load(config, user0, fifth)
    assert kept[0] is held[0]
    # No next task: unwritten until HAND_OVER_WAIT_S has passed, then written.
    assert not copies.write_behind(config, user0, fifth, kept, {}, hand_over=True)
    clock.advance(hand_over.HAND_OVER_WAIT_S / 2)
    clock.wait_reads(2)  # the hand-over looked at the time, and decided, since the move
    assert pending(fifth) and copies.take_io() == {"reads": 0, "writes": 0, "late_writes": 0}
    clock.advance(hand_over.HAND_OVER_WAIT_S)
    clock.wait_reads(1)  # it looked at the time since the move: the wait ran out
    np.testing.assert_array_equal(fifth.written.load(config, user0)[0], kept[0])
    assert copies.take_io() == {"reads": 0, "writes": 1, "late_writes": 1}
    copies.next_task(keep=False)


def test_a_read_ahead_that_failed_fails_only_the_task_that_takes_it(make_config):
    """A read ahead of a swap file whose writer died (a pass that failed, trained again)
    raises nothing where the worker drops it; kept for a task, that task reads the file
    itself and gets its own error."""
    config = make_config()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    copies = PartitionBuffer()
    user1 = ("user", 1)
    lost = SwapFile(RandomSource(30, 0), str(storage.swap_file("t", 0)), "lease-1")
    lost.begin_write()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    written_marker(lost.staged).write_text(f"lease-1\npending {socket.gethostname()} {gone}")
    copies.read_ahead(config, [(user1, lost.written)])
    copies.next_task(keep=True, parts={0}, leases={})  # dropped: nobody's error
    assert not copies.held
    copies.read_ahead(config, [(user1, lost.written)])
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
    copies = PartitionBuffer()

    def run(bucket, following=None):
        keys = partition_keys(config, bucket)
        partitions = [RandomSource(50, 0).load(config, key) for key in keys]
        work = BucketWork(bucket, config.edge_paths[0], Position.of(0, 1, 1, 1), 3, tuple(keys),
                          (False,) * len(keys), following=following)
        return run_bucket(config, work, params, partitions, 1, "cpu", copies=copies)[0]

    path = edges_file(config.edge_paths[0], second)
    count = len(read_edges(config.edge_paths[0], second))
    assert run(first, following=second).train["count"] == len(
        read_edges(config.edge_paths[0], first))
    copies.edges_ahead[1].result()  # read by now
    moved = path.with_name(path.name + ".away")
    os.replace(path, moved)
    assert run(second).train["count"] == count  # from what was read ahead
    assert copies.edges_ahead is None
    os.replace(moved, path)
    run(first, following=second)
    assert run(first).train["count"] == len(read_edges(config.edge_paths[0], first))
    copies.next_task(keep=False)


def test_a_task_reads_its_own_edges_in_the_background_while_it_copies_its_partitions(
        make_config, monkeypatch):
    """Edges not read ahead are read by the buffer's reader thread, begun before the task
    copies its partitions (the copy's page faults and the file's read overlap), and the
    task trains on all of them."""
    from pbg_ray.training import partition_buffer
    config = make_config(eval_fraction=0.0)
    write_random_graph(config, num_edges=400)
    bucket = Bucket(1, 0)
    readers = []

    def recorded(*where):
        readers.append(threading.current_thread().name)
        return read_edges(*where)

    monkeypatch.setattr(partition_buffer, "read_edges", recorded)
    keys = partition_keys(config, bucket)
    work = BucketWork(bucket, config.edge_paths[0], Position.of(0, 1, 1, 1), 3, tuple(keys),
                      (False,) * len(keys))
    copies = PartitionBuffer()
    stats = run_bucket(config, work, init_params(config, 3),
                       [RandomSource(50, 0).load(config, key) for key in keys], 1, "cpu",
                       copies=copies)[0]
    assert stats.train["count"] == len(read_edges(config.edge_paths[0], bucket))
    assert len(readers) == 1 and readers[0].startswith("partition-reader")
    assert copies.edges_ahead is None  # taken by the task
    copies.next_task(keep=False)
