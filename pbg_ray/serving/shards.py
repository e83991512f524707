"""A shard group's partitions of a checkpoint version (their candidate sets and indexes) and
their top-k search, exact or approximate: approximate hits are rescored exactly with the
comparator, so every score returned is the model's own; only which candidates make the top
k may differ from exact search."""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.filtered import KnownEdges
from pbg_ray.io.edges import read_edges
from pbg_ray.serving.index import (
    SetKey, adjoint_queries, candidate_vectors, index_file, index_kind, set_keys, shard_of,
    shares_index, version_scorer)
from pbg_ray.io.entities import num_relation_ids
from pbg_ray.types import Bucket


@dataclasses.dataclass
class CandidateSet:
    vectors: Tensor  # prepared candidates [N, D]
    index: Any  # the faiss index, None: exact search


class ShardTables:
    """The candidate sets of one shard group's partitions of a checkpoint version, and
    their top-k search."""

    def __init__(self, config: ConfigSchema, version: int, shard: int) -> None:
        import faiss

        self.config = config
        self.version = version
        checkpoint = CheckpointManager(config.checkpoint_path)
        self.scorer = version_scorer(config, version)
        self.num_relations = num_relation_ids(config)
        self.tables: Dict[Tuple[str, int], Tensor] = {}
        self.sets: Dict[SetKey, CandidateSet] = {}
        for key in set_keys(config, shard):
            entity, part, relation = key
            if (entity, part) not in self.tables:
                self.tables[entity, part] = torch.from_numpy(
                    checkpoint.read_partition(version, entity, part)[0])
            vectors = candidate_vectors(self.scorer, entity, self.tables[entity, part], relation)
            kind = index_kind(config, len(vectors))
            index = None
            if kind != "exact" and not shares_index(config, key):
                path = index_file(config, version, key, kind)
                index = faiss.deserialize_index(np.frombuffer(path.read_bytes(), np.uint8))
                if kind == "hnsw":
                    index.hnsw.efSearch = config.serve.hnsw_ef_search
                else:
                    index.nprobe = config.serve.ivf_probes
            self.sets[key] = CandidateSet(vectors, index)
        self._known: Dict[Tuple[str, Bucket], KnownEdges] = {}

    def rows(self, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        """Raw embeddings [len(offsets), D] of a partition."""
        return self.tables[entity, part][torch.from_numpy(np.asarray(offsets, np.int64))].numpy()

    def known(self, path: str, bucket: Bucket) -> KnownEdges:
        """The edges of a bucket of an edge path (the last few buckets kept)."""
        if (path, bucket) not in self._known:
            if len(self._known) >= 64:
                self._known.pop(next(iter(self._known)))
            self._known[path, bucket] = KnownEdges(read_edges(path, bucket), self.num_relations)
        return self._known[path, bucket]

    def banned(self, key: SetKey, num: int, exclude: Optional[Dict[str, Any]],
               skip: Optional[np.ndarray]) -> List[np.ndarray]:
        """Per query, the offsets left out of the answer: `skip` [B] (-1: none) and the
        true entities of the known edges of exclude's edge paths."""
        banned = [np.empty(0, np.int64) for _ in range(num)]
        if skip is not None:
            banned = [np.array([s]) if s >= 0 else b for s, b in zip(skip, banned)]
        if exclude:
            side, part = exclude["side"], key[1]
            for other_part in set(exclude["other_parts"]):
                mine = np.flatnonzero(np.asarray(exclude["other_parts"]) == other_part)
                bucket = Bucket(other_part, part) if side == "rhs" else Bucket(part, other_part)
                for path in exclude["paths"]:
                    rows, ids = self.known(path, bucket).true_entities(
                        side, np.asarray(exclude["other_ids"])[mine],
                        np.asarray(exclude["rel_ids"])[mine])
                    for r in np.unique(rows):
                        banned[mine[r]] = np.concatenate([banned[mine[r]], ids[rows == r]])
        return banned

    def search(self, key: SetKey, queries: np.ndarray, k: int, exact: bool = False,
               exclude: Optional[Dict[str, Any]] = None, skip: Optional[np.ndarray] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The k best candidates of set `key` for prepared queries [B, D]: scores float32
        [B, k] (-inf past the end) and offsets int64 [B, k] (-1 there). exclude: {paths,
        side, other_parts, other_ids, rel_ids} (known edges left out); skip: an offset per
        query left out (-1: none)."""
        cands = self.sets[key]
        q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
        banned = self.banned(key, len(q), exclude, skip)
        n = len(cands.vectors)
        index, probe = cands.index, q
        if shares_index(self.config, key):
            index = self.sets[key[0], key[1], None].index
            probe = adjoint_queries(self.scorer, key[2], q)
        if exact or index is None:
            scores = self.scorer.matrix(q, cands.vectors)
            for i, ids in enumerate(banned):
                scores[i, torch.from_numpy(ids)] = -float("inf")
            top = torch.topk(scores, min(k, n), dim=1)
            values, offsets = top.values, top.indices
        else:
            wanted = min(n, k + max(len(b) for b in banned))
            if hasattr(index, "hnsw"):
                index.hnsw.efSearch = max(self.config.serve.hnsw_ef_search, wanted)
            _, hits = index.search(np.ascontiguousarray(probe.numpy()), wanted)
            offsets = torch.from_numpy(hits)
            found = cands.vectors[offsets.clamp_min(0)]
            # The comparator's exact scores of the hits: [B, 1, D] x [B, wanted, D].
            values = self.scorer.comparator.matrix(q.unsqueeze(1), found)[:, 0]
            values[offsets < 0] = -float("inf")
            for i, ids in enumerate(banned):
                values[i, torch.from_numpy(np.isin(hits[i], ids))] = -float("inf")
            top = torch.topk(values, min(k, wanted), dim=1)
            values, offsets = top.values, offsets.gather(1, top.indices)
        offsets = offsets.clone()
        offsets[values == -float("inf")] = -1
        return values.numpy(), offsets.numpy()

    def search_group(self, entity: str, parts: Sequence[int], relation: Optional[int],
                     queries: np.ndarray, k: int, exact: bool = False,
                     exclude: Optional[Dict[str, Any]] = None,
                     skip: Optional[Tuple[int, int]] = None
                     ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """search() of the sets (entity, part, relation) of `parts` (this shard group's),
        as one call: a request reaches each shard group once. skip: the (partition,
        offset) of an entity left out of every query's answer."""
        return [self.search((entity, part, relation), queries, k, exact, exclude,
                            None if skip is None else
                            np.full(len(queries), skip[1] if skip[0] == part else -1))
                for part in parts]




def in_process_shards(config: ConfigSchema, version: int
                      ) -> Tuple[Callable[..., Awaitable[np.ndarray]], Callable[[int], Callable]]:
    """Every shard group of `version` in this process, as the router reaches them through
    Ray Serve: (rows(entity, part, offsets), search(group)(...)), what ServingModel's
    queries take. For the Python API and for measuring the service without Serve."""
    shards = [ShardTables(config, version, g) for g in range(config.serve.shard_groups)]

    async def rows(entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        return shards[shard_of(part, config.serve)].rows(entity, part, offsets)

    def search(group: int) -> Callable:
        async def call(*args: Any) -> Any:
            return shards[group].search_group(*args)
        return call

    return rows, search
