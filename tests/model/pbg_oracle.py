"""Runs one batch through torchbiggraph 1.0.0 (the oracle) and through pbg_ray's kernel
with the same parameters, edges and negative samples."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchbiggraph import model as tbg_model
    from torchbiggraph.config import EntitySchema as TbgEntity, RelationSchema as TbgRelation
    from torchbiggraph.edgelist import EdgeList as TbgEdgeList
    from torchbiggraph.entitylist import EntityList
    from torchbiggraph.losses import LOSS_FUNCTIONS as TBG_LOSSES
    from torchbiggraph.row_adagrad import RowAdagrad
    from torchbiggraph.tensorlist import TensorList
    from torchbiggraph.types import Side

from pbg_ray.checkpoints.directory import state_dict_key
from pbg_ray.config import ConfigSchema
from pbg_ray.model.embedder import Batch
from pbg_ray.model.kernel import EdgeTensors, KernelState, build_batch
from pbg_ray.model.params import ModelParams, init_params, relation_lr
from pbg_ray.types import Bucket, EdgeList, FeatureList

SIZES = {"a": 13, "b": 11, "f": 9}  # rows per entity type (f: featurized, rows = features)


def make_config(**overrides: Any) -> ConfigSchema:
    operator = overrides.pop("operator", "none")
    dynamic = overrides.get("dynamic_relations", False)
    lhs, rhs = overrides.pop("lhs", "a"), overrides.pop("rhs", "b")
    all_negs = overrides.pop("all_negs", False)
    relations = [{"name": "r0", "lhs": lhs, "rhs": rhs, "operator": operator,
                  "all_negs": all_negs, "weight": 1.5}]
    if not dynamic:
        relations.append({"name": "r1", "lhs": lhs, "rhs": rhs, "operator": operator,
                          "all_negs": all_negs, "weight": 0.5})
    data = dict(
        entities={"a": {}, "b": {}, "f": {"featurized": True}}, relations=relations,
        dimension=8, comparator="dot", loss_fn="ranking", margin=0.3,
        global_emb=not dynamic, batch_size=30, num_batch_negs=5, num_uniform_negs=4,
        lr=0.1, relation_lr=0.05, entity_path="/unused", edge_paths=["/unused"],
        checkpoint_path="/unused")
    data.update(overrides)
    return ConfigSchema.from_dict(data)


@dataclasses.dataclass
class Case:
    config: ConfigSchema
    num_rel_ids: int
    partitions: Dict[Tuple[str, int], Tuple[np.ndarray, np.ndarray]]
    params: ModelParams
    edges: EdgeList
    bucket: Bucket = Bucket(0, 0)

    def copy_state(self) -> Tuple[Dict, ModelParams]:
        parts = {k: (e.copy(), s.copy()) for k, (e, s) in self.partitions.items()}
        params = ModelParams({k: v.copy() for k, v in self.params.arrays.items()},
                             {k: v.copy() for k, v in self.params.sums.items()})
        return parts, params


def _features(rng: np.random.Generator, n: int, rows: int) -> FeatureList:
    counts = rng.integers(0, 4, n)  # empty bags included
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return FeatureList(offsets, rng.integers(0, rows, offsets[-1]).astype(np.int64))


def make_case(num_edges: int = 23, seed: int = 0, weights: bool = False,
              sizes: Dict[str, int] = SIZES, **overrides) -> Case:
    """Random embeddings, optimizer sums, parameters and edges of one relation
    (per-relation mode: relation 1) or of mixed relation ids (dynamic mode)."""
    config = make_config(**overrides)
    rng = np.random.default_rng(seed)
    num_rel_ids = 3 if config.dynamic_relations else len(config.relations)
    partitions = {(e, 0): (rng.normal(0, 0.5, (sizes[e], config.dimension)).astype(np.float32),
                           rng.uniform(0.1, 1, sizes[e]).astype(np.float32))
                  for e in config.entities}
    params = init_params(config, num_rel_ids)
    for name, value in params.arrays.items():
        value += rng.normal(0, 0.3, value.shape).astype(np.float32)
        params.sums[name] = rng.uniform(0.1, 1, value.shape).astype(np.float32)
    rel = config.relations[0]
    lhs_feat = config.entities[rel.lhs].featurized
    rhs_feat = config.entities[rel.rhs].featurized
    edges = EdgeList(
        np.full(num_edges, -1) if lhs_feat else rng.integers(0, sizes[rel.lhs], num_edges),
        np.full(num_edges, -1) if rhs_feat else rng.integers(0, sizes[rel.rhs], num_edges),
        rng.integers(0, num_rel_ids, num_edges) if config.dynamic_relations
        else np.ones(num_edges, np.int64),
        rng.uniform(0.2, 2, num_edges).astype(np.float32) if weights else None,
        _features(rng, num_edges, sizes[rel.lhs]) if lhs_feat else None,
        _features(rng, num_edges, sizes[rel.rhs]) if rhs_feat else None)
    return Case(config, num_rel_ids, partitions, params, edges)


# --- pbg_ray -----------------------------------------------------------------


def ours(case: Case, seed: int = 0, eval_negs: bool = False) -> Tuple[KernelState, Batch]:
    """Our kernel state on copies of the case's arrays, and a batch of all its edges."""
    parts, params = case.copy_state()
    state = KernelState(case.config, parts, params, writable=True)
    sizes = {k: t.shape[0] for k, t in state.tables.items()}
    c = case.config
    negs = (c.eval_num_batch_negs, c.eval_num_uniform_negs) if eval_negs else \
        (c.num_batch_negs, c.num_uniform_negs)
    batch = build_batch(c, case.bucket, EdgeTensors(case.edges),
                        np.arange(len(case.edges)), *negs, sizes,
                        torch.Generator().manual_seed(seed))
    return state, batch


