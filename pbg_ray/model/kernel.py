"""The CPU kernel: one pass of training (or evaluation) over one edge chunk of a bucket.

PyTorch over numpy arrays the caller owns, with C loops for the row gathers, RowAdagrad
steps (rows.py) and softmax loss (losses.py), and numpy's BLAS for the batched products
(blas.py); under the dot comparator and the softmax loss one C call scores and
differentiates a batch chunk by chunk (losses.dot_softmax_step). Entity partitions and
shared parameters are updated in place (zero-copy views). `num_threads` Hogwild workers
(Python threads, one torch and BLAS thread each, releasing the GIL inside torch ops, BLAS
and the C loops) share the tables, as PBG's Hogwild processes do: the small ops and C
calls of a batch do not scale with intra-op threads, independent batches do. A bucket's
batches and each batch's negatives follow its seed alone, whichever thread trains the
batch, so threads add only Hogwild's races. (A GPU trains by the device step,
model.device_step.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.config import ConfigSchema
from pbg_ray.model.blas import cpu_threads
from pbg_ray.model.embedder import Batch, Embedder, SideBatch
from pbg_ray.model.beyond import BeyondBucket, BeyondRows, RowGradients
from pbg_ray.model.negatives import Negatives, negative_modes, num_uniform, sample_uniform
from pbg_ray.model.optim import adagrad_, row_adagrad_
from pbg_ray.model.params import KnownRows, ModelParams, PartitionKey, partition_key, relation_lr
from pbg_ray.types import Bucket, EdgeList


def edge_batches(config: ConfigSchema, rel: np.ndarray, batch_size: int,
                 rng: Optional[np.random.Generator]) -> List[np.ndarray]:
    """Edge indices of each batch. Per-relation mode: batches of one relation each (PBG
    groups by relation type); dynamic mode: batches mix relations. With an rng, edges and
    batch order are shuffled."""
    order = rng.permutation(len(rel)) if rng is not None else np.arange(len(rel))
    if config.dynamic_relations:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    order = order[np.argsort(rel[order], kind="stable")]
    bounds = np.flatnonzero(np.diff(rel[order])) + 1
    batches = [group[i:i + batch_size]
               for group in np.split(order, bounds) for i in range(0, len(group), batch_size)]
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _take_features(offsets: Tensor, data: Tensor, idx: Tensor) -> Tuple[Tensor, Tensor]:
    """The bags of edges idx: (offsets [B + 1], data [F])."""
    starts, counts = offsets[idx], offsets[idx + 1] - offsets[idx]
    new_offsets = torch.zeros(len(idx) + 1, dtype=torch.long, device=offsets.device)
    torch.cumsum(counts, 0, out=new_offsets[1:])
    within = torch.arange(int(new_offsets[-1]), device=offsets.device) \
        - torch.repeat_interleave(new_offsets[:-1], counts)
    return new_offsets, data[torch.repeat_interleave(starts, counts) + within]


def _take(values: Tensor, rows: np.ndarray) -> Tensor:
    """values[rows] of a CPU tensor, through numpy's indexing: index_select's dispatch
    costs more than the copy of a batch's 1,000 values."""
    return torch.from_numpy(values.numpy()[rows])


class EdgeTensors:
    """An EdgeList as torch tensors on the CPU, sharing its arrays (build_batch indexes
    them through numpy)."""

    def __init__(self, edges: EdgeList) -> None:
        def t(a: Optional[np.ndarray]) -> Optional[Tensor]:
            return None if a is None else torch.as_tensor(a)
        self.lhs, self.rhs, self.rel, self.weight = (
            t(edges.lhs), t(edges.rhs), t(edges.rel),
            None if edges.weight is None else t(np.asarray(edges.weight, np.float32)))
        self.features = {
            "lhs": None if edges.lhs_features is None else
            (t(edges.lhs_features.offsets), t(edges.lhs_features.data)),
            "rhs": None if edges.rhs_features is None else
            (t(edges.rhs_features.offsets), t(edges.rhs_features.data))}


