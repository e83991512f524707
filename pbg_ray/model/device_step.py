"""One bucket trained on a device with the host out of the batch loop: the GPU's step (run on
the CPU by the tests).

From a bucket's start to its end its edges, its partitions' rows and row-Adagrad sums
(DeviceTables) and the shared parameters (DeviceParams) live on the device. The edges'
shuffle, the batch order and every batch's negatives are drawn there, by one generator
seeded from the bucket's seed. Loss, regularizer and violator counts accumulate in device
tensors and are read once per bucket; a bucket of several relations reads its batch plan
once more. Shapes are static within a batch kind (the batches of one relation, or all in
dynamic mode): a batch short of edges is padded and its padding masked, so each step is
the same sequence of device operations on tensors of the same shapes, with no value read
back, and a group of full batches can be captured as a CUDA graph and replayed
(_GroupGraph, ray.cuda_graphs).

Layout of a batch. Its n chunks of C edges gather, in one index_select from the bucket's
table of rows (all its partitions, one after the other, and a spare row), these regions:

    A0  the lhs keys:    per chunk its C lhs positives, then U lhs negatives   [n, C + U]
    A1  the rhs keys:    the same on the rhs                                   [n, C + U]
    B0  the queries against A0: the rhs positives                              [n, C]
    B1  the queries against A1: the lhs positives                              [n, C]
    RAW copies of the rows the operator transforms (per-relation mode: A1 and B0, the rhs
        side; dynamic mode: B0 and B1, each with the other side's operator), which it maps
        into their places

so that one batched product of [B0; B1] [2n, C, D] against [A0; A1] [2n, C + U, D] scores
both sides: row i of a chunk scores its positive on the diagonal of the chunk's [C, C] block
(the batch negatives' block) and its negatives in every other column. PBG masks a
positive's score against itself among its batch negatives; here that column holds the
positive, and each loss (losses.Loss.rows) takes it as the row's target. Columns a mode
does not use (no batch negatives under all_negs or num_batch_negs=0, a disabled side, a
padded chunk) are masked as PBG masks them, -1e9; a padding row gets +1e9 on its diagonal,
which zeroes its loss, gradient and violators.

The backward writes the gradients of the keys and queries where they were gathered, the
operator's into RAW, and row Adagrad folds each row's gradients first (PBG's
RowAdagrad sums a row's gradients before their norm): each group of batches sorts its row
ids once (no host read), giving each position the first position of its row, into which
one index_add folds it; the other positions, and the operator's intermediate rows, update
the spare row. Adagrad divides by sqrt(sum), the sums holding 1e-20 more per update than
PBG's (PBG adds 1e-10 to the square root): the same steps to float32 precision, without a
division by zero.

On a GPU the index_add that folds a row's gradients adds in whatever order its atomic adds
land, so the sums of a row that repeats in a batch may differ in their last bits from one
run to the next (as torch's own index_add_ on CUDA); the draws are the same for the same
seed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.config import ConfigSchema
from pbg_ray.model.blas import cpu_threads
from pbg_ray.model.comparators import make_comparator
from pbg_ray.model.losses import LOSS_FUNCTIONS
from pbg_ray.model.negatives import MASKED_SCORE, Negatives, negative_modes, num_uniform
from pbg_ray.model.operators import OPERATORS, Operator
from pbg_ray.model.optim import adagrad_
from pbg_ray.model.params import (KnownRows, ModelParams, PartitionKey, global_emb_key,
                                  operator_key, partition_key, relation_lr)
from pbg_ray.model.regularizers import REGULARIZERS
from pbg_ray.types import Bucket, EdgeList

# Added to a padding row's positive: its loss, gradient and violators are then 0.
PADDING_SCORE = -MASKED_SCORE
# What each update adds to a row's Adagrad sum besides its gradient's (module docstring).
SUM_FLOOR = 1e-20
# Batches whose rows a group sorts at once.
GROUP_BATCHES = 64


@dataclasses.dataclass(frozen=True)
class BatchKind:
    """The shapes shared by a bucket's batches of one relation (per-relation mode) or by
    all of them (dynamic mode): n chunks of C edges, each with U negatives per side."""

    relation: int  # index into config.relations (0 in dynamic mode)
    keys: Tuple[PartitionKey, PartitionKey]  # the lhs and rhs partitions
    modes: Tuple[Negatives, Negatives]
    chunk_size: int
    num_chunks: int
    num_negatives: Tuple[int, int]  # per side: uniform draws per chunk, or its entities

    @property
    def capacity(self) -> int:
        """Edge rows of a batch (its edges and padding)."""
        return self.chunk_size * self.num_chunks

    @property
    def width(self) -> int:
        """Columns of a score row: C batch columns and U = the larger side's negatives."""
        return self.chunk_size + max(self.num_negatives)


