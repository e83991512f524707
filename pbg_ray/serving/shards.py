"""A shard group's partitions of a checkpoint version (their candidate sets and indexes) and
their top-k search, exact or approximate: approximate hits are rescored exactly with the
comparator, so every score returned is the model's own; only which candidates make the top
k may differ from exact search.

A partition under IVF-PQ (serve.index=ivfpq) is held as its codes only: its vectors stay in
the checkpoint's embeddings file (StoredRows), the index's hits are read from it and
rescored, and an exact search streams the file in blocks."""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints.directory import EMBEDDING_DATASET
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.filtered import KnownEdges
from pbg_ray.evaluation.questions import Exclusion, exact_top_k, left_out
from pbg_ray.io.edges import read_edges
from pbg_ray.io.storage import StoragePath, open_h5
from pbg_ray.serving.index import (
    SetKey, candidate_vectors, index_file, index_kind, set_keys, shard_of,
    shares_index, version_scorer)
from pbg_ray.io.entities import num_relation_ids
from pbg_ray.types import Bucket


# Rows of an out-of-core partition an exact search scores at a time.
STREAM_ROWS = 65536


class StoredRows:
    """A partition's embeddings where the checkpoint keeps them, read on demand. Where the
    file is local and the dataset contiguous float32: rows taken from a memory map of it
    (pages the kernel may drop, not the process's own memory) advised as random access,
    so that a row's page fault reads that page and not the device's readahead (megabytes
    a fault: a query's few hundred rows would read gigabytes), and blocks read with plain
    reads, which keep the readahead; else both through h5py."""

    def __init__(self, path: StoragePath) -> None:
        self.path = path
        self.mapped: Optional[np.ndarray] = None
        self.offset: Optional[int] = None
        with open_h5(path) as hf:
            ds = hf[EMBEDDING_DATASET]
            self.shape = ds.shape
            offset = ds.id.get_offset() if isinstance(path, Path) else None
            if offset is not None and ds.chunks is None and ds.dtype == np.float32:
                self.offset = offset
                self.mapped = _random_access_map(path, offset, ds.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def take(self, offsets: np.ndarray) -> np.ndarray:
        """float32 rows [len(offsets), D] (offsets in any order, repeats allowed)."""
        if self.mapped is not None:
            return self.mapped[offsets]
        unique, inverse = np.unique(offsets, return_inverse=True)
        with open_h5(self.path) as hf:
            return hf[EMBEDDING_DATASET][unique].astype(np.float32)[inverse]

    def block(self, start: int, stop: int) -> np.ndarray:
        if self.offset is not None:
            width = self.shape[1]
            return np.fromfile(self.path, np.float32, (stop - start) * width,
                               offset=self.offset + start * width * 4).reshape(-1, width)
        with open_h5(self.path) as hf:
            return hf[EMBEDDING_DATASET][start:stop].astype(np.float32)


def _random_access_map(path: Path, offset: int, shape: Tuple[int, ...]) -> np.ndarray:
    """A read-only float32 array [shape] at byte `offset` of the file, memory-mapped with
    MADV_RANDOM (no readahead on its page faults)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset - start + int(np.prod(shape)) * 4
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=start)
    mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, np.float32, int(np.prod(shape)), offset - start).reshape(shape)


@dataclasses.dataclass
class CandidateSet:
    vectors: Optional[Tensor]  # prepared candidates [N, D]; None: out of core (`stored`)
    index: Any  # the faiss index, None: exact search
    stored: Optional[StoredRows] = None  # the partition's rows, for an out-of-core set


class ShardTables:
    """The candidate sets of one shard group's partitions of a checkpoint version, and
    their top-k search."""

    def __init__(self, config: ConfigSchema, version: int, shard: int) -> None:
        import faiss

        self.config = config
        self.version = version
        checkpoint = CheckpointManager(config.checkpoint_path).holding(version)
        self.scorer = version_scorer(config, version)
        self.num_relations = num_relation_ids(config)
        self.tables: Dict[Tuple[str, int], Tensor] = {}
        self.sets: Dict[SetKey, CandidateSet] = {}
        self.stored: Dict[Tuple[str, int], StoredRows] = {}
        for key in set_keys(config, shard):
            entity, part, relation = key
            if (entity, part) not in self.tables and (entity, part) not in self.stored:
                stored = (StoredRows(checkpoint.partition_file(version, entity, part))
                          if config.serve.index == "ivfpq" else None)
                if stored is not None and index_kind(config, len(stored)) == "ivfpq":
                    self.stored[entity, part] = stored
                else:  # held in memory
                    self.tables[entity, part] = torch.from_numpy(
                        checkpoint.read_partition(version, entity, part)[0])
            stored = self.stored.get((entity, part))
            vectors = None if stored else candidate_vectors(
                self.scorer, entity, self.tables[entity, part], relation)
            kind = index_kind(config, len(stored) if stored else len(vectors))
            index = None
            if kind != "exact" and not shares_index(config, key):
                path = index_file(config, version, key, kind)
                index = faiss.deserialize_index(np.frombuffer(path.read_bytes(), np.uint8))
                if kind == "hnsw":
                    index.hnsw.efSearch = config.serve.hnsw_ef_search
                else:
                    index.nprobe = config.serve.ivf_probes
            self.sets[key] = CandidateSet(vectors, index, stored)
        self._known: Dict[Tuple[str, Bucket], KnownEdges] = {}

    def rows(self, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        """Raw embeddings [len(offsets), D] of a partition."""
        offsets = np.asarray(offsets, np.int64)
        if (entity, part) in self.stored:
            return self.stored[entity, part].take(offsets)
        return self.tables[entity, part][torch.from_numpy(offsets)].numpy()

    def _prepared(self, key: SetKey, offsets: np.ndarray) -> Tensor:
        """The prepared candidate vectors of an out-of-core set's rows at `offsets`."""
        entity, part, relation = key
        raw = torch.from_numpy(self.sets[key].stored.take(offsets))
        return candidate_vectors(self.scorer, entity, raw, relation)

    def _streamed_top_k(self, key: SetKey, q: Tensor, k: int, banned: List[np.ndarray]
                        ) -> Tuple[np.ndarray, np.ndarray]:
        """exact_top_k over an out-of-core set, STREAM_ROWS of its rows at a time."""
        stored = self.sets[key].stored
        best = (np.full((len(q), 0), -np.inf, np.float32), np.zeros((len(q), 0), np.int64))
        for start in range(0, len(stored), STREAM_ROWS):
            stop = min(start + STREAM_ROWS, len(stored))
            raw = torch.from_numpy(stored.block(start, stop))
            vectors = candidate_vectors(self.scorer, key[0], raw, key[2])
            inside = [b[(b >= start) & (b < stop)] - start for b in banned]
            scores, offsets = exact_top_k(self.scorer, q, vectors, k, inside)
            scores = np.concatenate([best[0], scores], axis=1)
            offsets = np.concatenate([best[1], np.where(offsets < 0, -1, offsets + start)], axis=1)
            order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            best = (np.take_along_axis(scores, order, 1), np.take_along_axis(offsets, order, 1))
        return best

    def known(self, path: str, bucket: Bucket) -> KnownEdges:
        """The edges of a bucket of an edge path (the last few buckets kept)."""
        if (path, bucket) not in self._known:
            if len(self._known) >= 64:
                self._known.pop(next(iter(self._known)))
            self._known[path, bucket] = KnownEdges(read_edges(path, bucket), self.num_relations)
        return self._known[path, bucket]

    def _index_of(self, key: SetKey) -> Any:
        """The index a set is searched in (a set that shares_index: the relation-free
        set's), None: exact search."""
        return self.sets[key[0], key[1], None if shares_index(self.config, key) else key[2]].index

    def _index_and_probe(self, key: SetKey, q: Tensor) -> Tuple[Any, Tensor]:
        """_index_of(key) and the queries to search it with (the adjoint queries where the
        set shares_index)."""
        if shares_index(self.config, key):
            return self._index_of(key), self.scorer.adjoint_queries(key[2], q)
        return self._index_of(key), q

    def _hits_to_top_k(self, key: SetKey, q: Tensor, hits: np.ndarray, k: int,
                       banned: List[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
        """The k best of an index's hits [B, W] (offsets, -1: none) by the comparator's
        exact scores, the banned left out: as search() returns them. An out-of-core set's
        hits are read from the checkpoint's file."""
        offsets = torch.from_numpy(hits)
        if self.sets[key].vectors is None:  # each row read once (row 0 stands for none)
            rows = np.unique(np.concatenate([[0], hits[hits >= 0]]))
            at = torch.from_numpy(np.searchsorted(rows, hits.clip(0)))
            found = self._prepared(key, rows)[at]
        else:
            found = self.sets[key].vectors[offsets.clamp_min(0)]
        # The comparator's exact scores of the hits: [B, 1, D] x [B, W, D].
        values = self.scorer.comparator.matrix(q.unsqueeze(1), found)[:, 0]
        values[offsets < 0] = -float("inf")
        for i, ids in enumerate(banned):
            values[i, torch.from_numpy(np.isin(hits[i], ids))] = -float("inf")
        top = torch.topk(values, min(k, hits.shape[1]), dim=1)
        values, offsets = top.values, offsets.gather(1, top.indices)
        offsets[values == -float("inf")] = -1
        return values.numpy(), offsets.numpy()

    def _proposals(self, key: SetKey, q: Tensor, wanted: int, banned: List[np.ndarray]
                   ) -> Tuple[np.ndarray, np.ndarray]:
        """An out-of-core set's index hits [B, wanted] (-1: none) with the codes' estimated
        scores, higher better (-inf: none or banned)."""
        import faiss

        index, probe = self._index_and_probe(key, q)
        estimates, hits = index.search(np.ascontiguousarray(probe.numpy()), wanted)
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            estimates = -estimates
        estimates[hits < 0] = -np.inf
        for i, ids in enumerate(banned):
            estimates[i, np.isin(hits[i], ids)] = -np.inf
        return estimates, hits

    def search(self, key: SetKey, queries: np.ndarray, k: int, exact: bool = False,
               exclusion: Optional[Exclusion] = None, own: Optional[np.ndarray] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The k best candidates of set `key` for prepared queries [B, D]: scores float32
        [B, k] (-inf past the end) and offsets int64 [B, k] (-1 there), as exact_top_k's;
        exclusion, own: what left_out leaves out."""
        cands = self.sets[key]
        q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
        banned = left_out(self.known, key[1], len(q), exclusion, own)
        index, probe = self._index_and_probe(key, q)
        if (exact or index is None) and cands.vectors is None:
            return self._streamed_top_k(key, q, k, banned)
        if exact or index is None:
            return exact_top_k(self.scorer, q, cands.vectors, k, banned)
        size = len(cands.stored) if cands.vectors is None else len(cands.vectors)
        wanted = k + max(len(b) for b in banned)
        if cands.vectors is None:  # codes rank the hits roughly: fetch more, rescore them
            wanted *= self.config.serve.pq_rerank
        wanted = min(size, wanted)
        if hasattr(index, "hnsw"):
            index.hnsw.efSearch = max(self.config.serve.hnsw_ef_search, wanted)
        _, hits = index.search(np.ascontiguousarray(probe.numpy()), wanted)
        return self._hits_to_top_k(key, q, hits, k, banned)

    def search_group(self, entity: str, parts: Sequence[int], relation: Optional[int],
                     queries: np.ndarray, k: int, exact: bool = False,
                     exclusion: Optional[Exclusion] = None, own: Optional[np.ndarray] = None
                     ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """search() of the sets (entity, part, relation) of `parts` (this shard group's),
        as one call: a request reaches each shard group once. own: per query the
        (partition, offset) [B, 2] of an entity left out of its answer.

        Out-of-core sets (IVF-PQ) are searched together: each index proposes its
        (k + left out) x serve.pq_rerank best by the codes' estimates, and only the best
        that many of all the proposals are read from the checkpoint's files and rescored,
        not that many per partition: a partition's file is not in memory, and each row
        read may be a disk read."""
        keys = [(entity, part, relation) for part in parts]
        compressed = [key for key in keys
                      if self.sets[key].vectors is None and self._index_of(key) is not None]
        if exact or len(compressed) < 2:
            return [self.search(key, queries, k, exact, exclusion, own) for key in keys]
        q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
        banned = {key: left_out(self.known, key[1], len(q), exclusion, own)
                  for key in compressed}
        most = ((k + max(len(b) for ids in banned.values() for b in ids))
                * self.config.serve.pq_rerank)
        proposals = {key: self._proposals(key, q, min(most, len(self.sets[key].stored)),
                                          banned[key]) for key in compressed}
        every = np.concatenate([estimates for estimates, _ in proposals.values()], axis=1)
        # The most-th best estimate of each query: proposals below it are not read.
        floor = (np.partition(every, every.shape[1] - most, axis=1)[:, every.shape[1] - most]
                 if every.shape[1] > most else np.full(len(q), -np.inf))
        found = {}
        for key, (estimates, hits) in proposals.items():
            kept = np.where((estimates >= floor[:, None]) & (estimates > -np.inf), hits, -1)
            found[key] = self._hits_to_top_k(key, q, kept, k, banned[key])
        return [found[key] if key in found else self.search(key, queries, k, exact, exclusion, own)
                for key in keys]


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
