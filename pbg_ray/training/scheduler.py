"""Bucket orders and partition locks (pure Python), and the actor that hands them out:
its process imports this module alone, with pbg_ray.types.

Orders are PBG's (torchbiggraph.bucket_scheduling): `random`; `affinity`
(each bucket shares as many partitions as possible with the previous one);
`inside_out` / `outside_in` (L-shaped layers: layer i holds the buckets with
min(lhs, rhs) == i, a bucket and its transpose adjacent, layers innermost
first for inside_out); and `beta`, buffer-aware for disk placement (see
`buckets_by_buffer`).

Locks: two buckets trained at once must not share a partition index, because
each would overwrite the other's update of that partition. A partitioned
entity type appearing on both sides (user -> user) makes (0, 1) and (1, 0)
collide, so the lock is on the partition index, whichever the side.
Unpartitioned types are shared by every bucket; their updates are merged as
deltas instead.
"""

from __future__ import annotations

import random
from typing import Collection, Dict, List, Optional, Sequence, Set

import ray

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


def buckets_by_buffer(nparts_lhs: int, nparts_rhs: int, buffer: int,
                      rng: random.Random) -> List[Bucket]:
    """Every bucket once, in an order that a trainer holding `buffer` partitions (at least
    2) trains with few partition reads: the BETA order of Marius (Mohoney et al., OSDI
    2021). A bucket (i, j) needs partitions i and j; each is trained as soon as both are
    in the buffer. Rounds: buffer - 1 partitions stay in the buffer while the last slot
    takes, one after the other, every partition that still has a bucket with them; those
    buffer - 1 are then done for the pass and the next round keeps the next ones, starting
    with the partition the last slot holds. Each read then brings buffer - 1 new pairs of
    partitions, near `reads_lower_bound`. Partitions are shuffled by `rng` first."""
    nparts = max(nparts_lhs, nparts_rhs)
    fixed_size = max(1, min(buffer, nparts) - 1)
    remaining = list(range(nparts))
    rng.shuffle(remaining)
    held: List[int] = []  # the buffer, oldest first
    order: List[Bucket] = []
    trained: Set[Bucket] = set()

    def enter(part: int, keep: Sequence[int]) -> None:
        """`part` into the buffer (evicting one not in `keep`), then every bucket it
        forms with the buffer's partitions."""
        if part not in held:
            if len(held) > fixed_size:
                held.remove(next(p for p in held if p not in keep))
            held.append(part)
        for other in held:
            for b in (Bucket(part, other), Bucket(other, part)):
                if b.lhs < nparts_lhs and b.rhs < nparts_rhs and b not in trained:
                    trained.add(b)
                    order.append(b)

    while remaining:
        fixed = [p for p in reversed(held) if p in remaining][:fixed_size]
        fixed += [p for p in remaining if p not in fixed][:fixed_size - len(fixed)]
        for part in fixed:
            enter(part, fixed)
        remaining = [p for p in remaining if p not in fixed]
        for part in sorted(remaining, key=lambda p: p not in held):  # held ones first
            enter(part, fixed)
    return order


def parts_by_next_use(upcoming: Sequence[Bucket]) -> List[int]:
    """The partition indices of the `upcoming` buckets, in the order they are first needed."""
    parts: List[int] = []
    for b in upcoming:
        for part in (b.lhs, b.rhs):
            if part not in parts:
                parts.append(part)
    return parts


def partitions_to_keep(held: Collection[int], own: Collection[int], next_use: Sequence[int],
                       buffer: int) -> Set[int]:
    """Of the partitions `held` in a trainer's buffer, those it keeps as it starts a bucket
    of partitions `own`: own, then those needed soonest (`next_use`, see
    parts_by_next_use, of the buckets after this one), `buffer` in all (Belady's rule:
    the partition needed again last goes first; one not needed again in the pass goes)."""
    rank = {part: i for i, part in enumerate(next_use)}
    others = sorted((p for p in set(held) - set(own) if p in rank), key=rank.__getitem__)
    return (set(held) & set(own)) | set(others[:max(0, buffer - len(set(own)))])