@dataclasses.dataclass
class DeviceTables:
    """The bucket's partitions on the device as one table of rows: each key's rows from
    its offset on, then one spare row (the target of updates that must go nowhere)."""

    embeddings: Tensor  # [rows + 1, D]
    sums: Tensor  # [rows + 1], row Adagrad's
    offsets: Dict[PartitionKey, int]
    sizes: Dict[PartitionKey, int]

    @property
    def spare(self) -> int:
        return self.embeddings.shape[0] - 1

    @classmethod
    def join(cls, partitions: Dict[PartitionKey, Tuple[Tensor, Tensor]]) -> "DeviceTables":
        """One table of the partitions (each embeddings [N + 1, D] and sums [N + 1]: its N
        rows, then a spare row): a single one as it is, several copied into one."""
        keys = list(partitions)
        sizes = {k: partitions[k][0].shape[0] - 1 for k in keys}
        if len(keys) == 1:
            embeddings, sums = partitions[keys[0]]
            return cls(embeddings, sums, {keys[0]: 0}, sizes)
        offsets = dict(zip(keys, np.cumsum([0] + [sizes[k] for k in keys[:-1]]).tolist()))
        embeddings = torch.cat([partitions[k][0][:-1] for k in keys] +
                               [partitions[keys[0]][0][-1:]])
        sums = torch.cat([partitions[k][1][:-1] for k in keys] + [partitions[keys[0]][1][-1:]])
        return cls(embeddings, sums, offsets, sizes)

    def split(self, partitions: Dict[PartitionKey, Tuple[Tensor, Tensor]]) -> None:
        """Copy each key's rows back into the tensors `join` took them from."""
        for key, (embs, sums) in partitions.items():
            if embs is self.embeddings:
                continue
            start, size = self.offsets[key], self.sizes[key]
            embs[:size].copy_(self.embeddings[start:start + size])
            sums[:size].copy_(self.sums[start:start + size])


@dataclasses.dataclass
class _ParamBlock:
    """Parameters packed together in DeviceParams.theta: an operator's (per relation and
    side; per relation id in dynamic mode) or a global embedding."""

    names: Tuple[str, ...]  # public names (ModelParams keys), packed in this order
    start: int
    rows: int  # 1, or the relation ids (dynamic mode)
    width: int  # floats per row

    @property
    def size(self) -> int:
        return self.rows * self.width


class DeviceParams:
    """The shared parameters (ModelParams) and their Adagrad sums on the device, packed into
    one vector each: an operator's parameters as its `pack` orders them (per row in dynamic
    mode), global embeddings as they are. One Adagrad step updates them all."""

    def __init__(self, config: ConfigSchema, params: ModelParams, device: torch.device) -> None:
        self.blocks: Dict[str, _ParamBlock] = {}  # by operator_key(rel, side, "") or global key
        start = 0
        for name in _block_order(config):
            names = _block_names(config, name)
            rows = params.arrays[names[0]].shape[0] if config.dynamic_relations and \
                not name.startswith("entities/") else 1
            width = sum(params.arrays[n].size for n in names) // rows
            self.blocks[name] = _ParamBlock(names, start, rows, width)
            start += rows * width
        self.theta = torch.empty(start, dtype=torch.float32)
        self.sums = torch.empty(start, dtype=torch.float32)
        for target, arrays in ((self.theta, params.arrays), (self.sums, params.sums)):
            if start:
                target.copy_(torch.from_numpy(np.concatenate(
                    [self._packed(arrays, b).reshape(-1) for b in self.blocks.values()])))
        self.theta, self.sums = self.theta.to(device), self.sums.to(device)
        self.grad = torch.zeros_like(self.theta)

    @staticmethod
    def _packed(arrays: Dict[str, np.ndarray], block: _ParamBlock) -> np.ndarray:
        return np.concatenate([arrays[n].reshape(block.rows, -1) for n in block.names], axis=1)

    def view(self, tensor: Tensor, name: str) -> Tensor:
        """Block `name` of theta, sums or grad: [width] or [rows, width] (dynamic mode)."""
        b = self.blocks[name]
        flat = tensor[b.start:b.start + b.size]
        return flat if b.rows == 1 else flat.view(b.rows, b.width)

    def write_back(self, params: ModelParams, host: np.ndarray) -> None:
        """Copy theta and the sums, read to the host as `host` (theta then sums), into
        `params`' arrays (in place)."""
        size = self.theta.numel()
        for flat, arrays in ((host[:size], params.arrays), (host[size:], params.sums)):
            for b in self.blocks.values():
                packed = flat[b.start:b.start + b.size].reshape(b.rows, b.width)
                col = 0
                for n in b.names:
                    width = arrays[n].size // b.rows
                    arrays[n][...] = packed[:, col:col + width].reshape(arrays[n].shape)
                    col += width


def _block_order(config: ConfigSchema) -> List[str]:
    """DeviceParams' blocks: operator blocks named operator_key(rel, side, ""), then the
    global embeddings (dynamic mode: the lhs blocks then the rhs blocks, adjacent, so that
    one index reaches a row's parameters on either side)."""
    order = []
    for side in ("lhs", "rhs"):
        for idx, rel in enumerate(config.relations):
            if (config.dynamic_relations or side == "rhs") and OPERATORS.get(
                    rel.operator).param_names:
                order.append(operator_key(idx, side, ""))
    if config.global_emb:
        order += [global_emb_key(e) for e in config.entities]
    return order


def _block_names(config: ConfigSchema, block: str) -> Tuple[str, ...]:
    if block.startswith("entities/"):
        return (block,)
    _, idx, _, side, _ = block.split("/")
    op = OPERATORS.get(config.relations[int(idx)].operator)
    return tuple(operator_key(int(idx), side, d if config.dynamic_relations else n)
                 for n, d in op.param_names)


