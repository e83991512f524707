"""A checkpoint version's candidate sets (what one side of a relation ranks in one partition of
an entity type) and their faiss indexes: which sets need one, which share one through the
adjoint query, which kind (exact, HNSW, IVF), built by Ray tasks and saved beside the version.

A candidate set is the Scorer's prepared candidate vectors. Sets are shared across relations
(key relation None: entity vectors prepared by the comparator; also the neighbour search's)
except where the relation operator applies to the candidates (Scorer.relation_specific: rhs
side in per-relation mode, an operator the query cannot carry with the scores unchanged;
key the relation's index). An index is searched with the comparator's metric: inner product
for dot and cos (cos's prepared vectors have unit norm), L2 for l2 and squared_l2. A
relation's set needs no index of its own where the query can carry the operator for the
ranking: a translation under dot, <q, x + t> = <q, x> + <q, t> (scoring.RANK_ADJOINTS).
Such sets are searched in the relation-free set's index with the Scorer's adjoint query,
and their hits re-ranked by the relation's scores."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import ray
import torch
from torch import Tensor

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema, ServeConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.scoring import RANK_ADJOINTS, Scorer, moves_to_query
from pbg_ray.io.files import write_bytes_atomic
from pbg_ray.io.storage import StoragePath, is_uri, storage_path
from pbg_ray.io.entities import load_entity_counts, num_relation_ids
from pbg_ray.model.params import params_from_checkpoint


# (entity type, partition, relation index or None): one candidate set (module docstring).
SetKey = Tuple[str, int, Optional[int]]
# Rows from which an IVF-PQ index's 256-code codebooks learn (faiss asks 39 per code).
PQ_MIN_ROWS = 39 * 256
# Training points per centroid (coarse list or PQ code) sampled for faiss's k-means; faiss
# takes up to 256 and warns under 39.
TRAINING_POINTS_PER_CENTROID = 64


INDEX_DIRECTORY = "serve_index"  # in checkpoint_path, one v{N}/ per checkpoint version


IP_COMPARATORS = ("dot", "cos")


def version_scorer(config: ConfigSchema, version: int) -> Scorer:
    """The Scorer of checkpoint version `version`'s model."""
    checkpoint = CheckpointManager(config.checkpoint_path).holding(version)
    arrays = checkpoint.read_model(version)[0]
    return Scorer(config, params_from_checkpoint(config, num_relation_ids(config), arrays, None,
                                                 where=f"version {version}").arrays)


def shard_of(part: int, serve: ServeConfig) -> int:
    """The shard group holding partition `part` of every entity type."""
    return part % serve.shard_groups


def set_keys(config: ConfigSchema, shard: Optional[int] = None) -> List[SetKey]:
    """The candidate sets of the partitions of one shard group (None: all)."""
    keys: List[SetKey] = []
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            if shard is not None and shard_of(part, config.serve) != shard:
                continue
            keys.append((entity, part, None))
            if not config.dynamic_relations:
                keys += [(entity, part, r) for r, rconf in enumerate(config.relations)
                         if rconf.rhs == entity and rconf.operator != "none"
                         and not moves_to_query(config, r)]
    return keys


def shares_index(config: ConfigSchema, key: SetKey) -> bool:
    """Whether a relation's set is searched in the relation-free set's index (with the
    Scorer's adjoint_queries)."""
    return key[2] is not None and moves_to_query(config, key[2], RANK_ADJOINTS)


def index_keys(config: ConfigSchema) -> List[SetKey]:
    """The sets with an index of their own (if their size asks for one)."""
    return [key for key in set_keys(config) if not shares_index(config, key)]


def set_relation(scorer: Scorer, side: str, relation: int) -> Optional[int]:
    """The relation part of the key of the set `side` of `relation` ranks in."""
    return relation if scorer.relation_specific(side, relation) else None


def candidate_vectors(scorer: Scorer, entity: str, rows: Tensor, relation: Optional[int]) -> Tensor:
    """The prepared candidates [N, D] of a set from a partition's raw rows [N, D]."""
    vectors = scorer.entity_vectors(entity, rows)
    if relation is None:
        return scorer.comparator.prepare(vectors)[0]
    return scorer.candidates("rhs", relation, vectors)


