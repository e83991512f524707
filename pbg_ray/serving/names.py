"""Requests by names answered from a checkpoint version's model and its shards: names to
rows, the queries' vectors, the shards' hits merged into the best k with names."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.evaluation.filtered import check_rankable
from pbg_ray.evaluation.predictor import relation_by_name
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.entities import (
    load_entity_counts, load_entity_names, load_relation_names, num_relation_ids)
from pbg_ray.model.params import params_from_checkpoint
from pbg_ray.serving.index import set_relation, shard_of


Ranked = List[Tuple[str, float]]  # (entity name, score), best first


# One query's answer in a batch, or the error that query alone has (an unknown name, say).
Answer = Union[Ranked, float, PbgRayError]


ROW_CACHE = 65536  # rows of query entities the router keeps (per version)


SUGGESTIONS = 64  # names near an unknown one (in sorted order) that "did you mean" weighs


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
        # Per entity type: name -> row over all partitions (str and int only: a dict the
        # garbage collector never scans), each partition's first row, the names sorted.
        self._index: Dict[str, Dict[str, int]] = {}
        self._starts: Dict[str, np.ndarray] = {}
        self._sorted: Dict[str, List[str]] = {}

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

    def _name_index(self, entity: str) -> Dict[str, int]:
        """name -> row of an entity type over all its partitions, built on first use."""
        if entity not in self._index:
            names = self.names(entity)
            self._index[entity] = {n: i for i, n in enumerate(itertools.chain(*names))}
            self._starts[entity] = np.cumsum([0] + [len(part) for part in names])
        return self._index[entity]

    def _suggest(self, name: str, entities: Sequence[str]) -> str:
        """did_you_mean among the names of `entities` that sort next to `name` (a scan of
        millions of names per bad request would stall the service)."""
        near = []
        for entity in entities:
            if entity not in self._sorted:
                self._sorted[entity] = sorted(self._name_index(entity))
            names = self._sorted[entity]
            at = bisect.bisect_left(names, name)
            near += names[max(0, at - SUGGESTIONS // 2):at + SUGGESTIONS // 2]
        return did_you_mean(name, near)

    def _locate(self, entity: str, name: str) -> Tuple[int, int]:
        """(partition, offset) of an entity by name; an entity of another type is named
        as such (the wrong side of a relation)."""
        row = self._name_index(entity).get(name)
        if row is None:
            elsewhere = [e for e in self.config.entities
                         if e != entity and name in self._name_index(e)]
            if elsewhere:
                raise PbgRayError(f"{name!r} is an entity of type {elsewhere[0]!r}, not of type "
                                  f"{entity!r}: check the relation and which side the name "
                                  "is on.")
            raise PbgRayError(f"unknown {entity} entity {name!r}"
                              f"{self._suggest(name, [entity])}.")
        part = int(np.searchsorted(self._starts[entity], row, side="right")) - 1
        return part, row - int(self._starts[entity][part])

    def _relation(self, name: str) -> Tuple[int, int]:
        """(index into config.relations, relation id) of a relation by name."""
        return relation_by_name(self.config, self.relation_names, name)

    def _type_of(self, name: str) -> str:
        found = [entity for entity in self.config.entities if name in self._name_index(entity)]
        if len(found) != 1:
            raise PbgRayError(f"entity {name!r} " + (
                f"is in several types {found}; pass entity_type." if found
                else f"is unknown{self._suggest(name, list(self.config.entities))}."))
        return found[0]


# The shards, as the router reaches them: rows(entity, part, offsets) -> raw rows, and
# search(entity, parts, relation, queries, k, exact, exclude, skip) -> [(scores, offsets)
# per part] (ShardTables.search_group), both awaitable.
RowsFn = Callable[[str, int, np.ndarray], Awaitable[np.ndarray]]
SearchFn = Callable[..., Awaitable[List[Tuple[np.ndarray, np.ndarray]]]]


@dataclasses.dataclass
class TopQuery:
    relation: int  # index into config.relations
    rel_id: int
    other_entity: str  # the type of the entity given
    part: int
    offset: int


def per_query(queries: Sequence[Any], resolve: Callable[[Any], Any]
              ) -> Tuple[List[Optional[PbgRayError]], Dict[int, Any]]:
    """Each query of a batch resolved on its own (names to rows, relation names to ids):
    (the answers so far: the PbgRayError of each query that failed, None elsewhere;
    {index: resolve(query)} of the others)."""
    answers: List[Optional[PbgRayError]] = []
    resolved: Dict[int, Any] = {}
    for i, query in enumerate(queries):
        try:
            resolved[i] = resolve(query)
            answers.append(None)
        except PbgRayError as err:
            answers.append(err)
    return answers, resolved


class ServingModel(NamedModel):
    """Requests by names answered from a checkpoint version's model and its shards."""

    def __init__(self, config: ConfigSchema, version: Optional[int],
                 previous: Optional["ServingModel"] = None) -> None:
        """The model of `version` (None: the newest); the names are read now, or taken
        from `previous` (the version served before) when the entity counts are the same."""
        checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
            config, version, "serve.version")
        super().__init__(config, checkpoint.read_model(version)[0],
                         load_entity_counts(config), f"version {version} of "
                         f"{str(checkpoint.path)!r}")
        self.version = version
        self._rows: "OrderedDict[Tuple[str, int, int], np.ndarray]" = OrderedDict()
        if previous is not None and previous.counts == self.counts:
            self._names, self._index = previous._names, previous._index
            self._starts, self._sorted = previous._starts, previous._sorted
        for entity in config.entities:
            self._name_index(entity)

    def check(self, k: int, batch: Sequence[Any]) -> None:
        serve = self.config.serve
        if not 1 <= k <= serve.max_k:
            raise PbgRayError(f"k={k} is out of range: ask for 1 to {serve.max_k} "
                              "(serve.max_k) results.")
        if not 1 <= len(batch) <= serve.max_batch:
            raise PbgRayError(f"{len(batch)} queries in one request: send 1 to "
                              f"{serve.max_batch} (serve.max_batch).")

    def check_exclude(self, paths: Sequence[str]) -> List[str]:
        """Edge paths a request may exclude: those of the config, by path or last name."""
        known = list(self.config.edge_paths) + list(self.config.eval_edge_paths)
        by_name = {p.rstrip("/").rsplit("/", 1)[-1]: p for p in known}
        found = []
        for path in paths:
            if path not in known and path not in by_name:
                raise PbgRayError(f"exclude: {path!r} is not an edge path of the served config"
                                  f"{did_you_mean(path, list(by_name) + known)}. Edge paths: "
                                  f"{', '.join(known)}.")
            found.append(by_name.get(path, path))
        return found

    def metadata(self) -> Dict[str, Any]:
        config = self.config
        return {
            "version": self.version,
            "entity_types": {e: {"count": sum(self.counts[e]), "partitions": len(self.counts[e]),
                                 "dimension": config.entity_dimension(e)}
                             for e in config.entities},
            "relations": [{"name": name, **{k: getattr(config.relations[r], k)
                                            for k in ("lhs", "rhs", "operator")}}
                          for name, (r, _) in ((n, self._relation(n))
                                               for n in self.relation_names)],
            "dimension": config.dimension, "comparator": config.comparator,
            "index": config.serve.index, "shard_groups": config.serve.shard_groups,
        }

    async def _vectors(self, rows: RowsFn, entity: str, located: List[Tuple[int, int]]
                       ) -> Tensor:
        """Entity vectors [B, D] (Scorer.entity_vectors) of (partition, offset) pairs; the
        rows come from the shards, the last ROW_CACHE fetched are kept."""
        missing = sorted({(entity, p, o) for p, o in located} - set(self._rows))
        parts = np.array([p for _, p, _ in missing])
        offsets = np.array([o for _, _, o in missing])
        fetched = await asyncio.gather(*(rows(entity, int(p), offsets[parts == p])
                                         for p in np.unique(parts)))
        for p, values in zip(np.unique(parts), fetched):
            for o, row in zip(offsets[parts == p], values):
                self._rows[entity, int(p), int(o)] = row
        while len(self._rows) > ROW_CACHE:
            self._rows.popitem(last=False)
        out = np.stack([self._rows[entity, p, o] for p, o in located])
        return self.scorer.entity_vectors(entity, torch.from_numpy(out))

    async def score(self, rows: RowsFn, edges: Sequence[Tuple[str, str, str]]
                    ) -> List[Answer]:
        """The scores of (lhs, relation, rhs) name triples (as Predictor.score); an edge
        with an unknown name gets its PbgRayError instead."""
        self.check(1, edges)

        def resolve(edge: Tuple[str, str, str]) -> Tuple[int, int, Tuple[int, int],
                                                           Tuple[int, int]]:
            relation, rel_id = self._relation(edge[1])
            rconf = self.config.relations[relation]
            return (relation, rel_id, self._locate(rconf.lhs, edge[0]),
                    self._locate(rconf.rhs, edge[2]))

        answers, resolved = per_query(edges, resolve)
        for relation in sorted({r[0] for r in resolved.values()}):
            idx = [i for i, r in resolved.items() if r[0] == relation]
            rconf = self.config.relations[relation]
            lhs = await self._vectors(rows, rconf.lhs, [resolved[i][2] for i in idx])
            rhs = await self._vectors(rows, rconf.rhs, [resolved[i][3] for i in idx])
            rel_ids = torch.tensor([resolved[i][1] for i in idx])
            query = self.scorer.queries("rhs", relation, rel_ids, lhs)
            scores = self.scorer.pos(query, self.scorer.candidates("rhs", relation, rhs))
            for i, score in zip(idx, scores.tolist()):
                answers[i] = score
        return answers

    async def top(self, rows: RowsFn, search: Callable[[int], SearchFn], side: str,
                  queries: Sequence[Tuple[str, str]], k: int, exclude: Sequence[str] = (),
                  exact: bool = False) -> List[Answer]:
        """The k best `side` entities for (given name, relation name) pairs (the given
        entity is the other side's); a query with an unknown name gets its PbgRayError
        instead. exclude: edge paths whose known edges are left out. search(shard group)
        reaches a shard."""
        self.check(k, queries)
        paths = self.check_exclude(exclude)
        other = "lhs" if side == "rhs" else "rhs"

        def resolve(query: Tuple[str, str]) -> TopQuery:
            relation, rel_id = self._relation(query[1])
            entity = getattr(self.config.relations[relation], other)
            return TopQuery(relation, rel_id, entity, *self._locate(entity, query[0]))

        answers, resolved = per_query(queries, resolve)
        for relation in sorted({q.relation for q in resolved.values()}):
            idx = [i for i, q in resolved.items() if q.relation == relation]
            group = [resolved[i] for i in idx]
            rconf = self.config.relations[relation]
            vectors = await self._vectors(rows, group[0].other_entity,
                                          [(q.part, q.offset) for q in group])
            rel_ids = torch.tensor([q.rel_id for q in group])
            prepared = self.scorer.queries(side, relation, rel_ids, vectors).numpy()
            known = {"paths": paths, "side": side, "other_parts": [q.part for q in group],
                     "other_ids": [q.offset for q in group],
                     "rel_ids": [q.rel_id for q in group]} if paths else None
            ranked = await self._search(search, getattr(rconf, side),
                                        set_relation(self.scorer, side, relation), prepared, k,
                                        exact, known, None)
            for i, answer in zip(idx, ranked):
                answers[i] = answer
        return answers

    def _neighbor_query(self, query: Dict[str, Any]
                        ) -> Tuple[str, Optional[List[float]], Optional[Tuple[int, int]]]:
        """(entity type, vector, (partition, offset)) of a neighbours query: {"entity":
        name, "entity_type": type or None} (vector None) or {"vector": [D floats],
        "entity_type": type} (partition and offset None)."""
        entity = query.get("entity_type")
        if entity is not None and entity not in self.config.entities:
            raise PbgRayError(f"unknown entity type {entity!r}"
                              f"{did_you_mean(entity, self.config.entities)}.")
        if (query.get("vector") is None) == (query.get("entity") is None):
            raise PbgRayError("a neighbours query gives either entity (a name) or vector.")
        if query.get("vector") is None:
            entity = entity or self._type_of(query["entity"])
            return entity, None, self._locate(entity, query["entity"])
        if entity is None:
            raise PbgRayError("a neighbours query by vector needs entity_type.")
        dim = self.config.entity_dimension(entity)
        if len(query["vector"]) != dim or not np.isfinite(query["vector"]).all():
            raise PbgRayError(f"vector has {len(query['vector'])} values; {entity} "
                              f"embeddings have {dim}, all finite.")
        return entity, query["vector"], None

    async def neighbors(self, rows: RowsFn, search: Callable[[int], SearchFn],
                        queries: Sequence[Dict[str, Any]], k: int, exact: bool = False
                        ) -> List[Answer]:
        """The k entities nearest (by the comparator, as Predictor.neighbors) to each
        query (_neighbor_query: an entity by name, itself left out, or an entity vector,
        global embedding included); a query that is wrong on its own (an unknown name,
        a vector of the wrong length) gets its PbgRayError instead."""
        self.check(k, queries)
        answers, resolved = per_query(queries, self._neighbor_query)
        for i, (entity, vector, located) in resolved.items():
            # each its own type; a batch of one type could share a search
            if located is None:
                query = torch.tensor([vector], dtype=torch.float32)
            else:
                query = await self._vectors(rows, entity, [located])
            prepared = self.scorer.comparator.prepare(query)[0].numpy()
            answers[i] = (await self._search(search, entity, None, prepared, k, exact, None,
                                             located))[0]
        return answers

    async def _search(self, search: Callable[[int], SearchFn], entity: str,
                      relation: Optional[int], queries: np.ndarray, k: int, exact: bool,
                      known: Optional[Dict[str, Any]], skip: Optional[Tuple[int, int]]
                      ) -> List[Ranked]:
        """Every partition of `entity` searched by its shard group (one call per group),
        the hits merged into the k best per query, with names."""
        groups: Dict[int, List[int]] = {}
        for part in range(len(self.counts[entity])):
            groups.setdefault(shard_of(part, self.config.serve), []).append(part)
        answered = await asyncio.gather(*(search(group)(entity, parts, relation, queries, k,
                                                        exact, known, skip)
                                          for group, parts in groups.items()))
        parts = [part for group in groups.values() for part in group]
        found = [pair for pairs in answered for pair in pairs]
        scores = np.concatenate([s for s, _ in found], axis=1)
        where = [(part, o) for part, (_, offsets) in zip(parts, found) for o in offsets.T]
        names = self.names(entity)
        answers = []
        for i, row in enumerate(scores):
            best = np.argsort(-row, kind="stable")[:k]
            answers.append([(names[where[j][0]][int(where[j][1][i])], float(row[j]))
                            for j in best if row[j] != -np.inf])
        return answers
