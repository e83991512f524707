"""Questions by names answered from a model: an edge to score, the k best entities of a side
for (entity, relation), the k nearest entities of one. Each batch is resolved in one pass
over the names, every question to its typed form or to its own error; every answer is
computed by the functions here: the queries' prepared vectors, one partition's exact top-k
without the candidates left out, and the partitions' hits merged into the best k with names.

The one scoring core of Predictor, the predict command and the service: they differ only in
where rows and partitions are read (in this process, in Ray tasks, in the service's shards)
and, for the service, in approximate indexes (serving/shards.py) that propose candidates
these functions score."""

from __future__ import annotations

import dataclasses
from typing import (
    Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union)

import numpy as np
import torch
from torch import Tensor

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.evaluation.entity_names import Asked, EntityNames, Located, RelationNames
from pbg_ray.evaluation.filtered import QUERY_BLOCK, KnownEdges, check_rankable
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.entities import num_relation_ids
from pbg_ray.model.params import params_from_checkpoint
from pbg_ray.types import Bucket

class Hit(NamedTuple):
    """An entity of a ranked answer (top-k, neighbours): its name and the model's score."""

    name: str
    score: float


Ranked = List[Hit]  # best first
Triple = Tuple[str, str, str]  # (lhs name, relation name, rhs name)
# One question's answer in a batch, or the error that question alone has (an unknown name).
Answer = Union[Ranked, float, PbgRayError]
Q = TypeVar("Q")


def answer_json(answer: Answer) -> Dict[str, Any]:
    """A question's answer as every interface writes it in JSON (the predict command's
    lines, the service's "answers"): {"score": s} for an edge, {"hits": [{"name": n,
    "score": s}, ...]} (best first) for the k best entities or the nearest ones, and
    {"error": message} for a question the model cannot answer (an unknown name)."""
    if isinstance(answer, PbgRayError):
        return {"error": str(answer)}
    if isinstance(answer, float):
        return {"score": answer}
    return {"hits": [hit._asdict() for hit in answer]}


@dataclasses.dataclass(frozen=True)
class EdgeQuestion:
    """An edge to score: its relation (index into config.relations, relation id) and its
    sides' rows."""

    relation: int
    rel_id: int
    lhs: Located
    rhs: Located


@dataclasses.dataclass(frozen=True)
class TopQuestion:
    """The k best entities of a side for the other side's entity and a relation."""

    relation: int
    rel_id: int
    other_entity: str  # the type of the entity given
    other: Located


@dataclasses.dataclass(frozen=True)
class NeighborQuery:
    """A neighbours query as asked: an entity by name (entity_type needed only where the name
    is in several types) or an entity vector of entity_type."""

    entity: Optional[str] = None
    entity_type: Optional[str] = None
    vector: Optional[Sequence[float]] = None


@dataclasses.dataclass(frozen=True)
class NeighborQuestion:
    """A neighbours query resolved: the type, and the entity's row (left out of its answer)
    or the vector given."""

    entity: str
    row: Optional[Located]
    vector: Optional[Tuple[float, ...]]


@dataclasses.dataclass(frozen=True)
class Exclusion:
    """Known edges left out of top-k answers: for queries (the other side's partition and
    offset, relation id) the `side` entities of the edges of `paths`."""

    paths: Tuple[str, ...]
    side: str
    other_parts: np.ndarray
    other_ids: np.ndarray
    rel_ids: np.ndarray

    def pick(self, rows: np.ndarray) -> "Exclusion":
        return dataclasses.replace(self, other_parts=self.other_parts[rows],
                                   other_ids=self.other_ids[rows], rel_ids=self.rel_ids[rows])


