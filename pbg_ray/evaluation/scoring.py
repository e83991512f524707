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
on the rhs. Rows are raw embeddings [N, D]: PBG's max_norm and the global embedding are
applied here (`entity_vectors`). Featurized types are not supported (no candidate set).
"""

from __future__ import annotations

from typing import Dict, Mapping

import numpy as np
import torch
from torch import Tensor

from pbg_ray.config import ConfigSchema
from pbg_ray.model.comparators import make_comparator
from pbg_ray.model.operators import OPERATORS
from pbg_ray.model.params import global_emb_key, operator_key



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
        Embedder's gather does) plus the type's global embedding. A new tensor."""
        rows = rows.clone()
        max_norm = self.config.max_norm
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
        return self.comparator.prepare(other)[0]

    def candidates(self, side: str, relation: int, vectors: Tensor) -> Tensor:
        """Prepared candidates [N, D] of `side` from entity vectors [N, D]."""
        if self.relation_specific(side):
            op, p = self._operator("rhs", relation, None)
            vectors = op.forward(vectors, p)
        return self.comparator.prepare(vectors)[0]

    def relation_specific(self, side: str) -> bool:
        """Whether `side`'s candidates depend on the relation (else shared by all)."""
        return not self.dynamic and side == "rhs"

    def pos(self, queries: Tensor, candidates: Tensor) -> Tensor:
        """Scores [B] of matching rows."""
        return self.comparator.pos(queries, candidates)

    def matrix(self, queries: Tensor, candidates: Tensor, out: Tensor = None) -> Tensor:
        """All-pairs scores [B, N] (into `out` [1, B, N] if given)."""
        return self.comparator.matrix(queries.unsqueeze(0), candidates.unsqueeze(0), out)[0]
