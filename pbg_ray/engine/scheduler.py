"""Bucket orders and partition locks (pure Python; the scheduler actor wraps it).

Orders are PBG's (torchbiggraph.bucket_scheduling): `random`; `affinity`
(each bucket shares as many partitions as possible with the previous one);
`inside_out` / `outside_in` (L-shaped layers: layer i holds the buckets with
min(lhs, rhs) == i, a bucket and its transpose adjacent, layers innermost
first for inside_out).

Locks: two buckets trained at once must not share a partition index, because
each would overwrite the other's update of that partition. A partitioned
entity type appearing on both sides (user -> user) makes (0, 1) and (1, 0)
collide, so the lock is on the partition index, whichever the side.
Unpartitioned types are shared by every bucket; their updates are merged as
deltas instead.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Set

from pbg_ray.types import Bucket


def layer_of_buckets(nparts_lhs: int, nparts_rhs: int, layer: int, rng: random.Random) -> List[Bucket]:
    """Buckets with min(lhs, rhs) == layer; a bucket and its transpose stay adjacent."""
    pairs = [[Bucket(layer, layer)]]
    for p in range(layer + 1, max(nparts_lhs, nparts_rhs)):
        pair = []
        if p < nparts_lhs:
            pair.append(Bucket(p, layer))
        if p < nparts_rhs:
            pair.append(Bucket(layer, p))
        rng.shuffle(pair)
        pairs.append(pair)
    rng.shuffle(pairs)
    return [b for pair in pairs for b in pair]


def buckets_by_affinity(nparts_lhs: int, nparts_rhs: int, rng: random.Random) -> List[Bucket]:
    """Each next bucket shares as many partitions as possible with the previous one."""
    all_buckets = [Bucket(l, r) for l in range(nparts_lhs) for r in range(nparts_rhs)]
    remaining: Set[Bucket] = set(all_buckets)
    by_partition: List[List[Bucket]] = [[] for _ in range(max(nparts_lhs, nparts_rhs))]
    for b in all_buckets:
        by_partition[b.lhs].append(b)
        by_partition[b.rhs].append(b)
    rng.shuffle(all_buckets)
    for buckets in by_partition:
        rng.shuffle(buckets)
    b = all_buckets.pop()
    remaining.remove(b)
    order = [b]
    while remaining:
        transposed = Bucket(b.rhs, b.lhs)
        if transposed in remaining:  # shares both partitions
            remaining.remove(transposed)
            order.append(transposed)
            if not remaining:
                break
        same_lhs, same_rhs = by_partition[b.lhs], by_partition[b.rhs]
        next_b = None
        while same_lhs or same_rhs:  # shares one partition
            (chosen,) = rng.choices([same_lhs, same_rhs], weights=[len(same_lhs), len(same_rhs)])
            candidate = chosen.pop()
            if candidate in remaining:
                next_b = candidate
                break
        while next_b is None:  # shares none
            candidate = all_buckets.pop()
            if candidate in remaining:
                next_b = candidate
        remaining.remove(next_b)
        order.append(next_b)
        b = next_b
    return order


def bucket_order(order: str, nparts_lhs: int, nparts_rhs: int, rng: random.Random) -> List[Bucket]:
    """All nparts_lhs x nparts_rhs buckets in PBG's `order`."""
    if order == "random":
        buckets = [Bucket(l, r) for l in range(nparts_lhs) for r in range(nparts_rhs)]
        rng.shuffle(buckets)
        return buckets
    if order == "affinity":
        return buckets_by_affinity(nparts_lhs, nparts_rhs, rng)
    if order in ("inside_out", "outside_in"):
        layers = [layer_of_buckets(nparts_lhs, nparts_rhs, i, rng)
                  for i in range(min(nparts_lhs, nparts_rhs))]
        if order == "inside_out":
            layers.reverse()
        return [b for layer in layers for b in layer]
    raise ValueError(f"unknown bucket order {order!r}")


class BucketScheduler:
    """Hands out the buckets of one pass so that no two held at once share a
    locked partition index; a bucket given back as failed goes out again.

    `lock_lhs` / `lock_rhs`: whether the lhs / rhs side of buckets touches
    partitioned entity types (an unpartitioned side needs no lock). A pass's order
    follows the run's `seed` and the pass alone, so a resumed run trains in the order
    an uninterrupted one would have.
    """

    def __init__(self, nparts_lhs: int, nparts_rhs: int, order: str, *,
                 lock_lhs: bool = True, lock_rhs: bool = True, seed: int = 0) -> None:
        self.nparts_lhs, self.nparts_rhs = nparts_lhs, nparts_rhs
        self.order = order
        self.lock_lhs, self.lock_rhs = lock_lhs, lock_rhs
        self.seed = seed
        self.pending: List[Bucket] = []
        self.active: Set[Bucket] = set()
        self.done: List[Bucket] = []

    def new_pass(self, iteration: int) -> List[Bucket]:
        """Start pass `iteration` (its index in the run): its buckets in order."""
        if self.active:
            raise RuntimeError(f"new pass while buckets {sorted(self.active)} are still held")
        rng = random.Random(f"{self.seed}/{iteration}")
        self.pending = bucket_order(self.order, self.nparts_lhs, self.nparts_rhs, rng)
        self.done = []
        return list(self.pending)

    def _locked(self) -> Set[int]:
        locked: Set[int] = set()
        for b in self.active:
            if self.lock_lhs:
                locked.add(b.lhs)
            if self.lock_rhs:
                locked.add(b.rhs)
        return locked

    def acquire(self) -> Optional[Bucket]:
        """The first pending bucket whose partitions are free, or None (either
        none is free now, or the pass is over: see `pass_done`)."""
        locked = self._locked()
        for i, b in enumerate(self.pending):
            if (not self.lock_lhs or b.lhs not in locked) and (not self.lock_rhs or b.rhs not in locked):
                del self.pending[i]
                self.active.add(b)
                return b
        return None

    def release(self, bucket: Bucket) -> None:
        self.active.remove(bucket)
        self.done.append(bucket)

    def fail(self, bucket: Bucket) -> None:
        """The trainer of `bucket` died before its update was applied: hand it out again."""
        self.active.remove(bucket)
        self.pending.insert(0, bucket)

    def pass_done(self) -> bool:
        return not self.pending and not self.active

    def state(self) -> Dict[str, List[Bucket]]:
        return {"pending": list(self.pending), "active": sorted(self.active), "done": list(self.done)}
