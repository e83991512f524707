"""Prepared query and candidate vectors for ranking one side of an edge against every
entity of a type: the Embedder's scores (pbg_ray/model/embedder.py) factored by side.

Ranking side "rhs" of an edge (a, rel, b) scores c(query, candidate) for candidates x
of the rhs type, side "lhs" for candidates of the lhs type:

  per-relation mode   rhs: query prep(a + g_lhs)           candidates prep(op_rel(x + g_rhs))
                      lhs: query prep(op_rel(b + g_rhs))   candidates prep(x + g_lhs)
  dynamic mode        rhs: query prep(op_lhs[rel](a))      candidates prep(x)
                      lhs: query prep(op_rhs[rel](b))      candidates prep(x)

so c(query, the true entity's candidate vector) is the positive score the Embedder gives
that side, and the candidates of a side depend on the relation only in per-relation mode
on the rhs. There the operator moves to the query where the comparator allows it with the
scores unchanged (`moves_to_query`): for dot, <q, op(x)> = <op*(q), x> with op* the
adjoint of a linear operator; for L2, |q - (x + t)| = |(q - t) - x|. The relation's
candidates are then the relation-free ones, prepared once for every relation and side,
with no pass of the operator over a whole partition. With a translation under dot,
<q, x + t> = <q, x> + <q, t>: the ranking moves too (adjoint_queries), the scores by a
constant per query. Rows are raw embeddings [N, D]: PBG's max_norm and the global
embedding are applied here (`entity_vectors`). Featurized types are not supported (no
candidate set).
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.config import ConfigSchema
from pbg_ray.model.comparators import make_comparator
from pbg_ray.model.operators import OPERATORS
from pbg_ray.model.params import global_emb_key, operator_key

# Operators a query can carry instead of the candidates, per comparator: with the scores
# unchanged (EXACT_ADJOINTS), or with each query's scores shifted by one constant, so its
# ranking unchanged (RANK_ADJOINTS: a translation's <q, t> under dot).
EXACT_ADJOINTS = {"dot": ("none", "diagonal", "linear", "complex_diagonal"),
                  "l2": ("none", "translation"), "squared_l2": ("none", "translation")}
RANK_ADJOINTS = dict(EXACT_ADJOINTS, dot=EXACT_ADJOINTS["dot"] + ("translation", "affine"))


def moves_to_query(config: ConfigSchema, relation: int,
                   adjoints: Mapping[str, Tuple[str, ...]] = EXACT_ADJOINTS) -> bool:
    """Whether the rhs operator of `relation` (per-relation mode) can move from the
    candidates to the query (module docstring), by `adjoints`."""
    return (not config.dynamic_relations and not config.bias
            and config.relations[relation].operator in adjoints.get(config.comparator, ()))


class Scorer:
    """The model's scoring of single sides. params: public name -> array (ModelParams.arrays)."""

    def __init__(self, config: ConfigSchema, params: Mapping[str, np.ndarray]) -> None:
        self.config = config
        self.dynamic = config.dynamic_relations
        self.comparator = make_comparator(config.comparator, config.bias)
        # Copies (the parameters are small): those from the object store are read-only.
        self.params: Dict[str, Tensor] = {k: torch.from_numpy(np.array(v)) for k, v in params.items()}
        self.operators = [OPERATORS.get(r.operator)(config.entity_dimension(r.rhs))
                          for r in config.relations]

    def entity_vectors(self, entity: str, rows: Tensor) -> Tensor:
        """Raw rows [N, D] as the model sees them: renormalized to max_norm (as the
        Embedder's gather does) plus the type's global embedding. A new tensor, or rows
        themselves where the model has neither (callers never write into it)."""
        max_norm = self.config.max_norm
        if max_norm is None and not self.config.global_emb:
            return rows
        rows = rows.clone()
        if max_norm is not None:
            norms = rows.norm(dim=1)
            over = norms > max_norm
            rows[over] *= (max_norm / (norms[over] + 1e-7)).unsqueeze(1)
        if self.config.global_emb:
            rows += self.params[global_emb_key(entity)]
        return rows

    def _operator(self, side: str, relation: int, rel_ids: Tensor):
        """(operator, its parameters) of `side`'s operator for rows of rel_ids [B]."""
        op = self.operators[relation]
        if self.dynamic:
            return op, {n: self.params[operator_key(0, side, d)].index_select(0, rel_ids)
                        for n, d in op.param_names}
        return op, {n: self.params[operator_key(relation, side, n)] for n, _ in op.param_names}

    def queries(self, side: str, relation: int, rel_ids: Tensor, other: Tensor) -> Tensor:
        """Prepared queries [B, D] for ranking `side`, from the other side's entity
        vectors other [B, D]; relation: index into config.relations (0 in dynamic mode),
        rel_ids [B]: the edges' relation ids."""
        if self.dynamic:
            # The rhs ranking's query is the lhs transformed by the lhs operator, and vice versa.
            op, p = self._operator("lhs" if side == "rhs" else "rhs", relation, rel_ids)
            other = op.forward(other, p)
        elif side == "lhs":
            op, p = self._operator("rhs", relation, rel_ids)
            other = op.forward(other, p)
        queries = self.comparator.prepare(other)[0]
        if side == "rhs" and moves_to_query(self.config, relation):
            return self.adjoint_queries(relation, queries)
        return queries

    def adjoint_queries(self, relation: int, queries: Tensor) -> Tensor:
        """Prepared rhs queries [B, D] of `relation` (per-relation mode) that rank the
        relation-free candidates as `queries` rank the relation's, for an operator among
        RANK_ADJOINTS (module docstring)."""
        operator = self.config.relations[relation].operator
        p = self._operator("rhs", relation, None)[1]
        if operator == "translation" and self.config.comparator != "dot":
            return queries - p["translation"]
        if operator == "diagonal":
            return queries * p["diagonal"]
        if operator in ("linear", "affine"):
            return queries @ p["linear_transformation"]  # forward is x @ A^T
        if operator == "complex_diagonal":  # the conjugate diagonal
            return self.operators[relation].forward(queries, {"real": p["real"],
                                                              "imag": -p["imag"]})
        return queries

    def candidates(self, side: str, relation: int, vectors: Tensor) -> Tensor:
        """Prepared candidates [N, D] of `side` from entity vectors [N, D]."""
        if self.relation_specific(side, relation):
            op, p = self._operator("rhs", relation, None)
            vectors = op.forward(vectors, p)
        return self.comparator.prepare(vectors)[0]

    def relation_specific(self, side: str, relation: int) -> bool:
        """Whether `side`'s candidates of `relation` depend on the relation (else they are
        shared by all relations and both sides)."""
        return (not self.dynamic and side == "rhs"
                and self.config.relations[relation].operator != "none"
                and not moves_to_query(self.config, relation))

    def pos(self, queries: Tensor, candidates: Tensor) -> Tensor:
        """Scores [B] of matching rows."""
        return self.comparator.pos(queries, candidates)

    def matrix(self, queries: Tensor, candidates: Tensor, out: Tensor = None) -> Tensor:
        """All-pairs scores [B, N] (into `out` [1, B, N] if given)."""
        return self.comparator.matrix(queries.unsqueeze(0), candidates.unsqueeze(0), out)[0]
