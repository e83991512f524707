"""Use a trained checkpoint by names: score edges, top-k tails or heads, nearest neighbours.

    from pbg_ray import Predictor
    model = Predictor.load("model/checkpoints")          # the newest version
    model = Predictor.load("export/bundle.zip", tag="v10-int8")  # or a model bundle's tag
    model.score([("alice", "follows", "bob")])            # -> float32 [1]
    model.top_rhs("alice", "follows", k=10, exclude=["data/edges/train"])
    model.top_lhs("follows", "bob", k=10)
    model.neighbors("alice", k=10)

Scores are the model's (pbg_ray.evaluation.scoring): `score` and `top_rhs` rank by the rhs
side's score, `top_lhs` by the lhs side's (the same in per-relation mode; dynamic relations
score the sides with different operators). Neighbours are compared by the comparator
on the entities' prepared vectors (global embedding added, no relation operator).
The whole checkpoint (or bundle tag) is loaded into memory.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints import bundle
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.evaluation.filtered import KnownEdges, check_rankable
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import load_entity_names, load_relation_names, num_relation_ids
from pbg_ray.model.params import params_from_checkpoint
from pbg_ray.types import Bucket

Ranked = List[Tuple[str, float]]  # (entity name, score), best first


class NamedModel:
    """A checkpoint version's model parameters (as a Scorer) with its entity and relation
    names, without the embedding tables: what answering by names needs besides the rows."""

    def __init__(self, config: ConfigSchema, arrays: Dict[str, np.ndarray],
                 counts: Dict[str, List[int]], source: str) -> None:
        """arrays: the model's parameters by public name; counts: per entity type the rows
        of each partition; source: what they were loaded from (for messages)."""
        check_rankable(config)
        self.config = config
        self.source = source
        self.counts = counts
        num_rel = num_relation_ids(config)
        self.scorer = Scorer(config, params_from_checkpoint(config, num_rel, arrays, None,
                                                            where=source).arrays)
        self.relation_names = (load_relation_names(config.entity_path) if config.dynamic_relations
                               else [r.name for r in config.relations])
        self._names: Dict[str, List[List[str]]] = {}
        self._index: Dict[str, Dict[str, Tuple[int, int]]] = {}

    # --- names ------------------------------------------------------------

    def names(self, entity: str) -> List[List[str]]:
        """The names of an entity type, per partition."""
        if entity not in self._names:
            self._names[entity] = [load_entity_names(self.config.entity_path, entity, p)
                                   for p in range(len(self.counts[entity]))]
            for part, (names, count) in enumerate(zip(self._names[entity], self.counts[entity])):
                if len(names) != count:
                    raise PbgRayError(
                        f"entity type {entity!r} partition {part}: {len(names)} names in "
                        f"{self.config.entity_path!r} but {count} embeddings in "
                        f"{self.source}. Pass the entity_path the checkpoint was trained on.")
        return self._names[entity]

    def _name_index(self, entity: str) -> Dict[str, Tuple[int, int]]:
        """name -> (partition, offset) of an entity type, built on first use."""
        if entity not in self._index:
            self._index[entity] = {n: (p, i) for p, names in enumerate(self.names(entity))
                                   for i, n in enumerate(names)}
        return self._index[entity]

    def _locate(self, entity: str, name: str) -> Tuple[int, int]:
        """(partition, offset) of an entity by name; an entity of another type is named
        as such (the wrong side of a relation)."""
        where = self._name_index(entity).get(name)
        if where is None:
            elsewhere = [e for e in self.config.entities
                         if e != entity and name in self._name_index(e)]
            if elsewhere:
                raise PbgRayError(f"{name!r} is an entity of type {elsewhere[0]!r}, not of type "
                                  f"{entity!r}: check the relation and which side the name "
                                  "is on.")
            raise PbgRayError(f"unknown {entity} entity {name!r}"
                              f"{did_you_mean(name, self._name_index(entity))}.")
        return where

    def _relation(self, name: str) -> Tuple[int, int]:
        """(index into config.relations, relation id) of a relation by name."""
        if name not in self.relation_names:
            raise PbgRayError(f"unknown relation {name!r}{did_you_mean(name, self.relation_names)}. "
                              f"Relations: {', '.join(self.relation_names[:20])}"
                              f"{' ...' if len(self.relation_names) > 20 else ''}.")
        rel_id = self.relation_names.index(name)
        return (0 if self.config.dynamic_relations else rel_id), rel_id

    def _type_of(self, name: str) -> str:
        found = [entity for entity in self.config.entities if name in self._name_index(entity)]
        if len(found) != 1:
            every = [n for entity in self.config.entities for n in self._name_index(entity)]
            raise PbgRayError(f"entity {name!r} " + (
                f"is in several types {found}; pass entity_type." if found
                else f"is unknown{did_you_mean(name, every)}."))
        return found[0]


class Predictor(NamedModel):
    """A checkpoint version (or a bundle's tag) with its entity and relation names."""

    def __init__(self, config: ConfigSchema, arrays: Dict[str, np.ndarray],
                 tables: Dict[str, List[np.ndarray]], source: str) -> None:
        """arrays: the model's parameters by public name; tables: per entity type the
        embeddings [N, D] of each partition; source: what they were loaded from."""
        super().__init__(config, arrays, {e: [len(t) for t in parts]
                                          for e, parts in tables.items()}, source)
        self.tables: Dict[str, List[Tensor]] = {
            entity: [torch.from_numpy(t) for t in parts] for entity, parts in tables.items()}

    @classmethod
    def load(cls, checkpoint_path: str, version: Optional[int] = None,
             entity_path: Optional[str] = None, tag: Optional[str] = None) -> "Predictor":
        """The checkpoint in checkpoint_path (its config.json says the rest), or a model
        bundle file (pbg_ray.checkpoints.bundle); version None: the newest; tag (bundles) None: the
        newest; entity_path: where the names are, if not where training found them."""
        if bundle.is_bundle(checkpoint_path):
            if version is not None:
                raise PbgRayError(f"{checkpoint_path!r} is a model bundle: pick one of its tags "
                                  "(tag / --tag), not a version.")
            with bundle.load(checkpoint_path, tag) as model:
                config = model.config
                if entity_path is not None:
                    config = dataclasses.replace(config, entity_path=entity_path)
                tables = {e: [model.embeddings(e, p) for p in range(c.num_partitions)]
                          for e, c in config.entities.items()}
                return cls(config, model.model_arrays(), tables,
                           f"tag {model.tag!r} of {checkpoint_path!r}")
        checkpoint = CheckpointManager(checkpoint_path)
        config = dataclasses.replace(checkpoint.read_config(), checkpoint_path=str(checkpoint.path))
        if entity_path is not None:
            config = dataclasses.replace(config, entity_path=entity_path)
        checkpoint, version = checkpoint.locate(config, version, "version")
        tables = {e: [checkpoint.read_partition(version, e, p)[0]
                      for p in range(c.num_partitions)]
                  for e, c in config.entities.items()}
        return cls(config, checkpoint.read_model(version)[0], tables,
                   f"version {version} of {str(checkpoint.path)!r}")

    def _vector(self, entity: str, name: str) -> Tensor:
        part, offset = self._locate(entity, name)
        return self.scorer.entity_vectors(entity, self.tables[entity][part][offset:offset + 1])

    # --- queries ----------------------------------------------------------

    def score(self, triples: Sequence[Tuple[str, str, str]]) -> np.ndarray:
        """Scores float32 [T] of (lhs name, relation name, rhs name) triples."""
        out = np.empty(len(triples), np.float32)
        for i, (lhs, rel, rhs) in enumerate(triples):
            relation, rel_id = self._relation(rel)
            rconf = self.config.relations[relation]
            query = self.scorer.queries("rhs", relation, torch.tensor([rel_id]),
                                        self._vector(rconf.lhs, lhs))
            cand = self.scorer.candidates("rhs", relation, self._vector(rconf.rhs, rhs))
            out[i] = float(self.scorer.pos(query, cand)[0])
        return out

    def top_rhs(self, lhs: str, relation: str, k: int = 10, exclude: Sequence[str] = ()) -> Ranked:
        """The k best rhs entities for (lhs, relation); exclude: edge paths whose edges
        (lhs, relation, x) remove x from the answer."""
        return self._top("rhs", lhs, relation, k, exclude)

    def top_lhs(self, relation: str, rhs: str, k: int = 10, exclude: Sequence[str] = ()) -> Ranked:
        """The k best lhs entities for (relation, rhs); exclude as in top_rhs."""
        return self._top("lhs", rhs, relation, k, exclude)

    def _top(self, side: str, name: str, rel: str, k: int, exclude: Sequence[str]) -> Ranked:
        relation, rel_id = self._relation(rel)
        rconf = self.config.relations[relation]
        other = "lhs" if side == "rhs" else "rhs"
        other_entity, entity = getattr(rconf, other), getattr(rconf, side)
        other_part, other_id = self._locate(other_entity, name)
        query = self.scorer.queries(side, relation, torch.tensor([rel_id]),
                                    self._vector(other_entity, name))
        scores = []
        for part, table in enumerate(self.tables[entity]):
            cands = self.scorer.candidates(side, relation, self.scorer.entity_vectors(entity, table))
            s = self.scorer.matrix(query, cands)[0]
            bucket = Bucket(other_part, part) if side == "rhs" else Bucket(part, other_part)
            for path in exclude:
                known = KnownEdges(read_edges(path, bucket), len(self.relation_names))
                _, ids = known.true_entities(side, np.array([other_id]), np.array([rel_id]))
                s[torch.from_numpy(ids)] = -float("inf")
            scores.append(s)
        return self._best(entity, scores, k)

    def neighbors(self, name: str, entity_type: Optional[str] = None, k: int = 10) -> Ranked:
        """The k entities of the same type nearest to `name` by the comparator (itself left
        out); entity_type is needed only when the name exists in several types."""
        entity = entity_type or self._type_of(name)
        part, offset = self._locate(entity, name)
        prepare = self.scorer.comparator.prepare
        query = prepare(self._vector(entity, name))[0]
        scores = []
        for p, table in enumerate(self.tables[entity]):
            s = self.scorer.matrix(query, prepare(self.scorer.entity_vectors(entity, table))[0])[0]
            if p == part:
                s[offset] = -float("inf")
            scores.append(s)
        return self._best(entity, scores, k)

    def _best(self, entity: str, scores: List[Tensor], k: int) -> Ranked:
        """The k highest of per-partition scores, as (name, score), skipping excluded ones."""
        flat = torch.cat(scores)
        top = torch.topk(flat, min(k, len(flat)))
        starts = np.cumsum([0] + [len(s) for s in scores])
        names = self.names(entity)
        result = []
        for value, idx in zip(top.values.tolist(), top.indices.tolist()):
            if value == -float("inf"):
                break
            part = int(np.searchsorted(starts, idx, "right") - 1)
            result.append((names[part][idx - starts[part]], value))
        return result
