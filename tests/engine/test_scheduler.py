import random

import pytest
from torchbiggraph.bucket_scheduling import create_ordered_buckets
from torchbiggraph.config import BucketOrder

from pbg_ray.engine.scheduler import BucketScheduler, bucket_order
from pbg_ray.types import Bucket

pytestmark = pytest.mark.oracle

ORDERS = ["random", "affinity", "inside_out", "outside_in"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("nparts", [(1, 1), (4, 4), (3, 5), (5, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orders_equal_torchbiggraphs(order, nparts, seed):
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