class _Regions:
    """Row ranges of a batch kind's gathered rows (module docstring)."""

    def __init__(self, kind: BatchKind, dynamic: bool, transforms: bool) -> None:
        n, C, K = kind.num_chunks, kind.chunk_size, kind.width
        a, b = n * K, n * C
        self.A0, self.A1 = slice(0, a), slice(a, 2 * a)
        self.B0, self.B1 = slice(2 * a, 2 * a + b), slice(2 * a + b, 2 * a + 2 * b)
        self.keys, self.queries = slice(0, 2 * a), slice(2 * a, 2 * a + 2 * b)
        self.scored = slice(0, 2 * a + 2 * b)
        # The operator maps RAW into `transformed`.
        self.transformed = (slice(2 * a, 2 * a + 2 * b) if dynamic else slice(a, 2 * a + b)) \
            if transforms else None
        end = 2 * a + 2 * b
        self.raw = slice(end, end + _length(self.transformed)) if transforms else None
        self.rows = end + _length(self.transformed)
        # Rows holding each side's entities as stored (+ global embedding): where the
        # operator maps a region, its RAW copy.
        raw = self.raw
        if not transforms:
            self.lhs_raw, self.rhs_raw = [self.A0, self.B1], [self.A1, self.B0]
            self.lhs_pos, self.rhs_pos = self.B1, self.B0
        elif dynamic:
            rb0 = slice(raw.start, raw.start + b)
            rb1 = slice(raw.start + b, raw.stop)
            self.lhs_raw, self.rhs_raw = [self.A0, rb1], [self.A1, rb0]
            self.lhs_pos, self.rhs_pos = rb1, rb0
        else:
            self.lhs_raw, self.rhs_raw = [self.A0, self.B1], [raw]
            self.lhs_pos, self.rhs_pos = self.B1, slice(raw.start + a, raw.stop)


def _length(s: Optional[slice]) -> int:
    return 0 if s is None else s.stop - s.start


@dataclasses.dataclass
class _Group:
    """Up to GROUP_BATCHES batches of one kind, indexed at once."""

    index: Tensor  # [G, rows] table rows to gather
    update: Tensor  # [G, rows] table rows to update (the spare row where nothing goes)
    fold: Tensor  # [G, rows] where a position's gradient adds (its row's first position;
    # the first position itself adds to the scratch row at the end of the gradients)
    weight: Optional[Tensor]  # [G, capacity] relation x edge weight, 0 on padding
    rel_rows: Optional[Tensor]  # [G, 2 C n] dynamic mode: each query row's parameter row
    own: Optional[Tensor]  # [G, 2 C n] all_negs: flat score index of each row's own entity
    step_scale: Optional[Tensor]  # [G, rows] known rows: their step's scale