class Questions:
    """Resolves batches of questions against a model's names; each question gets its typed
    form or its own PbgRayError."""

    def __init__(self, config: ConfigSchema, names: EntityNames, relations: RelationNames) -> None:
        self.config = config
        self.names = names
        self.relations = relations

    def _rows(self, asked: List[Union[List[Asked], PbgRayError]]
              ) -> List[Union[List[Located], PbgRayError]]:
        """Per question the rows of the names it asks for, or its error (its own, or that of
        its first name the type lacks); one lookup for the whole batch."""
        wanted = [a for names in asked if isinstance(names, list) for a in names]
        found = self.names.lookup(wanted)
        errors = self.names.unknown(list(dict.fromkeys(a for a in wanted if a not in found)))
        rows: List[Union[List[Located], PbgRayError]] = []
        for names in asked:
            if isinstance(names, PbgRayError):
                rows.append(names)
                continue
            missing = [a for a in names if a not in found]
            rows.append(errors[missing[0]] if missing else [found[a] for a in names])
        return rows

    def _relations(self, names: Sequence[str]) -> List[Union[Tuple[int, int], PbgRayError]]:
        resolved: List[Union[Tuple[int, int], PbgRayError]] = []
        for name in names:
            try:
                resolved.append(self.relations.resolve(name))
            except PbgRayError as err:
                resolved.append(err)
        return resolved

    def edges(self, triples: Sequence[Triple]) -> List[Union[EdgeQuestion, PbgRayError]]:
        """(lhs name, relation name, rhs name) triples resolved."""
        relations = self._relations([t[1] for t in triples])
        rows = self._rows([r if isinstance(r, PbgRayError) else
                           [(self.config.relations[r[0]].lhs, t[0]),
                            (self.config.relations[r[0]].rhs, t[2])]
                           for t, r in zip(triples, relations)])
        return [found if isinstance(found, PbgRayError) else EdgeQuestion(*r, *found)
                for r, found in zip(relations, rows)]

    def top(self, side: str, queries: Sequence[Tuple[str, str]]
            ) -> List[Union[TopQuestion, PbgRayError]]:
        """(the other side's entity name, relation name) pairs resolved, for ranking `side`."""
        if side not in ("lhs", "rhs"):
            raise ValueError(f"side must be 'lhs' or 'rhs', not {side!r}")
        other = "lhs" if side == "rhs" else "rhs"
        relations = self._relations([q[1] for q in queries])
        types = [r if isinstance(r, PbgRayError) else
                 getattr(self.config.relations[r[0]], other) for r in relations]
        rows = self._rows([t if isinstance(t, PbgRayError) else [(t, q[0])]
                           for t, q in zip(types, queries)])
        return [found if isinstance(found, PbgRayError) else TopQuestion(*r, t, found[0])
                for r, t, found in zip(relations, types, rows)]

    def neighbors(self, queries: Sequence[NeighborQuery]
                  ) -> List[Union[NeighborQuestion, PbgRayError]]:
        """Neighbours queries resolved: by name (the type looked up where not given) or by
        vector (its type given, the type's dimension, finite)."""
        untyped = [q.entity for q in queries if q.entity_type is None and q.entity is not None]
        types = self.names.type_of(untyped) if untyped else {}
        asked: List[Union[List[Asked], PbgRayError]] = []
        for query in queries:
            entity = query.entity_type or types.get(query.entity)
            asked.append(entity if isinstance(entity, PbgRayError) else
                         self._check_neighbor_query(query, entity) or
                         ([(entity, query.entity)] if query.entity is not None else []))
        return [found if isinstance(found, PbgRayError) else
                NeighborQuestion(query.entity_type or types[query.entity],
                                 found[0] if found else None,
                                 None if query.vector is None else tuple(query.vector))
                for query, found in zip(queries, self._rows(asked))]

    def _check_neighbor_query(self, query: NeighborQuery, entity: Optional[str]
                              ) -> Optional[PbgRayError]:
        """The error of a neighbours query wrong on its own, None if it is not."""
        if query.entity_type is not None and query.entity_type not in self.config.entities:
            return PbgRayError(f"unknown entity type {query.entity_type!r}"
                               f"{did_you_mean(query.entity_type, self.config.entities)}.")
        if (query.vector is None) == (query.entity is None):
            return PbgRayError("a neighbours query gives either entity (a name) or vector.")
        if query.vector is None:
            return None
        if entity is None:
            return PbgRayError("a neighbours query by vector needs entity_type.")
        dim = self.config.entity_dimension(entity)
        if len(query.vector) != dim or not np.isfinite(query.vector).all():
            return PbgRayError(f"vector has {len(query.vector)} values; {entity} embeddings "
                               f"have {dim}, all finite.")
        return None