def pbg_layout(batch: Batch, pos: torch.Tensor, blocks: List[torch.Tensor]
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Our chunked scores in PBG's layout: pos [B], neg [B, N]."""
    B = batch.num_pos
    neg = torch.cat(blocks, dim=-1) if blocks else pos.new_zeros(*pos.shape, 0)
    return pos.reshape(-1)[:B].clone(), neg.flatten(0, 1)[:B].clone()


def dense_row_grads(state: KernelState, rows) -> Dict[Tuple[str, int], torch.Tensor]:
    out = {}
    for key, (ids, g) in rows.items():
        out[key] = torch.zeros_like(state.tables[key]).index_add_(0, ids, g)
    return out


# --- torchbiggraph -------------------------------------------------------------


@dataclasses.dataclass
class Oracle:
    model: Any
    tables: Dict[Tuple[str, int], torch.nn.Parameter]
    scores: Any
    loss: torch.Tensor
    violators: Tuple[int, int]

    def grads(self) -> Dict[str, torch.Tensor]:
        """Its state-dict name -> gradient of the shared parameters (zeros where it has none)."""
        return {name: p.grad if p.grad is not None else torch.zeros_like(p)
                for name, p in self.model.named_parameters()
                if not name.startswith(("lhs_embs.", "rhs_embs."))}

    def table_grads(self) -> Dict[Tuple[str, int], torch.Tensor]:
        return {k: (p.grad.to_dense() if p.grad is not None else torch.zeros_like(p))
                for k, p in self.tables.items()}


def pbg_model(config: ConfigSchema, num_rel_ids: int, num_batch_negs: int,
              num_uniform_negs: int):
    """torchbiggraph's MultiRelationEmbedder for our config (what its make_model builds)."""
    dynamic = num_rel_ids if config.dynamic_relations else 0
    relations = [TbgRelation(name=r.name, lhs=r.lhs, rhs=r.rhs, weight=r.weight,
                             operator=r.operator, all_negs=r.all_negs) for r in config.relations]
    entities = {n: TbgEntity(num_partitions=e.num_partitions, featurized=e.featurized)
                for n, e in config.entities.items()}
    comparator = tbg_model.COMPARATORS.get_class(config.comparator)()
    if config.bias:
        comparator = tbg_model.BiasedComparator(comparator)
    ops = {side: [tbg_model.instantiate_operator(r.operator, side, dynamic, config.dimension)
                  for r in config.relations] for side in (Side.LHS, Side.RHS)}
    return tbg_model.MultiRelationEmbedder(
        config.dimension, relations, entities, num_batch_negs=num_batch_negs,
        num_uniform_negs=num_uniform_negs, disable_lhs_negs=config.disable_lhs_negs,
        disable_rhs_negs=config.disable_rhs_negs, lhs_operators=ops[Side.LHS],
        rhs_operators=ops[Side.RHS], comparator=comparator, global_emb=config.global_emb,
        max_norm=config.max_norm, num_dynamic_rels=dynamic)


def oracle(case: Case, batch: Batch, eval_negs: bool = False,
           side_loss: Optional[Callable] = None, extra: Optional[Callable] = None) -> Oracle:
    """torchbiggraph's scores, loss (as its Trainer computes it) and gradients for the batch,
    its uniform negatives forced to the batch's. `side_loss(pos, neg)` replaces its loss
    function, `extra(model, tables)` adds a term (formulas for what 1.0.0 lacks)."""
    c = case.config
    negs = (c.eval_num_batch_negs, c.eval_num_uniform_negs) if eval_negs else \
        (c.num_batch_negs, c.num_uniform_negs)
    model = pbg_model(c, case.num_rel_ids, *negs)
    model.load_state_dict({state_dict_key(k): torch.tensor(v)
                           for k, v in case.params.arrays.items()}, strict=False)
    tables = {k: torch.nn.Parameter(torch.tensor(e)) for k, (e, _) in case.partitions.items()}
    rel = c.relations[batch.relation]
    for side, s in ((Side.LHS, batch.lhs), (Side.RHS, batch.rhs)):
        model.set_embeddings(s.entity, tables[s.table], side)
        module = side.pick(model.lhs_embs, model.rhs_embs)["emb_" + s.entity]
        if s.neg_ids is not None and s.mode.name in ("BATCH_UNIFORM", "UNIFORM"):
            module.sample_entities = (lambda *dims, m=module, ids=s.neg_ids: m.get(ids))

    def entity_list(name: str) -> EntityList:
        feats = getattr(case.edges, f"{name}_features")
        if feats is not None:
            return EntityList.from_tensor_list(
                TensorList(torch.tensor(feats.offsets), torch.tensor(feats.data)))
        return EntityList.from_tensor(torch.tensor(getattr(case.edges, name)))

    rel_ids = torch.tensor(case.edges.rel)
    edges = TbgEdgeList(entity_list("lhs"), entity_list("rhs"),
                        rel_ids if c.dynamic_relations else rel_ids[0])
    scores = model(edges)
    if side_loss is None:
        loss_cls = TBG_LOSSES.get_class(c.loss_fn)
        side_loss = loss_cls(c.margin) if c.loss_fn == "ranking" else loss_cls()
    loss = rel.weight * (side_loss(scores.lhs_pos, scores.lhs_neg)
                         + side_loss(scores.rhs_pos, scores.rhs_neg))
    violators = (int((scores.lhs_neg > scores.lhs_pos.unsqueeze(1)).sum()),
                 int((scores.rhs_neg > scores.rhs_pos.unsqueeze(1)).sum()))
    total = loss if extra is None else loss + extra(model, tables)
    if total.requires_grad:
        total.backward()
    return Oracle(model, tables, scores, loss, violators)


def oracle_step(case: Case, o: Oracle) -> None:
    """torchbiggraph's optimizer steps after `oracle`, from the case's optimizer sums."""
    c = case.config
    for key, p in o.tables.items():
        opt = RowAdagrad([p], lr=c.lr)
        opt.state[p]["sum"].copy_(torch.tensor(case.partitions[key][1]))
        opt.step()
    # Its global optimizer holds the model's parameters but not the entity embeddings.
    public = {state_dict_key(k): k for k in case.params.arrays}
    named = [(n, p) for n, p in o.model.named_parameters() if n in public]
    if named:
        opt = torch.optim.Adagrad([p for _, p in named], lr=relation_lr(c))
        for n, p in named:
            opt.state[p]["sum"].copy_(torch.tensor(case.params.sums[public[n]]))
        opt.step()