class KindStep:
    """The step of one batch kind: its buffers, masks and accumulators, and the math of a
    batch."""

    def __init__(self, trainer: "BucketTrainer", kind: BatchKind) -> None:
        self.t = t = trainer
        self.kind = kind
        config = t.config
        rel = config.relations[kind.relation]
        self.op: Operator = t.operators[kind.relation]
        self.transforms = rel.operator != "none"
        self.regions = r = _Regions(kind, config.dynamic_relations, self.transforms)
        n, C, K = kind.num_chunks, kind.chunk_size, kind.width
        dev = t.device
        self.rows = torch.empty(r.rows, t.dim, device=dev)
        self.grads = torch.zeros(r.rows + 1, t.dim, device=dev)  # and a scratch row
        self.positions = torch.arange(r.rows, device=dev)
        self.loss_sum = torch.zeros(2, n, C, device=dev)
        self.violators = torch.zeros(2, n, C, K, dtype=torch.int32, device=dev)
        # PBG's num_neg per side (masked columns included), for the logistic loss.
        counts = [0 if m is Negatives.NONE else (C if m is Negatives.BATCH_UNIFORM else 0) + u
                  for m, u in zip(kind.modes, kind.num_negatives)]
        self.inv_num_neg = torch.tensor([1 / c if c else 0.0 for c in counts],
                                        device=dev).view(2, 1, 1)
        self.base_mask = self._base_mask()
        self.masks: Dict[int, Optional[Tensor]] = {}  # by a batch's edge count
        self.theta_block = None if config.dynamic_relations or not self.op.param_names else \
            operator_key(kind.relation, "rhs", "")
        self.unit_weights = (t.loss_name != "logistic" and not t.edge_weights
                             and rel.weight == 1)
        # Whether a batch's parameter gradients are written whole (else zeroed first).
        self.zero_param_grads = (config.dynamic_relations or config.global_emb
                                 or t.regularizer is not None
                                 or len(t.params.blocks) != (1 if self.theta_block else 0))

    # --- masks -------------------------------------------------------------

    def _base_mask(self) -> Optional[Tensor]:
        """Columns the kind's modes leave out, -1e9 ([2, 1, C, K]); None if none."""
        kind, C, K = self.kind, self.kind.chunk_size, self.kind.width
        used = [0 if mode is Negatives.NONE else u for mode, u in zip(kind.modes, kind.num_negatives)]
        if all(m is Negatives.BATCH_UNIFORM for m in kind.modes) and min(used) == K - C:
            return None
        mask = torch.zeros(2, 1, C, K)
        off_diagonal = ~torch.eye(C, dtype=torch.bool)
        for s, (mode, u) in enumerate(zip(kind.modes, used)):
            if mode is not Negatives.BATCH_UNIFORM:
                mask[s, 0, :, :C][off_diagonal] = MASKED_SCORE
            mask[s, 0, :, C + u:] = MASKED_SCORE
        return mask.to(self.t.device)

    def mask(self, count: int) -> Optional[Tensor]:
        """The additive mask of a batch of `count` edges ([2, n, C, K], or broadcastable;
        None: no mask)."""
        if count not in self.masks:
            kind, n, C, K = self.kind, self.kind.num_chunks, self.kind.chunk_size, self.kind.width
            if count == kind.capacity:
                self.masks[count] = self.base_mask
            else:
                mask = torch.zeros(2, n, C, K)
                if self.base_mask is not None:
                    mask += self.base_mask.cpu()
                padded = torch.arange(n * C).view(n, C) >= count
                mask[:, :, :, :C] += torch.where(padded.unsqueeze(1), MASKED_SCORE, 0.0)
                mask.diagonal(0, 2, 3).copy_(torch.where(padded, PADDING_SCORE, 0.0))
                self.masks[count] = mask.to(self.t.device)
        return self.masks[count]

    # --- the bucket's batches and a group's index ---------------------------

    def batch_table(self, edges: Dict[str, Tensor], members: Tensor, starts: np.ndarray,
                    counts: np.ndarray) -> "_BatchTable":
        """Per batch of the kind (its edges members[start:start + count], padded with its
        first): table rows [batches, 2, capacity], and weights and relation ids."""
        t, kind, dev = self.t, self.kind, self.t.device
        cap = kind.capacity
        start = torch.from_numpy(starts).to(dev).unsqueeze(1)
        count = torch.from_numpy(counts).to(dev).unsqueeze(1)
        within = torch.arange(cap, device=dev)
        valid = within < count
        rows = members[torch.where(valid, start + within, start)]
        pos = torch.stack([edges["lhs"][rows] + t.tables.offsets[kind.keys[0]],
                           edges["rhs"][rows] + t.tables.offsets[kind.keys[1]]], 1)
        weight = None
        if not self.unit_weights:
            weight = valid.to(torch.float32) * t.config.relations[kind.relation].weight
            if "weight" in edges:
                weight *= edges["weight"][rows]
        rel = edges["rel"][rows] if t.config.dynamic_relations else None
        return _BatchTable(pos, weight, rel)

    def draw_negatives(self, count: int, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
        """Each side's negatives of `count` batches: table rows [count, n, U_side]."""
        t, kind = self.t, self.kind
        out = []
        for mode, key, u in zip(kind.modes, kind.keys, kind.num_negatives):
            start = t.tables.offsets[key]
            if mode is Negatives.ALL:
                ids = torch.arange(start, start + u, device=t.device)
                out.append(ids.expand(count, 1, u))
            else:
                out.append(torch.randint(start, start + t.tables.sizes[key],
                                         (count, kind.num_chunks, u), generator=generator,
                                         device=t.device))
        return out[0], out[1]

    def index_group(self, pos: Tensor, negatives: Tuple[Tensor, Tensor],
                    weight: Optional[Tensor], rel: Optional[Tensor]) -> _Group:
        """The group of batches with table rows pos [G, 2, capacity] (lhs, rhs; padding
        rows any valid row) and negatives per side [G, n, U_side]."""
        t, kind, r = self.t, self.kind, self.regions
        G, n, C, U = pos.shape[0], kind.num_chunks, kind.chunk_size, max(kind.num_negatives)
        lhs_pos, rhs_pos = pos[:, 0].view(G, n, C), pos[:, 1].view(G, n, C)
        keys = [torch.cat([p, _padded(ng, U)], 2) for p, ng in zip((lhs_pos, rhs_pos), negatives)]
        parts = [keys[0], keys[1], rhs_pos, lhs_pos]
        if self.transforms:
            parts += [rhs_pos, lhs_pos] if t.config.dynamic_relations else [keys[1], rhs_pos]
        index = torch.cat([p.reshape(G, -1) for p in parts], 1)
        update = index.clone()
        if r.transformed is not None:
            update[:, r.transformed] = t.tables.spare
        step_scale = None
        if t.known_rows:
            step_scale, frozen = t.known_scales(update)
            update = torch.where(frozen, t.tables.spare, update)
        fold, update = _fold_plan(update, self.positions, t.tables.spare)
        rel_rows = None
        if t.config.dynamic_relations and self.transforms:
            # B0 (rhs positives) take the rhs operator, B1 the lhs one (lhs block first).
            rows_of = t.params.blocks[operator_key(0, "lhs", "")].rows
            rel_rows = torch.cat([rel + rows_of, rel], 1)
        own = self._own_entities(lhs_pos, rhs_pos) if Negatives.ALL in kind.modes else None
        return _Group(index, update, fold, weight, rel_rows, own, step_scale)

    def _own_entities(self, lhs_pos: Tensor, rhs_pos: Tensor) -> Tensor:
        """all_negs: each row's flat index in the scores [2, n, C, K] of its own entity
        among its side's negatives (PBG masks it)."""
        kind, t = self.kind, self.t
        n, C, K = kind.num_chunks, kind.chunk_size, kind.width
        rows = torch.arange(n * C, device=t.device)
        own = [(s * n * C + rows) * K + C + ids.reshape(ids.shape[0], -1) - t.tables.offsets[key]
               for s, (ids, key) in enumerate(zip((lhs_pos, rhs_pos), kind.keys))]
        return torch.cat(own, 1)

    # --- one batch ---------------------------------------------------------

    def step(self, group: _Group, j: int, count: int) -> None:
        """Train batch j of `group`, of `count` edges."""
        t, kind, r = self.t, self.kind, self.regions
        n, C, K, D = kind.num_chunks, kind.chunk_size, kind.width, t.dim
        tables, params = t.tables, t.params
        x = torch.index_select(tables.embeddings, 0, group.index[j], out=self.rows)
        if t.config.max_norm is not None:
            self._renorm(x, group.index[j], group.update[j] if t.known_rows else None)
        if t.config.global_emb:
            for side, regions in (("lhs", r.lhs_raw), ("rhs", r.rhs_raw)):
                g = params.view(params.theta, global_emb_key(self._entity(side)))
                for region in regions:
                    x[region] += g
        theta = expanded = None
        if self.transforms:
            theta = self._theta(group, j)
            expanded = self.op.expand(theta)
            self.op.apply(x[r.raw], theta, out=x[r.transformed], expanded=expanded)
        scored, ctx = x[r.scored], None
        if t.prepares:
            scored, ctx = t.comparator.prepare(scored)
        queries = scored[r.queries].view(2 * n, C, D)
        keys = scored[r.keys].view(2 * n, K, D)
        scores = t.comparator.matrix(queries, keys).view(2, n, C, K)
        mask = self.mask(count)
        if mask is not None:
            scores += mask
        if group.own is not None:
            scores.view(-1).index_fill_(0, group.own[j], MASKED_SCORE)
        self.violators.add_(scores > scores.diagonal(0, 2, 3).unsqueeze(-1))
        weight = None if self.unit_weights else group.weight[j].view(1, n, C)
        grad_scores = t.loss.rows(scores, weight, self.inv_num_neg, self.loss_sum)
        grads = self.grads
        t.comparator.matrix_backward(
            queries, keys, scores.view(2 * n, C, K), grad_scores.view(2 * n, C, K),
            out=(grads[r.queries].view(2 * n, C, D), grads[r.keys].view(2 * n, K, D)))
        if ctx is not None:
            grads[r.scored] = t.comparator.prepare_backward(ctx, grads[r.scored])
        if self.zero_param_grads:
            params.grad.zero_()
        if self.transforms:
            self._operator_backward(group, j, x, theta, expanded)
        if t.regularizer is not None:
            self._regularize(group, j, x, count)
        if t.config.global_emb:
            for side, regions in (("lhs", r.lhs_raw), ("rhs", r.rhs_raw)):
                g = params.view(params.grad, global_emb_key(self._entity(side)))
                for region in regions:
                    g += grads[region].sum(0)
        if params.theta.numel():
            adagrad_(params.theta, params.sums, params.grad, t.relation_lr, t.param_scale)
        self._row_adagrad(group, j)

    def _entity(self, side: str) -> str:
        return getattr(self.t.config.relations[self.kind.relation], side)

    def _theta(self, group: _Group, j: int) -> Tensor:
        params = self.t.params
        if not self.t.config.dynamic_relations:
            return params.view(params.theta, self.theta_block)
        return self._dynamic(params.theta).index_select(0, group.rel_rows[j])

    def _dynamic(self, tensor: Tensor) -> Tensor:
        """Dynamic mode: the lhs and rhs operator blocks of DeviceParams' `tensor` (theta or
        grad), adjacent: [2 relation ids, P]."""
        params = self.t.params
        lhs, rhs = (params.blocks[operator_key(0, s, "")] for s in ("lhs", "rhs"))
        return tensor[lhs.start:rhs.start + rhs.size].view(-1, self.op.packed_size)

    def _operator_backward(self, group: _Group, j: int, x: Tensor, theta: Tensor,
                           expanded: Tensor) -> None:
        r, params, grads = self.regions, self.t.params, self.grads
        if not self.t.config.dynamic_relations:
            self.op.apply_backward(
                x[r.raw], theta, grads[r.transformed], dx_out=grads[r.raw],
                dtheta_out=params.view(params.grad, self.theta_block) if self.theta_block
                else None, expanded=expanded)
            return
        _, dtheta = self.op.apply_backward(x[r.raw], theta, grads[r.transformed],
                                           dx_out=grads[r.raw], expanded=expanded)
        self._dynamic(params.grad).index_add_(0, group.rel_rows[j], dtheta)

    def _regularize(self, group: _Group, j: int, x: Tensor, count: int) -> None:
        """N3 on the positives of both sides and the operator parameters they use."""
        t, r, params = self.t, self.regions, self.t.params
        n, C = self.kind.num_chunks, self.kind.chunk_size
        valid = (torch.arange(n * C, device=t.device) < count).to(x.dtype).unsqueeze(1)
        for region in (r.lhs_pos, r.rhs_pos):
            value, grad = t.regularizer.embeddings(x[region] * valid, self.op)
            t.reg_sum.add_(value)
            self.grads[region] += grad
        if self.op.reg_params is None or not self.op.param_names:
            return
        if not t.config.dynamic_relations:
            value, grads = t.regularizer.params(
                self.op.unpack(params.view(params.theta, self.theta_block)), self.op, count)
            t.reg_sum.add_(value)
            dtheta = self.op.unpack(params.view(params.grad, self.theta_block))
            for name, g in grads.items():
                dtheta[name] += g
            return
        theta = self._theta(group, j) * valid.repeat(2, 1)  # B0's rows, then B1's
        value, grads = t.regularizer.params(self.op.unpack(theta), self.op, 1)
        t.reg_sum.add_(value)
        dtheta = torch.zeros_like(theta)
        unpacked = self.op.unpack(dtheta)
        for name, g in grads.items():
            unpacked[name] += g
        self._dynamic(params.grad).index_add_(0, group.rel_rows[j], dtheta)

    def _renorm(self, x: Tensor, index: Tensor, update: Optional[Tensor]) -> None:
        """PBG's max_norm: rows above it scaled to it, in the batch and in the table (not
        the rows an incremental run froze)."""
        max_norm, spare = self.t.config.max_norm, self.t.tables.spare
        norms = x.norm(dim=1)
        x.mul_(torch.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0).unsqueeze(1))
        target = index if update is None else torch.where(update == spare, spare, index)
        self.t.tables.embeddings.index_copy_(0, target, x)

    def _row_adagrad(self, group: _Group, j: int) -> None:
        """Row Adagrad of the batch's rows (PBG's RowAdagrad; module docstring)."""
        t, tables = self.t, self.t.tables
        # Each position's gradient, and at a row's first position the others' added.
        rows = self.regions.rows
        folded = torch.index_add(self.grads, 0, group.fold[j], self.grads[:rows])[:rows]
        update = group.update[j]
        square = torch.baddbmm(t.sum_floor, folded.unsqueeze(1), folded.unsqueeze(2))
        tables.sums.index_add_(0, update, square.view(-1), alpha=1 / t.dim)
        scale = tables.sums.index_select(0, update).rsqrt_()
        if group.step_scale is not None:
            scale.mul_(group.step_scale[j])
        folded.mul_(scale.unsqueeze(1))
        tables.embeddings.index_add_(0, update, folded, alpha=-t.lr)


