"""The bucket scheduler: PBG's bucket orders, no two held buckets sharing a partition,
failed buckets handed out again, seeded pass orders, BETA's buffer-aware order with
its partition reads against the lower bound, and what the scheduler actor's process loads."""

import random
import sys
import uuid

import pytest

from pbg_ray.training.scheduler import (
    BucketScheduler, BucketSchedulerActor, bucket_order, partition_reads, reads_lower_bound)
from pbg_ray.types import Bucket

ORDERS = ["random", "affinity", "inside_out", "outside_in"]


@pytest.mark.oracle
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("nparts", [(1, 1), (4, 4), (3, 5), (5, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orders_equal_torchbiggraphs(order, nparts, seed):
    from torchbiggraph.bucket_scheduling import create_ordered_buckets
    from torchbiggraph.config import BucketOrder

    ours = bucket_order(order, *nparts, random.Random(seed))
    theirs = create_ordered_buckets(*nparts, BucketOrder(order), generator=random.Random(seed))
    assert ours == [Bucket(b.lhs, b.rhs) for b in theirs]
    if order in ("random", "affinity"):
        assert sorted(ours) == [Bucket(l, r) for l in range(nparts[0]) for r in range(nparts[1])]


def test_inside_out_layers():
    order = bucket_order("inside_out", 4, 4, random.Random(0))
    layers = [min(b) for b in order]
    assert layers == sorted(layers, reverse=True) and len(order) == 16
    order = bucket_order("outside_in", 4, 4, random.Random(0))
    assert [min(b) for b in order] == sorted(min(b) for b in order)


def hold_all(scheduler):
    held = []
    while (b := scheduler.acquire()) is not None:
        held.append(b)
    return held


def test_concurrent_buckets_never_share_a_partition():
    scheduler = BucketScheduler(6, 6, "random", seed=3)
    scheduler.new_pass(0)
    seen = []
    while not scheduler.pass_done():
        held = hold_all(scheduler)
        parts = [p for b in held for p in set(b)]
        assert len(parts) == len(set(parts)), held
        assert held, "nothing could be handed out although buckets remain"
        scheduler.release(held[0])
        seen.append(held[0])
        for b in held[1:]:
            scheduler.fail(b)  # hand back without training: goes out again
    assert sorted(seen) == [Bucket(l, r) for l in range(6) for r in range(6)]


def test_unpartitioned_side_is_not_locked():
    scheduler = BucketScheduler(4, 1, "inside_out", lock_rhs=False)
    scheduler.new_pass(0)
    assert len(hold_all(scheduler)) == 4  # (0,0)..(3,0) all at once: rhs is shared


def test_failed_bucket_is_handed_out_again_first():
    scheduler = BucketScheduler(2, 2, "affinity", seed=0)
    scheduler.new_pass(0)
    b = scheduler.acquire()
    scheduler.fail(b)
    assert scheduler.acquire() == b
    scheduler.release(b)
    assert b in scheduler.state()["done"] and not scheduler.pass_done()




def test_a_pass_order_follows_the_seed_and_the_pass():
    def order(seed, iteration):
        return BucketScheduler(6, 6, "random", seed=seed).new_pass(iteration)
    assert order(3, 2) == order(3, 2)  # a resumed run, a restarted actor: the same order
    assert order(3, 2) != order(4, 2) and order(3, 2) != order(3, 1)


@pytest.mark.parametrize("nparts", [(1, 1), (2, 2), (5, 5), (8, 8), (16, 16), (6, 1), (3, 5)])
@pytest.mark.parametrize("buffer", [2, 3, 4, 8, 20])
def test_beta_trains_every_bucket_once(nparts, buffer):
    order = bucket_order("beta", *nparts, random.Random(buffer), buffer)
    assert sorted(order) == [Bucket(l, r) for l in range(nparts[0]) for r in range(nparts[1])]


@pytest.mark.parametrize("nparts", [4, 8, 12, 16])
@pytest.mark.parametrize("buffer", [2, 3, 4, 6])
def test_beta_reads_fewer_partitions_than_inside_out_near_the_bound(nparts, buffer):
    for seed in range(3):
        beta = partition_reads(bucket_order("beta", nparts, nparts, random.Random(seed), buffer),
                               buffer)
        inside_out = partition_reads(
            bucket_order("inside_out", nparts, nparts, random.Random(seed)), buffer)
        bound = reads_lower_bound(nparts, buffer)
        assert bound <= beta <= inside_out
        assert beta <= bound + buffer * (nparts // buffer)  # a round loses at most buffer reads
    if buffer == 2:  # a buffer of two: one read per new pair of partitions, the bound itself
        assert beta == bound


def test_partition_reads_of_a_buffer():
    order = [Bucket(0, 1), Bucket(1, 2), Bucket(0, 0), Bucket(2, 2)]
    assert partition_reads(order, 2) == 4  # 0, 1; 2 evicts 0 (needed again, but 1 now); 0
    assert partition_reads(order, 3) == 3  # each partition once
    assert reads_lower_bound(3, 2) == 4  # pairs 01, then 12, then 02: 0 is read twice
    assert reads_lower_bound(3, 3) == 3


def test_a_trainer_takes_its_next_bucket_while_training_the_current_one():
    scheduler = BucketScheduler(4, 4, "beta", seed=0, buffer=2)
    order = scheduler.new_pass(0)
    current = scheduler.acquire()
    following = scheduler.acquire(after=[current])
    assert (current, following) == (order[0], order[1])
    assert set(current) & set(following)  # consecutive buckets of beta share a partition
    other = scheduler.acquire()  # another trainer: nothing that shares a held partition
    assert other is None or not set(other) & (set(current) | set(following))
    scheduler.release(current)
    assert scheduler.acquire(after=[following]) == next(b for b in order[2:] if b != other)


def test_a_trainer_takes_a_bucket_after_two_it_holds():
    """A trainer with a bucket training and the next one submitted takes the one after
    both: in beta's order it shares partitions with each."""
    scheduler = BucketScheduler(4, 4, "beta", seed=0, buffer=2)
    order = scheduler.new_pass(0)
    first = scheduler.acquire()
    second = scheduler.acquire(after=[first])
    third = scheduler.acquire(after=[first, second])
    assert [first, second, third] == order[:3]
    assert set(third) & set(first) and set(third) & set(second)


def test_the_scheduler_actor_loads_neither_checkpoints_nor_config(ray_session):
    """The actor's process (its own: a runtime_env no other worker has) imports the
    scheduler's module and pbg_ray.types, none of the model's."""
    actor = BucketSchedulerActor.options(
        runtime_env={"env_vars": {"PBG_RAY_TEST_WORKER": uuid.uuid4().hex}}
    ).remote(2, 2, "inside_out", True, True, 0)
    assert len(ray_session.get(actor.new_pass.remote(0))) == 4
    heavy = ("h5py", "pbg_ray.config", "pbg_ray.checkpoints", "pbg_ray.training.partition_store", "torch")
    loaded = ray_session.get(actor.__ray_call__.remote(
        lambda _: [m for m in heavy if m in sys.modules]))
    assert loaded == []