def index_kind(config: ConfigSchema, rows: int) -> str:
    """exact, hnsw, ivf or ivfpq for a set of `rows` candidates (serve.index; auto: by
    size). IVF-PQ's codebooks of 256 codes each learn from PQ_MIN_ROWS rows at least:
    smaller sets are searched exactly (and held in memory: they are small)."""
    serve = config.serve
    if serve.index == "ivfpq":
        return "ivfpq" if rows >= PQ_MIN_ROWS else "exact"
    if serve.index != "auto":
        return serve.index
    if config.bias or rows < serve.index_min_rows:
        return "exact"
    return "hnsw" if rows < serve.ivf_min_rows else "ivf"


def pq_subquantizers(config: ConfigSchema, dim: int) -> int:
    """Bytes of an IVF-PQ code of a `dim`-float vector: serve.pq_bytes, which must divide
    dim; 0: the largest divisor of dim up to dim / 4, or up to 16 where that is more (and
    at most dim / 2). A byte per four floats, a sixteenth of the vector, rescores its hits
    to a recall@10 above 0.9 at d=128 and trains its codebooks five times as fast as a
    byte per two floats; small vectors keep 16 bytes."""
    pq_bytes = config.serve.pq_bytes
    if pq_bytes == 0:
        most = max(dim // 4, min(16, dim // 2), 1)
        return max(m for m in range(1, most + 1) if dim % m == 0)
    if dim % pq_bytes:
        divisors = [m for m in range(1, dim + 1) if dim % m == 0]
        raise PbgRayError(f"serve.pq_bytes={pq_bytes} does not divide the dimension {dim}: "
                          f"IVF-PQ splits each vector into pq_bytes equal parts. Set one of "
                          f"{divisors}, or 0 for the default (a byte per four floats).")
    return pq_bytes


def index_bytes(config: ConfigSchema, kind: str, rows: int, dim: int) -> int:
    """Bytes a faiss index of `kind` holds for `rows` vectors of `dim` floats: HNSW the
    vectors and about 2 x hnsw_m links of 4 bytes per row on its base layer (its upper
    layers add a few percent), IVF the vectors and an 8-byte id per row, IVF-PQ a code
    and an id per row."""
    vectors = rows * dim * 4
    if kind == "hnsw":
        return int(vectors + rows * 2 * config.serve.hnsw_m * 4 * 1.1)
    if kind == "ivfpq":
        return rows * (pq_subquantizers(config, dim) + 8)
    return vectors + 8 * rows if kind == "ivf" else 0


def replica_bytes(config: ConfigSchema, counts: Dict[str, Sequence[int]], shard: int) -> int:
    """Bytes one replica of shard group `shard` holds (ShardTables): each partition's
    table, each candidate set's prepared vectors, and the indexes of the sets with their
    own; an IVF-PQ partition's codes alone (its vectors stay on disk)."""
    total = 0
    for entity, part, relation in set_keys(config, shard):
        rows, dim = counts[entity][part], config.entity_dimension(entity)
        kind = index_kind(config, rows)
        if kind != "ivfpq":
            total += rows * dim * 4  # the set's prepared vectors
            if relation is None:
                total += rows * dim * 4  # the partition's table, read once per partition
        if not shares_index(config, (entity, part, relation)):
            total += index_bytes(config, kind, rows, dim)
    return total


def index_file(config: ConfigSchema, version: int, key: SetKey, kind: str) -> StoragePath:
    """Where a set's index of `version` is saved: beside the version, named by its build
    settings (so changed settings build a new one)."""
    serve = config.serve
    settings = (f"{kind} {serve.hnsw_m} {serve.hnsw_ef_construction}" if kind == "hnsw"
                else f"{kind} {serve.ivf_lists} {serve.pq_bytes}" if kind == "ivfpq"
                else f"{kind} {serve.ivf_lists}")
    tag = hashlib.sha1(settings.encode()).hexdigest()[:8]
    entity, part, relation = key
    name = f"{entity}_{part}{'' if relation is None else f'_r{relation}'}.{kind}-{tag}.faiss"
    return storage_path(config.checkpoint_path) / INDEX_DIRECTORY / f"v{version}" / name


def build_index(vectors: np.ndarray, kind: str, config: ConfigSchema) -> Any:
    """A faiss index (hnsw, ivf or ivfpq) of vectors float32 [N, D] with the comparator's
    metric."""
    import faiss

    serve = config.serve
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    metric = (faiss.METRIC_INNER_PRODUCT if config.comparator in IP_COMPARATORS
              else faiss.METRIC_L2)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, serve.hnsw_m, metric)
        index.hnsw.efConstruction = serve.hnsw_ef_construction
    else:
        lists = serve.ivf_lists or int(4 * np.sqrt(n))
        lists = max(1, min(lists, n // 39 or 1))  # faiss wants 39 training points per list
        quantizer = (faiss.IndexFlatIP if metric == faiss.METRIC_INNER_PRODUCT
                     else faiss.IndexFlatL2)(dim)
        if kind == "ivfpq":
            index = faiss.IndexIVFPQ(quantizer, dim, lists, pq_subquantizers(config, dim), 8,
                                     metric)
            # Each codebook of 256 codes from 64 points a code, 10 rounds of k-means: a
            # partition's build is then mostly the coarse quantizer's and the encoding.
            index.pq.cp.max_points_per_centroid = TRAINING_POINTS_PER_CENTROID
            index.pq.cp.niter = 10
        else:
            index = faiss.IndexIVFFlat(quantizer, dim, lists, metric)
        index.cp.max_points_per_centroid = TRAINING_POINTS_PER_CENTROID
        size = max(lists, 256) * TRAINING_POINTS_PER_CENTROID
        index.train(vectors[np.random.default_rng(0).permutation(n)[:size]])
    index.add(vectors)
    return index


def set_figures(key: SetKey, kind: str, rows: int) -> Dict[str, Any]:
    """A set's build figures before any build: key, kind, rows, seconds 0."""
    return {"key": list(key), "kind": kind, "rows": rows, "seconds": 0.0}


def build_set_index(config: ConfigSchema, version: int, key: SetKey) -> Dict[str, Any]:
    """Build and save the index of one set of `version` unless it is saved already (an
    exact set has none). Returns its figures: key, kind, rows, seconds (0: found saved)."""
    import faiss

    entity, part, relation = key
    checkpoint = CheckpointManager(config.checkpoint_path).holding(version)
    rows = checkpoint.read_partition(version, entity, part)[0]
    kind = index_kind(config, len(rows))
    figures = set_figures(key, kind, len(rows))
    path = index_file(config, version, key, kind)
    if kind == "exact" or path.is_file():
        return figures
    start = time.perf_counter()
    vectors = candidate_vectors(version_scorer(config, version), entity, torch.from_numpy(rows),
                                relation)
    index = build_index(vectors.numpy(), kind, config)
    write_bytes_atomic(path, faiss.serialize_index(index).tobytes())
    figures["seconds"] = time.perf_counter() - start
    return figures


def drop_old_indexes(config: ConfigSchema, keep: Sequence[int]) -> None:
    """Remove the saved indexes of versions other than `keep` (local checkpoints only)."""
    if is_uri(config.checkpoint_path):
        return
    root = storage_path(config.checkpoint_path) / INDEX_DIRECTORY
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if directory.name not in {f"v{v}" for v in keep}:
            for file in directory.iterdir():
                file.unlink(missing_ok=True)
            directory.rmdir()


@ray.remote
def build_index_task(config: Dict[str, Any], version: int, key: List[Any]) -> Dict[str, Any]:
    """Build (or find saved) one candidate set's index of `version`, on as many threads as
    the task has CPUs (builds run side by side)."""
    import faiss

    config = ConfigSchema.from_dict(config)
    faiss.omp_set_num_threads(max(1, int(config.serve.index_cpus)))
    return build_set_index(config, version, tuple(key))


async def build_indexes(config: ConfigSchema, version: int, previous: Optional[int] = None
                        ) -> Dict[str, Any]:
    """Every set's index of `version`, built by parallel Ray tasks (saved ones reused);
    the saved indexes of versions other than it and `previous` (the one served until now,
    which the shards may still load) are removed. Returns the build's figures. A set
    searched exactly has no index, and no task (a worker's start, for a small graph's
    every set)."""
    start = time.perf_counter()
    task = build_index_task.options(num_cpus=config.serve.index_cpus)
    plain = config.to_dict()
    counts = load_entity_counts(config)
    figures, built = [], []
    for key in index_keys(config):
        entity, part, _ = key
        rows = counts[entity][part]
        if index_kind(config, rows) == "exact":
            figures.append(set_figures(key, "exact", rows))
        else:
            built.append(task.remote(plain, version, list(key)))
    figures += await asyncio.gather(*built)
    drop_old_indexes(config, [version] if previous is None else [previous, version])
    return {"version": version, "seconds": time.perf_counter() - start,
            "built": [f for f in figures if f["seconds"] > 0],
            "kinds": sorted({f["kind"] for f in figures})}