def _padded(negatives: Tensor, width: int) -> Tensor:
    """negatives [G, n, u] padded to [G, n, width] with the table's row 0 (masked)."""
    if negatives.shape[2] == width:
        return negatives
    pad = negatives.new_zeros(*negatives.shape[:2], width - negatives.shape[2])
    return torch.cat([negatives, pad], 2)


@dataclasses.dataclass
class _BatchTable:
    """A kind's batches as the bucket drew them: table rows [batches, 2, capacity], and
    weights and relation ids [batches, capacity] where the step uses them."""

    pos: Tensor
    weight: Optional[Tensor]
    rel: Optional[Tensor]


class _KindCursor:
    """A kind's batches in the drawn order, indexed a group at a time; with `graph`, each
    group of GROUP_BATCHES full batches runs as one captured CUDA graph."""

    def __init__(self, step: KindStep, table: _BatchTable, sequence: Tensor,
                 counts: List[int], generator: torch.Generator,
                 graph: Optional["_GroupGraph"] = None) -> None:
        self.step_, self.table, self.sequence = step, table, sequence
        self.counts = counts  # each batch's edges, in order
        self.generator = generator
        self.graph = graph
        self.done = 0
        self.group: Optional[_Group] = None
        self.group_start = 0

    def _next_group(self) -> _Group:
        ids = self.sequence[self.done:self.done + GROUP_BATCHES]
        tab = self.table
        self.group_start = self.done
        return self.step_.index_group(
            tab.pos.index_select(0, ids), self.step_.draw_negatives(ids.shape[0], self.generator),
            None if tab.weight is None else tab.weight.index_select(0, ids),
            None if tab.rel is None else tab.rel.index_select(0, ids))

    def next(self) -> None:
        """Train the kind's next batch."""
        j = self.done - self.group_start
        if self.group is None or j == self.group.index.shape[0]:
            self.group, j = self._next_group(), 0
        self.step_.step(self.group, j, self.counts[self.done])
        self.done += 1

    def run(self) -> None:
        """Train all of the kind's batches (the bucket's only kind)."""
        capacity = self.step_.kind.capacity
        while self.done < len(self.counts):
            counts = self.counts[self.done:self.done + GROUP_BATCHES]
            if self.graph is not None and len(counts) == GROUP_BATCHES and min(counts) == capacity:
                self.graph.run(self._next_group())
                self.done += GROUP_BATCHES
            else:
                self.next()


