"""Scores, loss and gradients of one batch: PBG's MultiRelationEmbedder with a hand-written
backward.

Layout. Each side's rows live in one buffer [chunks, C + K, D]: the chunk's C positives
(padded) followed by its K uniform negatives (or the whole partition under all_negs), so
one gather per table fills it and whole-batch bmm's score every chunk at once.

Per-relation mode (PBG: the relation's operator applies to the rhs only) scores
  pos_i = c(u_i, v_i)            u = prep(lhs + global), v = prep(op(rhs + global))
  rhs negatives: M[i, j] = c(u_i, v_j) over the chunk's v's and the rhs uniform draws
  lhs negatives: c(v_i, u_j); the batch part is M[:, :, :C] transposed (computed once),
                 the uniform part its own bmm.
Dynamic mode (one lhs and one rhs operator per relation id) scores the lhs side with
c(u, prep(op_rhs(rhs))) and the rhs side with c(prep(op_lhs(lhs)), v), v = prep(rhs), so
each side has its own matrix, and no global embeddings.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from pbg_ray.config import ConfigSchema
from pbg_ray.model.comparators import DotComparator, make_comparator
from pbg_ray.model.losses import (LOSS_FUNCTIONS, SoftmaxLoss, count_violators,
                                   dot_softmax_ready, dot_softmax_step)
from pbg_ray.model.beyond import BeyondRows
from pbg_ray.model.negatives import Negatives, mask_batch_block, mask_own_ids
from pbg_ray.model.operators import OPERATORS, Operator, StepOperator
from pbg_ray.model.params import PartitionKey, global_emb_key, operator_key
from pbg_ray.model.regularizers import REGULARIZERS
from pbg_ray.model.rows import gather_rows
from pbg_ray.types import SIDES



def _dim_order(t: Tensor) -> List[int]:
    """t's dimensions from the outermost in memory to the innermost."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


class _Workspace(threading.local):
    """Per-thread buffers reused batch after batch for score-sized temporaries: fresh
    multi-MB allocations each batch cost page faults and cold caches. (Also what else a
    thread's batches reuse: the loss weights, the step's operators.)"""

    def __init__(self) -> None:
        self.buffers: Dict[Any, Any] = {}

    def get(self, key: Any, like: Tensor, shape: Optional[Tuple[int, ...]] = None) -> Tensor:
        """A buffer of like's dtype and device: contiguous of `shape`, or by default of like's
        shape and dimension order. (A transposed block gets a transposed buffer, so that
        elementwise ops between them run in memory order: across it, every access is a
        strided one that misses the cache.)"""
        buf = self.buffers.get(key)
        if shape is None:
            if buf is None or buf.shape != like.shape or buf.device != like.device \
                    or _dim_order(buf) != _dim_order(like):
                buf = self.buffers[key] = torch.empty_like(like)
            return buf
        if buf is None or buf.shape != shape or buf.device != like.device:
            buf = self.buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def scores(self, key: Any, q: Tensor, k: Tensor) -> Tensor:
        """The output buffer of an all-pairs score matrix of q [n, P, D] and k [n, N, D]:
        on the CPU laid [n, N, P] in memory (a transposed view), into which blas.bmm runs
        BLAS's fastest form; the loss and the violators count walk either layout."""
        n, p, m = q.shape[0], q.shape[1], k.shape[1]
        if q.device.type != "cpu":
            return self.get(("scores", key), q, (n, p, m))
        return self.get(("scores", key), q, (n, m, p)).transpose(1, 2)


@dataclasses.dataclass
class SideBatch:
    """One side of a batch. ids [B] entity ids, or for featurized types `features` =
    (offsets [B + 1], data [F]); neg_ids [chunks, K] uniform ids ([1, N] under ALL);
    `beyond`: negatives from beyond the bucket (model.beyond.BeyondRows), scored against
    every edge of the batch (their gradients in Gradients.beyond)."""

    table: PartitionKey
    entity: str
    mode: Negatives
    ids: Optional[Tensor] = None
    features: Optional[Tuple[Tensor, Tensor]] = None
    neg_ids: Optional[Tensor] = None
    beyond: Optional[BeyondRows] = None

    @property
    def has_batch(self) -> bool:
        return self.mode is Negatives.BATCH_UNIFORM

    @property
    def num_neg_ids(self) -> int:
        return 0 if self.neg_ids is None else self.neg_ids.shape[1]


