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
from pbg_ray.evaluation.questions import Exclusion, exact_top_k, left_out
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

    def search(self, key: SetKey, queries: np.ndarray, k: int, exact: bool = False,
               exclusion: Optional[Exclusion] = None, own: Optional[np.ndarray] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The k best candidates of set `key` for prepared queries [B, D]: scores float32
        [B, k] (-inf past the end) and offsets int64 [B, k] (-1 there), as exact_top_k's;
        exclusion, own: what left_out leaves out."""
        cands = self.sets[key]
        q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
        banned = left_out(self.known, key[1], len(q), exclusion, own)
        index, probe = cands.index, q
        if shares_index(self.config, key):
            index = self.sets[key[0], key[1], None].index
            probe = adjoint_queries(self.scorer, key[2], q)
        if exact or index is None:
            return exact_top_k(self.scorer, q, cands.vectors, k, banned)
        wanted = min(len(cands.vectors), k + max(len(b) for b in banned))
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
        offsets[values == -float("inf")] = -1
        return values.numpy(), offsets.numpy()

    def search_group(self, entity: str, parts: Sequence[int], relation: Optional[int],
                     queries: np.ndarray, k: int, exact: bool = False,
                     exclusion: Optional[Exclusion] = None, own: Optional[np.ndarray] = None
                     ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """search() of the sets (entity, part, relation) of `parts` (this shard group's),
        as one call: a request reaches each shard group once. own: per query the
        (partition, offset) [B, 2] of an entity left out of its answer."""
        return [self.search((entity, part, relation), queries, k, exact, exclusion, own)
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