class _GroupGraph:
    """A kind's group of GROUP_BATCHES full batches as one CUDA graph: the first group runs
    as it is, on a side stream (first uses of cuBLAS and the allocator stay out of the
    graph), the second is captured, then every group is copied into the inputs the graph
    reads and the graph replayed: one launch where the group's kernels were one each."""

    def __init__(self, step: KindStep) -> None:
        self.step = step
        self.inputs: Optional[_Group] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.warm = False

    def _steps(self) -> None:
        for j in range(GROUP_BATCHES):
            self.step.step(self.inputs, j, self.step.kind.capacity)

    def run(self, group: _Group) -> None:
        if self.inputs is None:
            self.inputs = group
        else:
            for name, tensor in dataclasses.asdict(group).items():
                if tensor is not None:
                    getattr(self.inputs, name).copy_(tensor)
        if not self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._steps()
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._steps()
        self.graph.replay()


def _fold_plan(update: Tensor, positions: Tensor, spare: int) -> Tuple[Tensor, Tensor]:
    """For rows update [G, M] (M positions, of which positions [M] are the indices): (where
    each position's gradient adds: its row's first position, or for that first position
    M, a scratch row; the rows to update: each row at its first position, the spare row
    elsewhere), by one sort."""
    ordered, order = torch.sort(update, dim=1, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    torch.ne(ordered[:, 1:], ordered[:, :-1], out=starts[:, 1:])
    run_start = torch.where(starts, positions, 0).cummax(1).values
    first = torch.empty_like(order).scatter_(1, order, order.gather(1, run_start))
    is_first = first == positions
    return torch.where(is_first, len(positions), first), torch.where(is_first, update, spare)


class BucketTrainer:
    """A bucket's training on a device: its kinds' steps over DeviceTables and DeviceParams."""

    def __init__(self, config: ConfigSchema, bucket: Bucket, tables: DeviceTables,
                 params: DeviceParams, known: Optional[KnownRows] = None,
                 cuda_graphs: bool = False) -> None:
        self.config, self.bucket, self.tables, self.params = config, bucket, tables, params
        # Replay full groups of a one-kind bucket as captured CUDA graphs (_GroupGraph).
        self.cuda_graphs = cuda_graphs
        self.device = tables.embeddings.device
        self.dim = tables.embeddings.shape[1]
        self.lr = config.lr
        self.relation_lr = relation_lr(config)
        self.operators = [OPERATORS.get(r.operator)(config.entity_dimension(r.rhs))
                          for r in config.relations]
        self.comparator = make_comparator(config.comparator, config.bias, for_device=True)
        self.prepares = config.comparator == "cos"
        self.loss_name = config.loss_fn
        self.loss = LOSS_FUNCTIONS.get(config.loss_fn)(config.margin)
        self.regularizer = (REGULARIZERS.get(config.regularizer)(config.regularization_coef)
                            if config.regularization_coef > 0 else None)
        self.edge_weights = False
        self.sum_floor = torch.full((1, 1, 1), SUM_FLOOR, device=self.device)
        self.known_rows = {k: rows for k in tables.offsets
                           if known and (rows := known.partitions.get(k, 0))}
        self.known_scale = known.lr_scale if known else 1.0
        self.param_scale = self._param_scale(known)
        self.reg_sum = torch.zeros((), device=self.device)

    def _param_scale(self, known: Optional[KnownRows]) -> Optional[Tensor]:
        """A learning-rate scale per element of DeviceParams.theta where an incremental run
        trains known relation ids at their own rate (dynamic mode), else None."""
        if known is None or known.lr_scale == 1 or not any(known.params.values()):
            return None
        scale = torch.ones_like(self.params.theta)
        for name, rows in known.params.items():
            for block_name, block in self.params.blocks.items():
                if rows and name in block.names and block.rows > 1:
                    self.params.view(scale, block_name)[:rows] = known.lr_scale
        return scale

    def known_scales(self, update: Tensor) -> Tuple[Tensor, Tensor]:
        """Per table row in update [G, M]: (its step's scale, whether it is frozen)."""
        known = torch.zeros_like(update, dtype=torch.bool)
        for key, rows in self.known_rows.items():
            start = self.tables.offsets[key]
            known |= (update >= start) & (update < start + rows)
        frozen = known if self.known_scale == 0 else torch.zeros_like(known)
        return torch.where(known, self.known_scale, 1.0).to(torch.float32), frozen

    def kinds(self, edges: EdgeList) -> List[Tuple[BatchKind, np.ndarray]]:
        """The bucket's batch kinds, each with its edges' indices (per-relation mode: a
        relation's; dynamic mode: all)."""
        config, B = self.config, self.config.batch_size
        groups = [(0, np.arange(len(edges)))] if config.dynamic_relations else \
            [(r, np.flatnonzero(edges.rel == r)) for r in np.unique(edges.rel).tolist()]
        out = []
        for relation, members in groups:
            rconf = config.relations[relation]
            keys = tuple(partition_key(config, getattr(rconf, side), part)
                         for side, part in zip(("lhs", "rhs"), self.bucket))
            chunk, modes = negative_modes(
                B, rconf.all_negs, config.num_batch_negs, config.num_uniform_negs,
                (config.disable_lhs_negs, config.disable_rhs_negs), (False, False))
            negatives = tuple(self.tables.sizes[key] if mode is Negatives.ALL else
                              num_uniform(mode, config.num_uniform_negs, False)
                              for mode, key in zip(modes, keys))
            out.append((BatchKind(relation, keys, modes, chunk, -(-B // chunk), negatives),
                        members))
        return out

    def train(self, edges: EdgeList, seed: int) -> Tensor:
        """Train one pass over `edges`: its stats on the device (read_back reads them). On
        the CPU on one thread: a batch's small operations slow down on several (each waits
        for the others), as the CPU kernel's Hogwild workers run one each."""
        if self.device.type != "cpu":
            return self._train(edges, seed)
        with cpu_threads(1):
            return self._train(edges, seed)

    def _train(self, edges: EdgeList, seed: int) -> Tensor:
        dev = self.device
        self.edge_weights = edges.weight is not None
        generator = torch.Generator(device=dev).manual_seed(seed % 2 ** 64)
        on_device = _upload_edges(edges, dev)
        steps, batches = [], []  # per kind: its step and its batches (start, count)
        for kind, members in self.kinds(edges):
            steps.append(KindStep(self, kind))
            starts = np.arange(0, len(members), self.config.batch_size)
            batches.append((members, starts, np.minimum(self.config.batch_size,
                                                        len(members) - starts)))
        # Each kind's edges shuffled, then the batch order: drawn on the device. A bucket of
        # one kind runs its short batch (if any) last, so the host needs no plan; one of
        # several kinds reads the order once.
        tables = []
        for step, (members, starts, counts) in zip(steps, batches):
            perm = torch.randperm(len(members), generator=generator, device=dev)
            shuffled = torch.from_numpy(members).to(dev)[perm]
            tables.append(step.batch_table(on_device, shuffled, starts, counts))
        if len(steps) == 1:  # (its batches' counts are in that order too: the short one last)
            (step,), (table,), ((_, _, counts),) = steps, tables, batches
            full = int((counts == self.config.batch_size).sum())
            order = torch.cat([torch.randperm(full, generator=generator, device=dev),
                               torch.arange(full, len(counts), device=dev)])
            graph = _GroupGraph(step) if self.cuda_graphs else None
            _KindCursor(step, table, order, counts.tolist(), generator, graph).run()
            return self._stats(steps)
        num_batches = sum(len(b[1]) for b in batches)
        order = torch.randperm(num_batches, generator=generator, device=dev).tolist()
        kind_of = np.repeat(np.arange(len(steps)), [len(b[1]) for b in batches])
        first_of = np.cumsum([0] + [len(b[1]) for b in batches])
        cursors = []
        for k, (step, table, (_, _, counts)) in enumerate(zip(steps, tables, batches)):
            mine = [b - first_of[k] for b in order if kind_of[b] == k]
            cursors.append(_KindCursor(step, table, torch.tensor(mine, device=dev),
                                       counts[mine].tolist(), generator))
        for b in order:
            cursors[kind_of[b]].next()
        return self._stats(steps)

    def _stats(self, steps: Sequence["KindStep"]) -> Tensor:
        """The stats summed over the kinds: [loss, reg, violators lhs, rhs], on the device."""
        zero = torch.zeros((), device=self.device)
        return torch.stack([
            sum((s.loss_sum.sum() for s in steps), zero), self.reg_sum,
            sum((s.violators[0].sum() for s in steps), zero),
            sum((s.violators[1].sum() for s in steps), zero)])


def read_back(stats: Tensor, shared: DeviceParams, params: ModelParams) -> Dict[str, float]:
    """BucketTrainer.train's stats and the shared parameters (into `params`' arrays), read
    from the device in one copy: PBG's stats sums."""
    host = torch.cat([stats, shared.theta, shared.sums]).cpu().numpy()
    shared.write_back(params, host[4:])
    return {"loss": float(host[0]), "reg": float(host[1]), "violators_lhs": int(host[2]),
            "violators_rhs": int(host[3])}


def _upload_edges(edges: EdgeList, device: torch.device) -> Dict[str, Tensor]:
    """The bucket's edges on the device (one copy each)."""
    out = {name: torch.from_numpy(np.ascontiguousarray(getattr(edges, name), np.int64)).to(device)
           for name in ("lhs", "rhs", "rel")}
    if edges.weight is not None:
        out["weight"] = torch.from_numpy(np.asarray(edges.weight, np.float32)).to(device)
    return out


def train_bucket_on_device(config: ConfigSchema, bucket: Bucket, edges: EdgeList,
                           partitions: Dict[PartitionKey, Tuple[np.ndarray, np.ndarray]],
                           params: ModelParams, *, device: str = "cuda", seed: int = 0,
                           known: Optional[KnownRows] = None,
                           cuda_graphs: bool = False) -> Dict[str, object]:
    """kernel.train_bucket's contract on `device`: the arrays copied there, one pass over
    `edges` trained by BucketTrainer (with `cuda_graphs`, full groups replayed as CUDA
    graphs), the arrays updated in place. Returns PBG's stats layout with the rate and
    the seconds of copies to the device and back."""
    start = time.perf_counter()
    dev = torch.device(device)
    on_device = {k: with_spare_row(e, s, dev) for k, (e, s) in partitions.items()}
    tables = DeviceTables.join(on_device)
    shared = DeviceParams(config, params, dev)
    copy_s = _synchronized(dev) - start
    stats = BucketTrainer(config, bucket, tables, shared, known, cuda_graphs).train(edges, seed)
    copy_start = _synchronized(dev)
    metrics = read_back(stats, shared, params)
    tables.split(on_device)
    for key, (embs, sums) in partitions.items():
        torch.from_numpy(embs).copy_(on_device[key][0][:-1])
        torch.from_numpy(sums).copy_(on_device[key][1][:-1])
    copy_s += _synchronized(dev) - copy_start
    elapsed = time.perf_counter() - start
    return {"count": len(edges), "metrics": metrics,
            "edges_per_s": len(edges) / elapsed if elapsed > 0 else 0.0,
            "device_copy_s": copy_s}


def with_spare_row(embeddings: np.ndarray, sums: np.ndarray, device: torch.device
                   ) -> Tuple[Tensor, Tensor]:
    """A partition on `device` as DeviceTables takes it: its rows, then a spare row."""
    e = torch.empty(len(embeddings) + 1, embeddings.shape[1], device=device)
    s = torch.zeros(len(sums) + 1, device=device)
    e[:-1].copy_(torch.from_numpy(embeddings))
    s[:-1].copy_(torch.from_numpy(sums))
    return e, s


def _synchronized(device: torch.device) -> float:
    """time.perf_counter() once the device's queued work is done (a GPU runs behind)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
