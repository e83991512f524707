"""Requests by names answered from a checkpoint version's model and its shards: the
questions resolved (pbg_ray.evaluation.questions, as Predictor and the predict command
resolve them), the rows of the entities named fetched from the shards, the shards' hits
merged into the best k with names."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.evaluation.entity_names import EntityNames, Located, Recent
from pbg_ray.evaluation.questions import (
    Answer, Best, Exclusion, ModelByNames, NeighborQuery, Ranked, Triple, by_key,
    edge_scores, neighbor_queries, prepared_queries)
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.serving.index import set_relation, shard_of


ROW_CACHE = 65536  # rows of query entities the router keeps (per version)


# The shards, as the router reaches them: rows(entity, part, offsets) -> raw rows, and
# search(entity, parts, relation, queries, k, exact, exclusion, rows) -> [(scores, offsets)
# per part] (ShardTables.search_group), both awaitable.
RowsFn = Callable[[str, int, np.ndarray], Awaitable[np.ndarray]]
SearchFn = Callable[..., Awaitable[List[Tuple[np.ndarray, np.ndarray]]]]


class ServingModel(ModelByNames):
    """Requests by names answered from a checkpoint version's model and its shards."""

    def __init__(self, config: ConfigSchema, version: Optional[int],
                 previous: Optional["ServingModel"] = None) -> None:
        """The model of `version` (None: the newest); the names are read now, or taken
        from `previous` (the version served before) when the entity counts are the same."""
        checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
            config, version, "serve.version", best=False)
        where = f"version {version} of {str(checkpoint.path)!r}"
        self.counts = load_entity_counts(config)
        names = (previous.entity_names if previous is not None and previous.counts == self.counts
                 else EntityNames(config, None, self.counts, where))
        super().__init__(config, checkpoint.read_model(version)[0], where, names)
        self.version = version
        self._rows = Recent(ROW_CACHE)
        for entity in config.entities:
            names.read(entity)

    def check(self, k: int, batch: Sequence[Any]) -> None:
        serve = self.config.serve
        if not 1 <= k <= serve.max_k:
            raise PbgRayError(f"k={k} is out of range: ask for 1 to {serve.max_k} "
                              "(serve.max_k) results.")
        if not 1 <= len(batch) <= serve.max_batch:
            raise PbgRayError(f"{len(batch)} queries in one request: send 1 to "
                              f"{serve.max_batch} (serve.max_batch).")

    def check_exclude(self, paths: Sequence[str]) -> Tuple[str, ...]:
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
        return tuple(found)

    def metadata(self) -> Dict[str, Any]:
        config = self.config
        return {
            "version": self.version,
            "entity_types": {e: {"count": sum(self.counts[e]), "partitions": len(self.counts[e]),
                                 "dimension": config.entity_dimension(e)}
                             for e in config.entities},
            "relations": [{"name": name, **{k: getattr(config.relations[r], k)
                                            for k in ("lhs", "rhs", "operator")}}
                          for name, (r, _) in ((n, self.relations.resolve(n))
                                               for n in self.relations.names)],
            "dimension": config.dimension, "comparator": config.comparator,
            "index": config.serve.index, "shard_groups": config.serve.shard_groups,
        }

    async def _vectors(self, rows: RowsFn, entity: str, located: Sequence[Located]) -> Tensor:
        """Entity vectors [B, D] (Scorer.entity_vectors) of (partition, offset) pairs; the
        rows come from the shards, the ROW_CACHE used last are kept."""
        missing = sorted(key for key in {(entity, p, o) for p, o in located}
                         if key not in self._rows)
        parts = np.array([p for _, p, _ in missing])
        offsets = np.array([o for _, _, o in missing])
        fetched = await asyncio.gather(*(rows(entity, int(p), offsets[parts == p])
                                         for p in np.unique(parts)))
        for p, values in zip(np.unique(parts), fetched):
            for o, row in zip(offsets[parts == p], values):
                self._rows.put((entity, int(p), int(o)), row)
        out = np.stack([self._rows[entity, p, o] for p, o in located])
        return self.scorer.entity_vectors(entity, torch.from_numpy(out))

    async def score(self, rows: RowsFn, edges: Sequence[Triple]) -> List[Answer]:
        """The scores of (lhs, relation, rhs) name triples (as Predictor.score); an edge
        with an unknown name gets its PbgRayError instead."""
        self.check(1, edges)
        answers: List[Any] = list(self.questions.edges(edges))
        for relation, idx in by_key(answers, lambda q: q.relation):
            group = [answers[i] for i in idx]
            rconf = self.config.relations[relation]
            scores = edge_scores(self.scorer, relation, torch.tensor([q.rel_id for q in group]),
                                 await self._vectors(rows, rconf.lhs, [q.lhs for q in group]),
                                 await self._vectors(rows, rconf.rhs, [q.rhs for q in group]))
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
        answers: List[Any] = list(self.questions.top(side, queries))
        for relation, idx in by_key(answers, lambda q: q.relation):
            group = [answers[i] for i in idx]
            relations = np.full(len(group), relation, np.int64)
            rel_ids = np.array([q.rel_id for q in group], np.int64)
            vectors = await self._vectors(rows, group[0].other_entity, [q.other for q in group])
            prepared = prepared_queries(self.scorer, side, relations, rel_ids, vectors).numpy()
            other = np.array([q.other for q in group], np.int64)
            exclusion = Exclusion(paths, side, other[:, 0], other[:, 1], rel_ids) if paths else None
            ranked = await self._search(search, getattr(self.config.relations[relation], side),
                                        set_relation(self.scorer, side, relation), prepared, k,
                                        exact, exclusion, None)
            for i, answer in zip(idx, ranked):
                answers[i] = answer
        return answers

    async def neighbors(self, rows: RowsFn, search: Callable[[int], SearchFn],
                        queries: Sequence[NeighborQuery], k: int, exact: bool = False
                        ) -> List[Answer]:
        """The k entities nearest (by the comparator, as Predictor.neighbors) to each
        query's entity (itself left out) or vector (global embedding included); a query
        that is wrong on its own (an unknown name, a vector of the wrong length) gets its
        PbgRayError instead. The queries of one type share one search."""
        self.check(k, queries)
        answers: List[Any] = list(self.questions.neighbors(queries))
        for entity, idx in by_key(answers, lambda q: q.entity):
            group = [answers[i] for i in idx]
            by_name = [q.row for q in group if q.row is not None]
            prepared, own = neighbor_queries(self.scorer, entity, group,
                                             await self._vectors(rows, entity, by_name) if by_name else None)
            ranked = await self._search(search, entity, None, prepared, k, exact, None, own)
            for i, answer in zip(idx, ranked):
                answers[i] = answer
        return answers

    async def _search(self, search: Callable[[int], SearchFn], entity: str,
                      relation: Optional[int], queries: np.ndarray, k: int, exact: bool,
                      exclusion: Optional[Exclusion], own: Optional[np.ndarray]) -> List[Ranked]:
        """Every partition of `entity` searched by its shard group (one call per group),
        the hits merged into the k best per query (Best), with names. own: per query the
        (partition, offset) [B, 2] of an entity left out of its answer."""
        groups: Dict[int, List[int]] = {}
        for part in range(len(self.counts[entity])):
            groups.setdefault(shard_of(part, self.config.serve), []).append(part)
        answered = await asyncio.gather(*(search(group)(entity, parts, relation, queries, k,
                                                        exact, exclusion, own)
                                          for group, parts in groups.items()))
        hits = [(part, scores, offsets) for parts, found in zip(groups.values(), answered)
                for part, (scores, offsets) in zip(parts, found)]
        return Best.none(len(queries)).merge(hits, k).ranked(self.entity_names, entity)