def build_batch(config: ConfigSchema, bucket: Bucket, edges: EdgeTensors, rows: np.ndarray,
                num_batch_negs: int, num_uniform_negs: int, table_sizes: Dict[PartitionKey, int],
                generator: torch.Generator,
                beyond: Optional[Dict[PartitionKey, Optional[BeyondRows]]] = None) -> Batch:
    """A Batch of the edges at `rows` (int64), with its uniform negatives drawn from
    `generator` (and per table the negatives from beyond the bucket its side scores,
    `beyond`)."""
    num_edges = len(rows)
    rel_ids = _take(edges.rel, rows)
    relation = 0 if config.dynamic_relations else int(rel_ids.numpy()[0])
    rconf = config.relations[relation]
    featurized = tuple(config.entities[getattr(rconf, s)].featurized for s in ("lhs", "rhs"))
    chunk_size, modes = negative_modes(
        num_edges, rconf.all_negs, num_batch_negs, num_uniform_negs,
        (config.disable_lhs_negs, config.disable_rhs_negs), featurized)
    num_chunks = -(-num_edges // chunk_size)
    sides = []
    for name, mode, feat, part in zip(("lhs", "rhs"), modes, featurized, bucket):
        entity = getattr(rconf, name)
        key = partition_key(config, entity, part)
        side = SideBatch(key, entity, mode, beyond=(beyond or {}).get(key))
        if feat:
            offsets, data = edges.features[name]
            side.features = _take_features(offsets, data, torch.from_numpy(rows))
        else:
            side.ids = _take(getattr(edges, name), rows)
        if mode is Negatives.ALL:
            side.neg_ids = torch.arange(table_sizes[key]).unsqueeze(0)
        else:
            k = num_uniform(mode, num_uniform_negs, feat)
            if k:
                side.neg_ids = sample_uniform(table_sizes[key], num_chunks, k, generator)
        sides.append(side)
    weight = None if edges.weight is None else _take(edges.weight, rows)
    return Batch(num_edges, chunk_size, relation, rel_ids, sides[0], sides[1], weight)


class KernelState:
    """Torch views of the caller's arrays and the optimizers' settings."""

    def __init__(self, config: ConfigSchema, partitions, params: ModelParams,
                 writable: bool, known: Optional[KnownRows] = None) -> None:
        def view(a: np.ndarray) -> Tensor:
            with warnings.catch_warnings():  # read-only arrays are fine when nothing writes
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
        self.tables = {k: view(e) for k, (e, _) in partitions.items()}
        self.sums = {k: view(s) for k, (_, s) in partitions.items()} if writable else {}
        self.params = {k: view(a) for k, a in params.arrays.items()}
        self.param_sums = {k: view(a) for k, a in params.sums.items()} if writable else {}
        # Rows and parameters init_path trained step at lr * known_scale (incremental runs).
        self.known_rows = {k: known.partitions.get(k, 0) for k in partitions} if known else {}
        self.known_scale = known.lr_scale if known else 1.0
        self.param_scale: Dict[str, Tensor] = {}
        if known and known.lr_scale != 1:
            for name, rows in known.params.items():
                if rows and name in self.params:
                    scale = torch.ones(self.params[name].shape[0])
                    scale[:rows] = known.lr_scale
                    self.param_scale[name] = scale
        self.embedder = Embedder(config, self.tables, self.params, renorm_in_place=writable,
                                 frozen_rows=self.known_rows if self.known_scale == 0 else None)
        self.lr = config.lr
        self.relation_lr = relation_lr(config)


class DrawnRowSums:
    """One Hogwild thread's sums, over its batches, of the gradients of the rows drawn
    from beyond the bucket (per entity type: grads [S, D] and the mean squares [S] that
    RowAdagrad would add for each batch), applied later (model.beyond.RowGradients)."""

    def __init__(self, beyond: Dict[str, BeyondBucket]) -> None:
        self.grads = {e: torch.zeros(d.rows.shape) for e, d in beyond.items()}
        self.squares = {e: torch.zeros(len(d.rows)) for e, d in beyond.items()}

    def add(self, batch: Batch, grads: Dict[str, Tensor]) -> None:
        for name, g in grads.items():
            side = batch.side(name)
            index = torch.from_numpy(side.beyond.index)
            self.grads[side.entity].index_add_(0, index, g)
            self.squares[side.entity].index_add_(0, index, g.square().mean(1))

    @staticmethod
    def gradients(beyond: Dict[str, BeyondBucket], sums: List["DrawnRowSums"]
                  ) -> Dict[PartitionKey, RowGradients]:
        """Per partition the RowGradients of the threads' `sums` together."""
        return {(e, p): g for e, d in beyond.items() for p, g in d.gradients(
                    sum(s.grads[e] for s in sums).numpy(),
                    sum(s.squares[e] for s in sums).numpy()).items()}


def train_batch(state: KernelState, batch: Batch, owners: Dict[PartitionKey, Tensor],
                drawn: Optional[DrawnRowSums] = None) -> Tuple[float, float, int, int]:
    """Forward, backward and optimizer steps of one batch: (loss, reg, violators lhs, rhs);
    the gradients of rows drawn from beyond the bucket are added to `drawn`."""
    grads = state.embedder.backward(batch, state.embedder.forward(batch, fuse=True))
    if drawn is not None:
        drawn.add(batch, grads.beyond)
    for key, (ids, g) in grads.rows.items():
        row_adagrad_(state.tables[key], state.sums[key], ids, g, state.lr, owners[key],
                     state.known_rows.get(key, 0), state.known_scale)
    for name, g in grads.params.items():
        adagrad_(state.params[name], state.param_sums[name], g, state.relation_lr,
                 state.param_scale.get(name))
    return grads.loss, grads.reg, grads.violators["lhs"], grads.violators["rhs"]


class BatchQueue:
    """Batch indices 0..count-1, handed to a bucket's Hogwild threads one at a time, as each
    thread is free (none idles while another still has a share).

    The warm-up is PBG's hogwild_delay: PBG's Hogwild processes other than the first
    sleep that many seconds at each bucket of the first epoch, so the first one trains
    alone meanwhile. Here the other threads wait up to `warmup_s` seconds before their
    first batch, and join at once when the batches run out sooner; the driver decides
    which buckets have one (training.warm_up.HogwildWarmUp)."""

    def __init__(self, count: int, warmup_s: float = 0.0) -> None:
        self.count = count
        self.warmup_s = warmup_s
        self._next = itertools.count()  # next() on it is atomic under the GIL
        self._drained = threading.Event()

    def take(self) -> Optional[int]:
        """The next batch's index, or None once every batch is taken."""
        i = next(self._next)
        if i < self.count:
            return i
        self._drained.set()
        return None

    def join(self) -> None:
        """Wait out the warm-up (threads other than the first, before their first batch)."""
        if self.warmup_s > 0:
            self._drained.wait(self.warmup_s)

    def close(self) -> None:
        """Hand out no more batches (a thread failed: the others stop soon)."""
        self.count = 0
        self._drained.set()


class HogwildThreads:
    """The threads that run a bucket's Hogwild workers other than the caller's, kept for
    the life of the process and grown as a bucket asks for more.

    glibc gives a thread its own malloc arena (the next in turn, up to eight per core,
    shared with Ray's threads), and KERNEL_ENV's trim threshold has each arena keep what
    its batches freed. New threads at every bucket would take arena after arena, each
    then holding a batch's temporaries for good; the same threads reuse their own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._size = 0

    def pool(self, size: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._size < size:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(size, thread_name_prefix="hogwild")
                self._size = size
            return self._pool


_HOGWILD_THREADS = HogwildThreads()


def _run_workers(num_workers: int, queue: BatchQueue, work: Callable[[int], Any]) -> List[Any]:
    """Run work(worker index) on num_workers Hogwild threads taking batches from `queue`:
    worker 0 on the calling thread, the others on HogwildThreads, joining after its
    warm-up. A worker's error stops the others soon (the queue closes) and is raised."""

    def run(i: int) -> Any:
        try:
            if i > 0:
                queue.join()
            return work(i)
        except BaseException:
            queue.close()
            raise

    if num_workers == 1:
        return [work(0)]
    pool = _HOGWILD_THREADS.pool(num_workers - 1)
    others = [pool.submit(run, i) for i in range(1, num_workers)]
    try:
        first = run(0)
    finally:
        wait(others)
    return [first] + [f.result() for f in others]


def train_bucket(config: ConfigSchema, bucket: Bucket, edges: EdgeList,
                 partitions: Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]],
                 params: ModelParams, *, num_threads: int = 1, seed: int = 0,
                 warmup_s: float = 0.0, known: Optional[KnownRows] = None,
                 beyond: Optional[Dict[str, BeyondBucket]] = None) -> Dict[str, Any]:
    """Train one pass over `edges` in batches of config.batch_size, updating the partitions'
    embeddings and row-Adagrad sums and the shared params in place (what `known` names
    at its scaled learning rate). `beyond`: per entity type, the rows drawn from its
    partitions that each side scores as negatives from beyond the bucket.

    `seed` (a non-negative int below 2**64) decides the shuffle of the edges into batches
    and every batch's uniform negatives (batch i draws from seed + 1 + i), whichever
    thread trains it. With `warmup_s` the first thread trains alone for that long before
    the others join (BatchQueue), as PBG's first Hogwild process does in the first epoch.

    Returns PBG's stats layout, metrics summed over batches, with the rate:
    {"count", "metrics": {"loss", "reg", "violators_lhs", "violators_rhs"}, "edges_per_s"},
    and "drawn": per partition the RowGradients of its rows drawn by `beyond`.
    """
    start = time.perf_counter()
    num_workers = max(1, num_threads)
    batches = edge_batches(config, edges.rel, config.batch_size, np.random.default_rng(seed))
    queue = BatchQueue(len(batches), warmup_s)
    state = KernelState(config, partitions, params, writable=True, known=known)
    tensors = EdgeTensors(edges)
    sizes = {k: t.shape[0] for k, t in state.tables.items()}
    beyond = beyond or {}
    beyond_rows = {k: beyond[k[0]].for_side(k[1]) for k in sizes if k[0] in beyond}
    drawn = [DrawnRowSums(beyond) for _ in range(num_workers)] if beyond else None

    def work(worker: int) -> np.ndarray:
        generator = torch.Generator()
        owners = {k: torch.empty(n, dtype=torch.long) for k, n in sizes.items()}
        totals = [0.0] * 4  # (Python floats: a numpy array's += took longer, in the GIL)
        while (i := queue.take()) is not None:
            generator.manual_seed((seed + 1 + i) % 2**64)
            batch = build_batch(config, bucket, tensors, batches[i],
                                config.num_batch_negs, config.num_uniform_negs, sizes, generator,
                                _for_batch(beyond_rows, config.beyond_batch_negs, seed, i))
            result = train_batch(state, batch, owners, drawn[worker] if drawn else None)
            totals = [t + x for t, x in zip(totals, result)]
        return np.array(totals)

    with cpu_threads(1):
        totals = sum(_run_workers(num_workers, queue, work), np.zeros(4))
    elapsed = time.perf_counter() - start
    return {
        "count": len(edges),
        "metrics": {"loss": float(totals[0]), "reg": float(totals[1]),
                    "violators_lhs": int(totals[2]), "violators_rhs": int(totals[3])},
        "edges_per_s": len(edges) / elapsed if elapsed > 0 else 0.0,
        "drawn": DrawnRowSums.gradients(beyond, drawn) if drawn else {},
    }