class ModelByNames:
    """A checkpoint's model parameters (as a Scorer) with its entity and relation names and
    the resolution of questions: what Predictor and the service's router share."""

    def __init__(self, config: ConfigSchema, arrays: Dict[str, np.ndarray], where: str,
                 names: EntityNames) -> None:
        """arrays: the model's parameters by public name; where: what they were loaded from
        (for messages)."""
        check_rankable(config)
        self.config = config
        self.source = where
        self.params = params_from_checkpoint(config, num_relation_ids(config), arrays, None,
                                             where=where).arrays
        self.scorer = Scorer(config, self.params)
        self.entity_names = names
        self.relations = RelationNames(config)
        self.questions = Questions(config, names, self.relations)


def by_key(answers: Sequence[Any], key: Callable[[Any], Any]) -> List[Tuple[Any, List[int]]]:
    """The resolved questions among a batch's `answers` (errors left out), grouped by
    key(question): (key, their indexes), in the order of first appearance."""
    groups: Dict[Any, List[int]] = {}
    for i, question in enumerate(answers):
        if not isinstance(question, PbgRayError):
            groups.setdefault(key(question), []).append(i)
    return list(groups.items())


def first_error(answers: Sequence[Union[Q, PbgRayError]]) -> List[Q]:
    """The answers, raising the first question's error (the Python API's way)."""
    for answer in answers:
        if isinstance(answer, PbgRayError):
            raise answer
    return list(answers)  # type: ignore[arg-type]


def edge_scores(scorer: Scorer, relation: int, rel_ids: Tensor, lhs: Tensor, rhs: Tensor
                ) -> Tensor:
    """Scores [B] of edges of one relation (index into config.relations) from their sides'
    entity vectors [B, D] (Scorer.entity_vectors): the rhs side's score."""
    query = scorer.queries("rhs", relation, rel_ids, lhs)
    return scorer.pos(query, scorer.candidates("rhs", relation, rhs))


def prepared_queries(scorer: Scorer, side: str, relations: np.ndarray, rel_ids: np.ndarray,
                     vectors: Tensor) -> Tensor:
    """Prepared queries [B, D] ranking `side` from the other side's entity vectors [B, D]
    (relations: indexes into config.relations, rel_ids: relation ids, [B])."""
    prepared = torch.empty_like(vectors)
    for relation in np.unique(relations):
        pick = np.flatnonzero(relations == relation)
        prepared[torch.from_numpy(pick)] = scorer.queries(
            side, int(relation), torch.from_numpy(rel_ids[pick]), vectors[torch.from_numpy(pick)])
    return prepared


def neighbor_queries(scorer: Scorer, entity: str, group: Sequence[NeighborQuestion],
                     named: Optional[Tensor]) -> Tuple[np.ndarray, np.ndarray]:
    """(prepared queries [B, D], own entity (partition, offset) [B, 2], -1 for vectors) of
    one type's neighbours questions; named: the entity vectors of those asked by name, in
    their order (None if none is)."""
    dim = scorer.config.entity_dimension(entity)
    vectors = torch.tensor([q.vector or [0.0] * dim for q in group], dtype=torch.float32)
    if named is not None:
        vectors[[i for i, q in enumerate(group) if q.row is not None]] = named
    own = np.array([q.row or (-1, -1) for q in group], np.int64)
    return scorer.comparator.prepare(vectors)[0].numpy(), own