def partition_reads(order: Sequence[Bucket], buffer: int) -> int:
    """Partition reads of one trainer training `order` with a buffer of `buffer`
    partitions (at least 2), keeping them by partitions_to_keep as the trainer's
    workers do. A bucket needs partitions lhs and rhs (an entity type on both sides of
    the relations, partitioned)."""
    held: Set[int] = set()
    reads = 0
    for i, bucket in enumerate(order):
        own = {bucket.lhs, bucket.rhs}
        held = partitions_to_keep(held, own, parts_by_next_use(order[i + 1:]), buffer)
        reads += len(own - held)
        held |= own
    return reads


def reads_lower_bound(nparts: int, buffer: int) -> int:
    """The fewest partition reads a pass over all nparts x nparts buckets can take with a
    buffer of `buffer` partitions: the first `buffer` reads bring buffer (buffer - 1) / 2
    pairs of partitions, every later one at most buffer - 1 new pairs, and all
    nparts (nparts - 1) / 2 pairs must be met (Marius's bound)."""
    if buffer >= nparts:
        return nparts
    pairs = nparts * (nparts - 1) // 2 - buffer * (buffer - 1) // 2
    return buffer + -(-pairs // (buffer - 1))


def bucket_order(order: str, nparts_lhs: int, nparts_rhs: int, rng: random.Random,
                 buffer: int = 2) -> List[Bucket]:
    """All nparts_lhs x nparts_rhs buckets in PBG's `order` (or `beta`, for a buffer of
    `buffer` partitions)."""
    if order == "beta":
        return buckets_by_buffer(nparts_lhs, nparts_rhs, buffer, rng)
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
    an uninterrupted one would have. `buffer`: partitions a trainer holds (the `beta`
    order's).

    A trainer may take its next bucket while it still holds the current ones (`acquire`
    with `after`), so that the partitions it lacks are read while they train: they then
    share partitions, which is safe because each of them starts only once the one before
    it has ended, reading what that one wrote.
    """

    def __init__(self, nparts_lhs: int, nparts_rhs: int, order: str, *,
                 lock_lhs: bool = True, lock_rhs: bool = True, seed: int = 0,
                 buffer: int = 2) -> None:
        self.nparts_lhs, self.nparts_rhs = nparts_lhs, nparts_rhs
        self.order = order
        self.lock_lhs, self.lock_rhs = lock_lhs, lock_rhs
        self.seed = seed
        self.buffer = buffer
        self.pending: List[Bucket] = []
        self.active: Set[Bucket] = set()
        self.done: List[Bucket] = []

    def new_pass(self, iteration: int) -> List[Bucket]:
        """Start pass `iteration` (its index in the run): its buckets in order."""
        if self.active:
            raise RuntimeError(f"new pass while buckets {sorted(self.active)} are still held")
        rng = random.Random(f"{self.seed}/{iteration}")
        self.pending = bucket_order(self.order, self.nparts_lhs, self.nparts_rhs, rng,
                                    self.buffer)
        self.done = []
        return list(self.pending)

    def _locked(self, after: Collection[Bucket]) -> Set[int]:
        locked: Set[int] = set()
        for b in self.active - set(after):
            if self.lock_lhs:
                locked.add(b.lhs)
            if self.lock_rhs:
                locked.add(b.rhs)
        return locked

    def acquire(self, after: Collection[Bucket] = ()) -> Optional[Bucket]:
        """The first pending bucket whose partitions are free, or None (either
        none is free now, or the pass is over: see `pass_done`). `after`: held
        buckets of the same trainer, to be trained before the one returned; their
        partitions count as free."""
        locked = self._locked(after)
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


@ray.remote(num_cpus=0)
class BucketSchedulerActor:
    """Hands out buckets (see BucketScheduler above) to the driver's trainers."""

    def __init__(self, nparts_lhs: int, nparts_rhs: int, order: str, lock_lhs: bool,
                 lock_rhs: bool, seed: int, buffer: int = 2) -> None:
        self.scheduler = BucketScheduler(nparts_lhs, nparts_rhs, order, lock_lhs=lock_lhs,
                                         lock_rhs=lock_rhs, seed=seed, buffer=buffer)

    def new_pass(self, iteration: int) -> List[Bucket]:
        return self.scheduler.new_pass(iteration)

    def acquire(self, after: Sequence[Bucket] = ()) -> Optional[Bucket]:
        return self.scheduler.acquire(after)

    def release(self, bucket: Bucket) -> None:
        self.scheduler.release(bucket)

    def fail(self, bucket: Bucket) -> None:
        self.scheduler.fail(bucket)

    def pass_done(self) -> bool:
        return self.scheduler.pass_done()