def _for_batch(beyond: Dict[PartitionKey, Optional[BeyondRows]], count: int, seed: int,
               i: int) -> Dict[PartitionKey, Optional[BeyondRows]]:
    """What batch i of a bucket scores from beyond it: with beyond_batch_negs (`count`) a
    sample of each side's rows drawn from the batch's seed, else all of them."""
    if not count:
        return beyond
    rng = np.random.default_rng((seed, i))
    return {k: r if r is None else r.sample(count, rng) for k, r in beyond.items()}


def _ranks(pos: Tensor, blocks: List[Tensor], valid: Tensor) -> Tensor:
    """1 + the number of negatives scoring at least the positive, for the valid rows [B]."""
    count = sum(torch.ge(blk, pos.unsqueeze(-1), out=torch.empty_like(blk)).sum(-1)
                for blk in blocks)
    return (count + 1)[valid]


@dataclasses.dataclass(frozen=True)
class PartitionRows:
    """A partition that evaluation reads by rows: its row count and `read(offsets)`, the
    embeddings [len(offsets), D] at sorted unique offsets (a checkpoint file's, read alone),
    or with offsets None all of them."""

    size: int
    read: Callable[[Optional[np.ndarray]], np.ndarray]


def _read_named_rows(batches: List[Batch], key: PartitionKey, rows: PartitionRows
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """The (embeddings, zero sums) of the rows of partition `key` that the batches name,
    their ids in the batches renumbered to those rows; every row where a side ranks
    against all of them or is featurized (or where most are named anyway)."""
    sides = [s for b in batches for s in (b.lhs, b.rhs) if s.table == key]
    whole = any(s.mode is Negatives.ALL or s.features is not None for s in sides)
    named = None if whole else torch.unique(torch.cat(
        [t.reshape(-1) for s in sides for t in (s.ids, s.neg_ids) if t is not None]
        or [torch.empty(0, dtype=torch.long)]))
    if named is None or 2 * len(named) > rows.size:
        embeddings = rows.read(None)
    else:
        embeddings = rows.read(named.numpy())
        for s in sides:
            s.ids = torch.searchsorted(named, s.ids)
            if s.neg_ids is not None:
                s.neg_ids = torch.searchsorted(named, s.neg_ids)
    return embeddings, np.zeros(len(embeddings), np.float32)


def evaluate_bucket(config: ConfigSchema, bucket: Bucket, edges: EdgeList,
                    partitions: Dict[PartitionKey, Any], params: ModelParams, *,
                    num_batch_negs: int, num_uniform_negs: int, seed: int = 0) -> Dict[str, Any]:
    """PBG's sampled ranking evaluation against num_batch_negs batch and num_uniform_negs
    uniform negatives per positive, no updates. Metrics are sums over edges, like PBG's
    RankingEvaluator: {"count", "metrics": {"pos_rank", "mrr", "r1", "r10", "r50", "auc"}}.
    partitions: per key, (embeddings, sums), or PartitionRows, of which only the rows the
    batches name (positives and uniform negatives) are read: the batches and their
    negatives are drawn first, from `seed`, then PBG's randomized AUC's samples."""
    tensors = EdgeTensors(edges)
    sizes = {k: p.size if isinstance(p, PartitionRows) else len(p[0])
             for k, p in partitions.items()}
    generator = torch.Generator().manual_seed(seed)
    nbn = num_batch_negs
    batch_size = config.batch_size if nbn == 0 else math.ceil(config.batch_size / nbn) * nbn
    batches = [build_batch(config, bucket, tensors, idx, nbn,
                           num_uniform_negs, sizes, generator)
               for idx in edge_batches(config, edges.rel, batch_size, None)]
    arrays = {k: _read_named_rows(batches, k, p) if isinstance(p, PartitionRows) else p
              for k, p in partitions.items()}
    state = KernelState(config, arrays, params, writable=False)
    totals = dict.fromkeys(("pos_rank", "mrr", "r1", "r10", "r50", "auc"), 0.0)
    for batch in batches:
        scores = state.embedder.forward(batch)
        n, C, B = batch.num_chunks, batch.chunk_size, batch.num_pos
        valid = torch.arange(n * C).view(n, C) < B
        ranks, aucs = [], []
        for side in ("lhs", "rhs"):
            blocks = scores.blocks[side]
            if not sum(blk.shape[-1] for blk in blocks):
                continue
            pos = scores.pos[side]
            ranks.append(_ranks(pos, blocks, valid).float())
            # PBG's randomized AUC: P(random positive > random negative), B samples.
            negs = torch.cat(blocks, dim=-1)[valid].reshape(-1)
            pos_valid = pos[valid]
            pick_pos = torch.randint(len(pos_valid), (B,), generator=generator)
            pick_neg = torch.randint(len(negs), (B,), generator=generator)
            aucs.append(float((pos_valid[pick_pos] > negs[pick_neg]).float().mean()))
        if not ranks:
            continue
        for key, values in (("pos_rank", ranks), ("mrr", [r.reciprocal() for r in ranks]),
                            ("r1", [(r <= 1).float() for r in ranks]),
                            ("r10", [(r <= 10).float() for r in ranks]),
                            ("r50", [(r <= 50).float() for r in ranks])):
            totals[key] += float(np.mean([float(v.sum()) for v in values]))
        totals["auc"] += B * float(np.mean(aucs))
    return {"count": len(edges), "metrics": totals}