@dataclasses.dataclass
class Batch:
    """Edges of one relation (per-relation mode) or of any relations (dynamic mode)."""

    num_pos: int
    chunk_size: int
    relation: int            # index into config.relations
    rel_ids: Tensor          # [B] relation ids (all == relation in per-relation mode)
    lhs: SideBatch
    rhs: SideBatch
    weight: Optional[Tensor] = None  # [B] per-edge weights

    @property
    def num_chunks(self) -> int:
        return -(-self.num_pos // self.chunk_size)

    @property
    def last_chunk_size(self) -> int:
        return self.num_pos - (self.num_chunks - 1) * self.chunk_size

    def side(self, name: str) -> SideBatch:
        return self.lhs if name == "lhs" else self.rhs


@dataclasses.dataclass
class Scores:
    """Forward results. pos/blocks per side: pos [chunks, C], blocks [chunks, C, N_k]
    (rows past num_pos are padding); `saved` holds what the backward needs."""

    pos: Dict[str, Tensor]
    blocks: Dict[str, List[Tensor]]
    saved: Dict[str, Any]


@dataclasses.dataclass
class Gradients:
    """Backward results; the tensors are valid until the thread's next backward (they
    live in its workspace)."""

    loss: float
    reg: float
    violators: Dict[str, int]
    rows: Dict[PartitionKey, Tuple[Tensor, Tensor]]  # table -> (row ids [n], grads [n, D])
    params: Dict[str, Tensor]                         # public name -> gradient
    # side -> gradients [S, D] of the rows it scored from beyond the bucket (SideBatch.beyond)
    beyond: Dict[str, Tensor] = dataclasses.field(default_factory=dict)


class Embedder:
    """The model of one training/eval run over torch tensors (updated by the caller's
    optimizer steps).

    tables: (entity, partition) -> embeddings [N, D]; params: public name -> tensor.
    """

    def __init__(self, config: ConfigSchema, tables: Dict[PartitionKey, Tensor],
                 params: Dict[str, Tensor], renorm_in_place: bool = True,
                 frozen_rows: Optional[Dict[PartitionKey, int]] = None) -> None:
        self.config = config
        # PBG's max_norm renormalizes looked-up rows in the table itself (training);
        # evaluation leaves the (possibly read-only) tables alone, and so does training
        # for the first frozen_rows[table] rows (frozen by pbg_ray.incremental).
        self.renorm_in_place = renorm_in_place
        self.frozen_rows = frozen_rows or {}
        self.tables = tables
        self.params = params
        self.comparator = make_comparator(config.comparator, config.bias)
        self.loss_fn = LOSS_FUNCTIONS.get(config.loss_fn)(config.margin)
        self.regularizer = (REGULARIZERS.get(config.regularizer)(config.regularization_coef)
                            if config.regularization_coef > 0 else None)
        self.dynamic = config.dynamic_relations
        self.workspace = _Workspace()
        self.operators: List[Operator] = [
            OPERATORS.get(r.operator)(config.entity_dimension(r.rhs)) for r in config.relations]

    # --- parameters ---------------------------------------------------------

    def _op_params(self, batch: Batch, side: str, rows: Optional[Tensor]) -> Dict[str, Tensor]:
        """The batch's operator parameters for `side`: the relation's own set, or (dynamic)
        the set of each row's relation id."""
        op = self.operators[batch.relation]
        if self.dynamic:
            return {n: self.params[operator_key(0, side, d)].index_select(0, rows)
                    for n, d in op.param_names}
        return {n: self.params[operator_key(batch.relation, side, n)] for n, _ in op.param_names}

    def _add_op_grads(self, grads: Dict[str, Tensor], batch: Batch, side: str,
                      dp: Dict[str, Tensor], rows: Optional[Tensor]) -> None:
        op = self.operators[batch.relation]
        for n, d in op.param_names:
            if self.dynamic:
                key = operator_key(0, side, d)
                g = grads.setdefault(key, torch.zeros_like(self.params[key]))
                g.index_add_(0, rows, dp[n])
            else:
                key = operator_key(batch.relation, side, n)
                grads[key] = grads[key] + dp[n] if key in grads else dp[n]

    # --- forward ------------------------------------------------------------

    def _layout(self, batch: Batch) -> Dict[str, Tensor]:
        """Per side, the table rows its buffer holds: [chunks, C + K] ids (padding rows
        point at row 0 and are zeroed later), or the feature ids [F] of a featurized side."""
        C, n = batch.chunk_size, batch.num_chunks
        index: Dict[str, Tensor] = {}
        for name in SIDES:
            s = batch.side(name)
            if s.features is not None:
                index[name] = s.features[1]
                continue
            pos = s.ids
            if batch.num_pos < n * C:
                pos = s.ids.new_zeros(n * C)
                pos[:batch.num_pos] = s.ids
            index[name] = pos.view(n, C) if s.neg_ids is None else \
                torch.cat([pos.view(n, C), s.neg_ids], dim=1)
        return index

    def _gather(self, batch: Batch, index: Dict[str, Tensor]
                ) -> Tuple[List[Tuple[PartitionKey, Tensor, Tensor]], Dict[str, Tuple[int, slice]]]:
        """One gather per table (lhs and rhs share it when they use the same partition).

        Returns the groups (table, row ids [n], rows [n, D]) and, per side, (group, slice
        of the group's rows). Applies PBG's max_norm renormalization to the gathered rows,
        and (training) to the table, as F.embedding(max_norm=...) does."""
        same = batch.lhs.table == batch.rhs.table
        groups = []
        where: Dict[str, Tuple[int, slice]] = {}
        for group in ([SIDES] if same else [("lhs",), ("rhs",)]):
            key = batch.side(group[0]).table
            table = self.tables[key]
            flat = torch.cat([index[g].reshape(-1) for g in group]) if len(group) > 1 \
                else index[group[0]].reshape(-1)
            gathered = gather_rows(table, flat, self.workspace.get(
                ("rows", key), table, (flat.numel(), table.shape[1])))
            if self.config.max_norm is not None:
                norms = gathered.norm(dim=1)
                over = (norms > self.config.max_norm).nonzero().squeeze(1)
                if over.numel():
                    gathered[over] *= (self.config.max_norm / (norms[over] + 1e-7)).unsqueeze(1)
                    if self.renorm_in_place:
                        if self.frozen_rows.get(key):
                            over = over[flat[over] >= self.frozen_rows[key]]
                        table[flat[over]] = gathered[over]
            offset = 0
            for g in group:
                size = index[g].numel()
                where[g] = (len(groups), slice(offset, offset + size))
                offset += size
            groups.append((key, flat, gathered))
        return groups, where

    def _side_buffer(self, batch: Batch, name: str, rows: Tensor
                     ) -> Tuple[Tensor, Optional[Tuple[Tensor, Tensor]]]:
        """([chunks, C + K, D] raw vectors of a side (positives, then negatives) + global emb,
        featurized: (feature -> edge index [F], bag sizes [B]))."""
        s = batch.side(name)
        C, n = batch.chunk_size, batch.num_chunks
        if s.features is not None:
            # Featurized: the mean of the features' embeddings (an empty bag is zero).
            offsets = s.features[0]
            counts = (offsets[1:] - offsets[:-1])
            seg = torch.repeat_interleave(torch.arange(batch.num_pos, device=rows.device), counts)
            buf = rows.new_zeros(n * C, rows.shape[-1])
            buf.index_add_(0, seg, rows)
            buf[:batch.num_pos] /= counts.clamp_min(1).unsqueeze(1).to(rows.dtype)
            buf = buf.view(n, C, -1)
            feat = (seg, counts)
        else:
            buf = rows
            feat = None
        if self.config.global_emb:
            buf += self.params[global_emb_key(s.entity)]
        return buf, feat

    def _zero_padding(self, batch: Batch, *bufs: Tensor) -> None:
        last = batch.last_chunk_size
        if last < batch.chunk_size:
            for buf in bufs:
                buf[-1, last:batch.chunk_size] = 0

    def forward(self, batch: Batch, fuse: bool = False) -> Scores:
        """The batch's scores. fuse: the caller wants only the backward's gradients, so
        where the C step serves (_fusable) the scores are left to the backward, which
        computes them chunk by chunk with their gradients."""
        cmp = self.comparator
        C, n = batch.chunk_size, batch.num_chunks
        index = self._layout(batch)
        groups, where = self._gather(batch, index)
        rows = {name: groups[g][2][sl].view(*index[name].shape, -1)
                for name, (g, sl) in where.items()}
        a, feat_l = self._side_buffer(batch, "lhs", rows["lhs"])
        b, feat_r = self._side_buffer(batch, "rhs", rows["rhs"])
        op = self.operators[batch.relation]
        saved: Dict[str, Any] = dict(a=a, b=b, groups=groups, where=where,
                                     feat={"lhs": feat_l, "rhs": feat_r})
        blocks: Dict[str, List[Tensor]] = {"lhs": [], "rhs": []}
        lhs, rhs = batch.lhs, batch.rhs
        if not self.dynamic:
            p = self._op_params(batch, "rhs", None)
            u, ctx_u = cmp.prepare(a)
            if fuse and self._fusable(batch, u, b):
                # The step applies the operator itself where it can (its rows of b with
                # padding zero then, as the operator's outputs would be).
                step_op = self._step_operator(batch.relation, op, p)
                v = b if step_op is not None else op.forward(b, p)
                self._zero_padding(batch, u, v)
                saved.update(p=p, u=u, v=v, step_op=step_op, fused=True)
                return Scores({}, blocks, saved)
            v, ctx_v = cmp.prepare(op.forward(b, p))
            self._zero_padding(batch, u, v)
            u_pos, v_pos = u[:, :C], v[:, :C]
            need_batch = lhs.has_batch or rhs.has_batch
            # The batch block scores each positive pair on its diagonal: read them there
            # (before the mask), their gradients added there in the backward.
            pos_in_block = need_batch and cmp.pos_in_matrix
            pos = None if pos_in_block else cmp.pos(u_pos, v_pos)
            m_r = None
            if rhs.mode is not Negatives.NONE or need_batch:
                k_r = v if need_batch else v[:, C:]
                m_r = cmp.matrix(u_pos, k_r, self.workspace.scores("rhs", u_pos, k_r))
                if pos_in_block:
                    pos = m_r[:, :, :C].diagonal(dim1=1, dim2=2).clone()
                if need_batch:
                    mask_batch_block(m_r[:, :, :C], batch.last_chunk_size)
                if rhs.mode is Negatives.ALL:
                    mask_own_ids(m_r, rhs.ids)
                if rhs.mode is not Negatives.NONE:
                    blocks["rhs"].append(m_r)
            if lhs.has_batch:
                # c(v_i, u_j) = M[j, i]: the lhs batch block is the rhs one transposed (a
                # copy when the loss will overwrite both in place).
                block = m_r[:, :, :C].transpose(1, 2)
                blocks["lhs"].append(block if cmp.needs_scores else block.clone())
            m_lu = None
            if lhs.num_neg_ids:
                u_neg = u[:, C:]
                m_lu = cmp.matrix(v_pos, u_neg, self.workspace.scores("lhs", v_pos, u_neg))
                if lhs.mode is Negatives.ALL:
                    mask_own_ids(m_lu, lhs.ids)
                blocks["lhs"].append(m_lu)
            saved.update(p=p, u=u, v=v, ctx_u=ctx_u, ctx_v=ctx_v, m_r=m_r, m_lu=m_lu,
                         need_batch=need_batch, pos_in_block=pos_in_block)
            # Beyond the bucket: the rhs side's rows through the operator, as its own are.
            self._beyond(batch, saved, blocks, {"lhs": v_pos, "rhs": u_pos},
                         {"rhs": lambda x: op.forward(x, p)})
            return Scores({"lhs": pos, "rhs": pos}, blocks, saved)

        rel = batch.rel_ids.new_zeros(n * C)
        rel[:batch.num_pos] = batch.rel_ids
        u, ctx_u = cmp.prepare(a)
        v, ctx_v = cmp.prepare(b)
        a_pos = a[:, :C].reshape(n * C, -1)
        b_pos = b[:, :C].reshape(n * C, -1)
        p_l, p_r = self._op_params(batch, "lhs", rel), self._op_params(batch, "rhs", rel)
        q_l, ctx_ql = cmp.prepare(op.forward(b_pos, p_r).view(n, C, -1))  # lhs side queries
        q_r, ctx_qr = cmp.prepare(op.forward(a_pos, p_l).view(n, C, -1))  # rhs side queries
        self._zero_padding(batch, u, v, q_l, q_r)
        pos = {"lhs": cmp.pos(u[:, :C], q_l), "rhs": cmp.pos(q_r, v[:, :C])}
        mats = {}
        for name, q, k in (("lhs", q_l, u), ("rhs", q_r, v)):
            s = batch.side(name)
            if s.mode is Negatives.NONE:
                continue
            k = k if s.has_batch else k[:, C:]
            m = cmp.matrix(q, k, self.workspace.scores(name, q, k))
            if s.has_batch:
                mask_batch_block(m[:, :, :C], batch.last_chunk_size)
            if s.mode is Negatives.ALL:
                mask_own_ids(m, s.ids)
            mats[name] = m
            blocks[name].append(m)
        saved.update(rel=rel, a_pos=a_pos, b_pos=b_pos, p_l=p_l, p_r=p_r, u=u, v=v, q_l=q_l,
                     q_r=q_r, ctx_u=ctx_u, ctx_v=ctx_v, ctx_ql=ctx_ql, ctx_qr=ctx_qr, mats=mats)
        self._beyond(batch, saved, blocks, {"lhs": q_l, "rhs": q_r}, {})
        return Scores(pos, blocks, saved)

    def _fusable(self, batch: Batch, u: Tensor, v: Tensor) -> bool:
        """Whether losses.dot_softmax_step serves the batch (per-relation mode): the dot
        comparator and the softmax loss (PBG's defaults), both sides with batch negatives
        and the same number of uniform ones, none from beyond the bucket, and the C code
        ready for the rows (built, numpy's BLAS reachable). Chunk by chunk, its products and
        the loss work on rows still in the cache, where the batch-wide products of
        forward and backward read them back from memory, and it makes one call where
        they make some thirty."""
        lhs, rhs = batch.lhs, batch.rhs
        return (type(self.comparator) is DotComparator and type(self.loss_fn) is SoftmaxLoss
                and lhs.mode is rhs.mode is Negatives.BATCH_UNIFORM
                and lhs.num_neg_ids == rhs.num_neg_ids > 0
                and lhs.beyond is None and rhs.beyond is None and dot_softmax_ready(u, v))

    def _step_operator(self, relation: int, op: Operator, p: Dict[str, Tensor]
                       ) -> Optional[StepOperator]:
        """op.in_step(p), made once per relation and thread: the step writes the
        parameters' gradients into its buffers, which the batch's Adagrad step reads
        before the thread's next batch."""
        key = ("step_op", relation)
        if key not in self.workspace.buffers:
            self.workspace.buffers[key] = op.in_step(p)
        return self.workspace.buffers[key]

    def _beyond(self, batch: Batch, saved: Dict[str, Any], blocks: Dict[str, List[Tensor]],
                queries: Dict[str, Tensor], ops: Dict[str, Any]) -> None:
        """Score each side's negatives from beyond the bucket against its queries [n, C, D]
        (ops: what a side's rows pass through before the comparator, as its own negatives
        do), a block appended to the side's blocks (the softmax's correction added), and
        saved["beyond"][side] = what the queries' gradient needs."""
        cmp, n = self.comparator, batch.num_chunks
        saved["beyond"] = {}
        for name in SIDES:
            s = batch.side(name)
            if s.beyond is None or s.mode is Negatives.NONE:
                continue
            raw = torch.from_numpy(s.beyond.rows)
            if self.config.global_emb:
                raw = raw + self.params[global_emb_key(s.entity)]
            x = ops[name](raw) if name in ops else raw
            k, ctx = cmp.prepare(x)
            k = k.unsqueeze(0) if n == 1 else k.unsqueeze(0).expand(n, *k.shape).contiguous()
            q = queries[name]
            m = cmp.matrix(q, k, self.workspace.scores(("beyond", name), q, k))
            block = m
            if self.config.loss_fn == "softmax":
                block = m + s.beyond.log_weight if cmp.needs_scores else \
                    m.add_(s.beyond.log_weight)
            saved["beyond"][name] = (q, k, m, raw, ctx, len(blocks[name]))
            blocks[name].append(block)

    def _beyond_backward(self, batch: Batch, sv: Dict[str, Any],
                         dblocks: Dict[str, List[Tensor]], param_grads: Dict[str, Tensor]
                         ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """Per side the queries' gradients [n, C, D] from the blocks of negatives from
        beyond the bucket (taken out of dblocks), and the gradients [S, D] of the rows
        themselves (applied later, see model.beyond); the shared parameters' from their
        rows (the rhs operator's in per-relation mode, the global embeddings') are added
        to `param_grads`."""
        cmp = self.comparator
        dq_of: Dict[str, Tensor] = {}
        drow_of: Dict[str, Tensor] = {}
        for name, (q, k, m, raw, ctx, i) in sv.get("beyond", {}).items():
            g = dblocks[name].pop(i)
            dq, dk = cmp.matrix_backward(q, k, m, g)
            dq_of[name] = dq
            dx = cmp.prepare_backward(ctx, dk.sum(0))
            if name == "rhs" and not self.dynamic:
                dx, dp = self.operators[batch.relation].backward(raw, sv["p"], dx)
                self._add_op_grads(param_grads, batch, "rhs", dp, None)
            if self.config.global_emb:
                key = global_emb_key(batch.side(name).entity)
                param_grads[key] = param_grads[key] + dx.sum(0) if key in param_grads \
                    else dx.sum(0)
            drow_of[name] = dx
        return dq_of, drow_of

    # --- backward -----------------------------------------------------------

    def _weights(self, batch: Batch, device) -> Tensor:
        """[chunks, C] loss weight of each row: relation weight x edge weight, 0 for padding.
        Without edge weights the same tensor serves every batch of a shape and relation
        (the losses only read it)."""
        if batch.weight is None:
            key = ("weights", batch.num_chunks, batch.chunk_size, batch.num_pos, batch.relation)
            w = self.workspace.buffers.get(key)
            if w is None or w.device != device:
                w = self.workspace.buffers[key] = self._fresh_weights(batch, device)
            return w
        return self._fresh_weights(batch, device)

    def _fresh_weights(self, batch: Batch, device) -> Tensor:
        w = torch.zeros(batch.num_chunks * batch.chunk_size, device=device)
        w[:batch.num_pos] = self.config.relations[batch.relation].weight
        if batch.weight is not None:
            w[:batch.num_pos] *= batch.weight
        return w.view(batch.num_chunks, batch.chunk_size)

    def backward(self, batch: Batch, scores: Scores) -> Gradients:
        """Loss, regularizer and gradients of a forward pass (consumes its score blocks)."""
        cmp = self.comparator
        sv = scores.saved
        w = self._weights(batch, sv["a"].device)
        fused = sv.get("fused", False)
        loss: Any = 0.0  # a float, or the sum of the sides' loss tensors
        violators: Dict[str, int] = {}
        dpos: Dict[str, Tensor] = {}
        dblocks: Dict[str, List[Tensor]] = {}
        for name in () if fused else SIDES:
            pos, blocks = scores.pos[name], scores.blocks[name]
            # Gradients overwrite the scores, unless the comparator's backward reads them.
            out = [self.workspace.get(("grad", name, i), blk) if cmp.needs_scores else blk
                   for i, blk in enumerate(blocks)]
            violators[name] = self._violators(batch, name, pos, blocks, out)
            num_neg = sum(blk.shape[-1] for blk in blocks)
            side_loss, dpos[name], dblocks[name] = self.loss_fn.forward_backward(
                pos, blocks, w, num_neg, out)
            loss += side_loss
        a, b = sv["a"], sv["b"]
        # Gradients w.r.t. the side buffers; for plain sides they are views of the per-table
        # gradient rows handed to the optimizer (same layout as the gather).
        # (zeroed first where the relation's backward adds into them)
        written = fused or not self.dynamic and sv["ctx_u"] is None and \
            self._writes_lhs(sv, batch.chunk_size)
        row_grads = {key: (flat, self._row_grads(key, rows, written))
                     for key, flat, rows in sv["groups"]}
        da, db = (self._side_grad(batch, sv, row_grads, name, x)
                  for name, x in (("lhs", a), ("rhs", b)))
        param_grads: Dict[str, Tensor] = {}
        beyond_grads: Dict[str, Tensor] = {}
        if fused:
            loss, violators["lhs"], violators["rhs"] = self._fused_backward(
                batch, sv, w, da, db, param_grads)
        else:
            dq_beyond, beyond_grads = self._beyond_backward(batch, sv, dblocks, param_grads)
            relation_backward = self._dynamic_backward if self.dynamic else \
                self._static_backward
            relation_backward(batch, sv, dpos, dblocks, da, db, param_grads, dq_beyond)
        reg = self._regularize(batch, a, b, da, db, param_grads)
        if self.config.global_emb:
            for name, d in (("lhs", da), ("rhs", db)):
                key = global_emb_key(batch.side(name).entity)
                g = d.reshape(-1, d.shape[-1]).sum(0)
                param_grads[key] = param_grads[key] + g if key in param_grads else g
        self._featurized_row_grads(batch, sv, row_grads, da, db)
        return Gradients(float(loss), reg, violators, row_grads, param_grads, beyond_grads)

    def _row_grads(self, key: PartitionKey, rows: Tensor, written: bool) -> Tensor:
        """The buffer of a table's row gradients, zeroed unless the backward writes all
        of it."""
        grads = self.workspace.get(("row_grads", key), rows)
        return grads if written else grads.zero_()

    @staticmethod
    def _writes_lhs(sv: Dict[str, Any], C: int) -> bool:
        """Whether _static_backward writes every row of the lhs gradient, rather than
        adding into it (it always writes the rhs gradient): the positives' from the
        batch block, the uniform negatives' from their own (or there are none)."""
        return sv["m_r"] is not None and (sv["m_lu"] is not None or sv["u"].shape[1] == C)

    def _fused_backward(self, batch: Batch, sv: Dict[str, Any], w: Tensor, da: Tensor,
                        db: Tensor, param_grads: Dict[str, Tensor]) -> Tuple[float, int, int]:
        """backward for a forward that left its scores to losses.dot_softmax_step: writes
        da and db and the operator's `param_grads`; (loss, violators lhs, violators rhs)."""
        step_op = sv["step_op"]  # (with one, the step writes db through the operator)
        dv = db if step_op is not None else self.workspace.get(("dk", "rhs"), sv["v"])
        totals = dot_softmax_step(sv["u"], sv["v"], da, dv, w, batch.chunk_size,
                                  batch.num_pos, step_op)
        if step_op is not None:
            dp = step_op.grads
        else:
            _, dp = self.operators[batch.relation].backward(sv["b"], sv["p"], dv, dx_out=db)
        self._add_op_grads(param_grads, batch, "rhs", dp, None)
        return totals

    def _static_backward(self, batch: Batch, sv: Dict[str, Any], dpos: Dict[str, Tensor],
                         dblocks: Dict[str, List[Tensor]], da: Tensor, db: Tensor,
                         param_grads: Dict[str, Tensor], dq_beyond: Dict[str, Tensor]) -> None:
        """backward's comparator and operator part for one relation per batch: writes the
        side gradient `db`, and `da` where _writes_lhs (else adds into it), the operator's
        `param_grads`, and adds the queries' gradients from beyond the bucket, `dq_beyond`."""
        cmp, C = self.comparator, batch.chunk_size
        b = sv["b"]
        u, v, m_r, m_lu = sv["u"], sv["v"], sv["m_r"], sv["m_lu"]
        # Gradients w.r.t. u and v; du goes straight into the row gradients when prepare
        # is the identity: written there region by region where _writes_lhs.
        du = da if sv["ctx_u"] is None else torch.zeros_like(u)
        write = du is da and self._writes_lhs(sv, C)
        dv = None
        if m_r is not None:
            g_r = dblocks["rhs"][0] if dblocks["rhs"] else torch.zeros_like(m_r)
            if batch.lhs.has_batch:
                # The lhs batch block is the rhs one transposed: add its gradient in.
                g_r[:, :, :C] += dblocks["lhs"][0].transpose(1, 2)
            if sv["pos_in_block"]:  # (the masked diagonal's own gradient is 0)
                g_r[:, :, :C].diagonal(dim1=1, dim2=2).add_(dpos["lhs"]).add_(dpos["rhs"])
            k_r = v if sv["need_batch"] else v[:, C:]
            out = (du[:, :C], self.workspace.get(("dk", "rhs"), k_r)) if write else None
            dq, dk = cmp.matrix_backward(u[:, :C], k_r, m_r, g_r, out)
            if not write:
                du[:, :C] += dq
            if sv["need_batch"]:
                dv = dk
            else:
                dv = torch.zeros_like(v)
                dv[:, C:] += dk
        if dv is None:
            dv = torch.zeros_like(v)
        if m_lu is not None:
            u_neg = u[:, C:]
            out = (self.workspace.get(("dq", "lhs"), dv[:, :C]), du[:, C:]) if write else None
            dq, dk = cmp.matrix_backward(v[:, :C], u_neg, m_lu, dblocks["lhs"][-1], out)
            dv[:, :C] += dq
            if not write:
                du[:, C:] += dk
        if not sv["pos_in_block"]:
            dq, dk = cmp.pos_backward(u[:, :C], v[:, :C], dpos["lhs"] + dpos["rhs"])
            du[:, :C] += dq
            dv[:, :C] += dk
        if "rhs" in dq_beyond:
            du[:, :C] += dq_beyond["rhs"]
        if "lhs" in dq_beyond:
            dv[:, :C] += dq_beyond["lhs"]
        self._zero_padding(batch, du, dv)
        if du is not da:
            da += cmp.prepare_backward(sv["ctx_u"], du)
        op = self.operators[batch.relation]
        _, dp = op.backward(b, sv["p"], cmp.prepare_backward(sv["ctx_v"], dv), dx_out=db)
        self._add_op_grads(param_grads, batch, "rhs", dp, None)

    def _dynamic_backward(self, batch: Batch, sv: Dict[str, Any], dpos: Dict[str, Tensor],
                          dblocks: Dict[str, List[Tensor]], da: Tensor, db: Tensor,
                          param_grads: Dict[str, Tensor], dq_beyond: Dict[str, Tensor]
                          ) -> None:
        """backward's comparator and operator part for dynamic relations (each edge its
        own relation, applied on both sides): as _static_backward."""
        cmp, C = self.comparator, batch.chunk_size
        n = batch.num_chunks
        op = self.operators[batch.relation]
        u, v, q_l, q_r = sv["u"], sv["v"], sv["q_l"], sv["q_r"]
        du, dv = torch.zeros_like(u), torch.zeros_like(v)
        dk, dq_l = cmp.pos_backward(u[:, :C], q_l, dpos["lhs"])
        du[:, :C] += dk
        dq_r, dk = cmp.pos_backward(q_r, v[:, :C], dpos["rhs"])
        dv[:, :C] += dk
        if "lhs" in dq_beyond:
            dq_l += dq_beyond["lhs"]
        if "rhs" in dq_beyond:
            dq_r += dq_beyond["rhs"]
        for name, q, k, dq_side, dk_side in (("lhs", q_l, u, dq_l, du),
                                             ("rhs", q_r, v, dq_r, dv)):
            m = sv["mats"].get(name)
            if m is None:
                continue
            s = batch.side(name)
            dq, dk = cmp.matrix_backward(q, k if s.has_batch else k[:, C:], m, dblocks[name][0])
            dq_side += dq
            if s.has_batch:
                dk_side += dk
            else:
                dk_side[:, C:] += dk
        self._zero_padding(batch, du, dv, dq_l, dq_r)
        da += cmp.prepare_backward(sv["ctx_u"], du)
        db += cmp.prepare_backward(sv["ctx_v"], dv)
        rel = sv["rel"]
        for side, x, dx_buf, q_grad, ctx, p in (
                ("rhs", sv["b_pos"], db, dq_l, sv["ctx_ql"], sv["p_r"]),
                ("lhs", sv["a_pos"], da, dq_r, sv["ctx_qr"], sv["p_l"])):
            dx, dp = op.backward(x, p, cmp.prepare_backward(ctx, q_grad).view(n * C, -1))
            dx_buf[:, :C] += dx.view(n, C, -1)
            self._add_op_grads(param_grads, batch, side, dp, rel)

    def _violators(self, batch: Batch, name: str, pos: Tensor, blocks: List[Tensor],
                   out: List[Tensor]) -> int:
        """PBG's violators of a side: its negatives' scores above their positive's, on the
        rows that hold edges. One C pass over the blocks where it serves; else compared
        into a float buffer (boolean outputs and count_nonzero are several times slower on
        CPU): the gradient's own buffer, before the loss fills it, so that fewer
        score-sized buffers compete for the cache."""
        count = count_violators(pos, blocks, batch.num_pos)
        if count is not None:
            return count
        count = 0
        rows = pos.numel()
        for i, (blk, o) in enumerate(zip(blocks, out)):
            above = torch.gt(blk, pos.unsqueeze(-1), out=self.workspace.get(
                ("above", name, i), blk) if o is blk else o)
            if batch.num_pos == rows:
                count += int(above.sum())
            else:  # the last chunk's padding rows left out
                count += int(above.sum(-1).view(-1)[:batch.num_pos].sum())
        return count

    def _regularize(self, batch: Batch, a: Tensor, b: Tensor, da: Tensor, db: Tensor,
                    param_grads: Dict[str, Tensor]) -> float:
        """N3 (or another regularizer) on the positives and the operator parameters used."""
        if self.regularizer is None:
            return 0.0
        op = self.operators[batch.relation]
        B, C = batch.num_pos, batch.chunk_size
        total = 0.0
        for x, dx in ((a, da), (b, db)):
            pos = x[:, :C].reshape(-1, x.shape[-1])[:B]
            value, grad = self.regularizer.embeddings(pos, op)
            total += float(value)
            padded = grad.new_zeros(batch.num_chunks * C, grad.shape[-1])
            padded[:B] = grad
            dx[:, :C] += padded.view(batch.num_chunks, C, -1)
        if self.dynamic:
            rows = batch.rel_ids
            for side in SIDES:
                value, dp = self.regularizer.params(self._op_params(batch, side, rows), op, 1)
                total += float(value)
                self._add_op_grads(param_grads, batch, side, dp, rows)
        else:
            value, dp = self.regularizer.params(self._op_params(batch, "rhs", None), op, B)
            total += float(value)
            self._add_op_grads(param_grads, batch, "rhs", dp, None)
        return total

    def _side_grad(self, batch: Batch, sv: Dict[str, Any],
                   row_grads: Dict[PartitionKey, Tuple[Tensor, Tensor]], name: str,
                   like: Tensor) -> Tensor:
        if batch.side(name).features is not None:
            return torch.zeros_like(like)  # mapped to feature rows at the end
        g, sl = sv["where"][name]
        return row_grads[sv["groups"][g][0]][1][sl].view(like.shape)

    def _featurized_row_grads(self, batch: Batch, sv: Dict[str, Any],
                              row_grads: Dict[PartitionKey, Tuple[Tensor, Tensor]],
                              da: Tensor, db: Tensor) -> None:
        """Bag-mean gradients [chunks, C, D] -> feature rows: d(mean)/d(row) = 1 / bag size."""
        C, n = batch.chunk_size, batch.num_chunks
        for name, d in (("lhs", da), ("rhs", db)):
            if batch.side(name).features is None:
                continue
            g, sl = sv["where"][name]
            seg, counts = sv["feat"][name]
            per_entity = d[:, :C].reshape(n * C, -1)[:batch.num_pos]
            per_entity = per_entity / counts.clamp_min(1).unsqueeze(1).to(d.dtype)
            row_grads[sv["groups"][g][0]][1][sl] = per_entity.index_select(0, seg)