def left_out(known: Callable[[str, Bucket], KnownEdges], part: int, count: int,
             exclusion: Optional[Exclusion], own: Optional[np.ndarray]) -> List[np.ndarray]:
    """Per query of `count`, the offsets in candidate partition `part` left out of its
    answer: the query's own entity (own: its (partition, offset) [count, 2], neighbours')
    and the true entities of the known edges of the exclusion's paths. known(path, bucket):
    a bucket's edges of an edge path."""
    banned = [np.empty(0, np.int64) for _ in range(count)]
    if own is not None:
        banned = [np.array([o]) if p == part else b for (p, o), b in zip(own, banned)]
    if exclusion is None or not exclusion.paths:
        return banned
    for other_part in np.unique(exclusion.other_parts):
        mine = np.flatnonzero(exclusion.other_parts == other_part)
        bucket = (Bucket(int(other_part), part) if exclusion.side == "rhs"
                  else Bucket(part, int(other_part)))
        for path in exclusion.paths:
            rows, ids = known(path, bucket).true_entities(
                exclusion.side, exclusion.other_ids[mine], exclusion.rel_ids[mine])
            for r in np.unique(rows):
                banned[mine[r]] = np.concatenate([banned[mine[r]], ids[rows == r]])
    return banned


def exact_top_k(scorer: Scorer, queries: Tensor, candidates: Tensor, k: int,
                banned: Sequence[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """The k best of prepared candidates [N, D] for prepared queries [B, D], every candidate
    scored: scores float32 [B, min(k, N)] (-inf past the end) and offsets int64 (-1 there);
    banned: per query the offsets left out."""
    kk = min(k, len(candidates))
    scores = np.full((len(queries), kk), -np.inf, np.float32)
    offsets = np.full((len(queries), kk), -1, np.int64)
    for start in range(0, len(queries) if kk else 0, QUERY_BLOCK):
        block = scorer.matrix(queries[start:start + QUERY_BLOCK], candidates)
        for i, ids in enumerate(banned[start:start + QUERY_BLOCK]):
            block[i, torch.from_numpy(ids)] = -float("inf")
        top = torch.topk(block, kk, dim=1)
        scores[start:start + len(block)] = top.values.numpy()
        offsets[start:start + len(block)] = top.indices.numpy()
    offsets[scores == -np.inf] = -1
    return scores, offsets


@dataclasses.dataclass
class Best:
    """The best hits so far of each query over the partitions merged: scores [B, <=k], best
    first (ties: the lower partition, then the lower offset), and where they are."""

    scores: np.ndarray
    parts: np.ndarray
    offsets: np.ndarray

    @classmethod
    def none(cls, count: int) -> "Best":
        return cls(np.full((count, 0), -np.inf, np.float32), np.zeros((count, 0), np.int64),
                   np.zeros((count, 0), np.int64))

    def merge(self, hits: Sequence[Tuple[int, np.ndarray, np.ndarray]], k: int) -> "Best":
        """These and partitions' hits ((partition, scores, offsets), exact_top_k's), the k
        best kept: one sort however many partitions come at once, and a caller that merges
        each partition as it comes holds k per query, never a partition's scores."""
        scores = np.concatenate([self.scores] + [s for _, s, _ in hits], axis=1)
        parts = np.concatenate([self.parts] + [np.full_like(o, part) for part, _, o in hits],
                               axis=1)
        offsets = np.concatenate([self.offsets] + [o for _, _, o in hits], axis=1)
        order = np.lexsort((offsets, parts, -scores), axis=1)[:, :k]
        return Best(np.take_along_axis(scores, order, 1), np.take_along_axis(parts, order, 1),
                    np.take_along_axis(offsets, order, 1))

    def ranked(self, names: EntityNames, entity: str) -> List[Ranked]:
        """Each query's hits (name, score), without the -inf ones; each partition's names
        read once."""
        kept = self.scores > -np.inf
        named = np.empty(self.scores.shape, object)
        for part in np.unique(self.parts[kept]):
            pick = kept & (self.parts == part)
            named[pick] = names.partition(entity, int(part)).take(self.offsets[pick])
        return [[Hit(str(n), float(v)) for n, v in zip(named[row][kept[row]],
                                                       self.scores[row][kept[row]])]
                for row in range(len(self.scores))]
