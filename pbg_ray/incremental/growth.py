"""A grown graph trained from init_path: what init_path knows, and the new rows.

An incremental import (importer.previous_entity_path) keeps every known entity at its
(partition, offset) and appends new ones at the ends of partitions, and in dynamic
mode appends new relation ids. So init_path's partition of N rows is the first N rows
of the grown partition, and its relation parameters are the first rows of the grown
ones: everything past them is new.
"""

from __future__ import annotations

import io
import uuid
import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.edges import count_edges, read_edges
from pbg_ray.io.files import atomic_path
from pbg_ray.io.storage import storage_path
from pbg_ray.model.params import KnownRows, PartitionKey, init_partition, partition_key
from pbg_ray.types import SIDES, Bucket, EdgeList

NEIGHBOR_CHUNK = 1 << 22  # edges read at a time when averaging neighbours


def init_checkpoint(config: ConfigSchema) -> Tuple[CheckpointManager, int]:
    """init_path's checkpoint and newest version; refuses one that holds no checkpoint."""
    checkpoint = CheckpointManager(config.init_path)
    version = checkpoint.version()
    if version == 0:
        raise PbgRayError(f"init_path {config.init_path!r} holds no checkpoint, but the "
                          "incremental settings need its trained rows. Point init_path at the "
                          "previous run's checkpoint_path.")
    return checkpoint, version


def init_rows(config: ConfigSchema, checkpoint: CheckpointManager, version: int
              ) -> Dict[PartitionKey, int]:
    """Rows of each of the config's partitions in init_path (0 where it has none: a new type)."""
    rows = {}
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            rows[entity, part] = (len(checkpoint.read_partition(version, entity, part)[0])
                                  if checkpoint.has_partition(version, entity, part) else 0)
    return rows


def known_rows(config: ConfigSchema) -> Optional[KnownRows]:
    """What init_path trained, when the run treats it apart from the new rows (a scaled
    learning rate, or training only edges with new entities); None otherwise."""
    inc = config.incremental
    if config.init_path is None or (inc.known_lr_scale == 1 and not inc.new_entity_edges_only):
        return None
    checkpoint, version = init_checkpoint(config)
    params: Dict[str, int] = {}
    if checkpoint.has_model(version):
        arrays, _ = checkpoint.read_model(version)
        params = {name: int(np.shape(value)[0]) if np.ndim(value) else 1
                  for name, value in arrays.items()}
    return KnownRows(init_rows(config, checkpoint, version), params, inc.known_lr_scale)


def grow_partition(config: ConfigSchema, key: PartitionKey, embs: np.ndarray, sums: np.ndarray,
                   count: int, new_rows: Optional[str], where: str
                   ) -> Tuple[np.ndarray, np.ndarray]:
    """init_path's partition (embeddings [N, dim], row-Adagrad sums [N]) grown to `count`
    rows: the first N kept, the new ones from the .npy file `new_rows` [count - N, dim]
    (neighbor_means) where given and finite, else N(0, init_scale); their sums start at 0."""
    entity, part = key
    if len(embs) > count:
        raise PbgRayError(
            f"{where} holds {len(embs)} entities of type {entity!r}, partition {part}, but "
            f"entity_path counts only {count}. init_path must be a checkpoint of this graph or "
            "of the graph it grew from (importer.previous_entity_path keeps known entities).")
    if len(embs) == count:
        return embs, sums
    rng = np.random.default_rng([count, part, zlib.crc32(entity.encode())])
    fresh, fresh_sums = init_partition(config, entity, count - len(embs), rng)
    if new_rows is not None:
        given_rows = read_npy(new_rows)
        given = np.isfinite(given_rows).all(axis=1)
        fresh[given] = given_rows[given]
    return np.concatenate([embs, fresh]), np.concatenate([sums, fresh_sums])


def read_npy(path: str) -> np.ndarray:
    return np.load(io.BytesIO(storage_path(path).read_bytes()), allow_pickle=False)


def _edge_chunks(edge_path: str, bucket: Bucket) -> Iterator[EdgeList]:
    num_chunks = max(1, -(-count_edges(edge_path, bucket) // NEIGHBOR_CHUNK))
    for chunk in range(num_chunks):
        yield read_edges(edge_path, bucket, chunk, num_chunks)


def neighbor_means(config: ConfigSchema, checkpoint: CheckpointManager, version: int,
                   counts: Dict[str, List[int]]) -> Dict[PartitionKey, str]:
    """For each partition that grew: a .npy file of float32 [new rows, dim], the mean of
    each new entity's known neighbours' embeddings in init_path (version `version`) over
    the edges of edge_paths, NaN rows for new entities without a known neighbour. Raw
    embeddings: operators are not applied.

    Out of core: partition p's new rows take their neighbours from the buckets whose lhs
    or rhs partition is p, so the buckets are swept by partition, and a partition's
    means are written out (a temporary file in checkpoint_path, which the run removes
    when it ends) as soon as its sweep ends: memory holds the sums of one partition per
    type (and of unpartitioned types), and the two partitions of a bucket."""
    known = init_rows(config, checkpoint, version)
    grown = {k: counts[k[0]][k[1]] - n for k, n in known.items()
             if counts[k[0]][k[1]] > n and not config.entities[k[0]].featurized}
    rel_types = [config.relations[0]] if config.dynamic_relations else config.relations
    nparts = {side: max(config.entities[getattr(r, side)].num_partitions for r in config.relations)
              for side in SIDES}
    sums: Dict[PartitionKey, np.ndarray] = {}
    seen: Dict[PartitionKey, np.ndarray] = {}
    files: Dict[PartitionKey, str] = {}
    cache: Dict[PartitionKey, np.ndarray] = {}

    def embeddings(key: PartitionKey) -> np.ndarray:
        if key not in cache:
            cache[key] = checkpoint.read_partition(version, *key)[0]
        return cache[key]

    def accumulate(edges: EdgeList, bucket: Bucket, side: str, other: str) -> None:
        type_of = np.zeros(len(edges), np.int64) if config.dynamic_relations else edges.rel
        for idx, rel in enumerate(rel_types):
            mask = type_of == idx
            key = partition_key(config, getattr(rel, side), getattr(bucket, side))
            other_key = partition_key(config, getattr(rel, other), getattr(bucket, other))
            if key not in grown or config.entities[other_key[0]].featurized:
                continue
            ids, other_ids = getattr(edges, side)[mask], getattr(edges, other)[mask]
            pick = (ids >= known[key]) & (other_ids < known[other_key])
            if not pick.any():  # also: the other side is a new type
                continue
            if key not in sums:
                sums[key] = np.zeros((grown[key], config.entity_dimension(key[0])), np.float64)
                seen[key] = np.zeros(grown[key], np.int64)
            rows = ids[pick] - known[key]
            np.add.at(sums[key], rows, embeddings(other_key)[other_ids[pick]])
            seen[key] += np.bincount(rows, minlength=grown[key])

    def finish(key: PartitionKey) -> None:
        total = sums.pop(key, np.zeros((grown[key], config.entity_dimension(key[0]))))
        count = seen.pop(key, np.zeros(grown[key], np.int64))
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (total / count[:, None]).astype(np.float32)
        path = storage_path(config.checkpoint_path) / (
            f".new_rows_{key[0]}_{key[1]}.tmp-{uuid.uuid4().hex[:12]}.npy")
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, means, allow_pickle=False)
        files[key] = str(path)

    for part in range(max(nparts.values())):
        # Bucket (l, r) adds to its lhs side's partition in the sweep of l, to its rhs
        # side's in the sweep of r.
        sides: Dict[Bucket, List[str]] = {}
        for other_part in range(nparts["rhs"] if part < nparts["lhs"] else 0):
            sides.setdefault(Bucket(part, other_part), []).append("lhs")
        for other_part in range(nparts["lhs"] if part < nparts["rhs"] else 0):
            sides.setdefault(Bucket(other_part, part), []).append("rhs")
        for bucket, swept in sorted(sides.items()):
            needed = {partition_key(config, getattr(r, s), p) for r in rel_types
                      for s, p in zip(SIDES, bucket)}
            for key in set(cache) - needed:  # the whole model never sits in memory
                del cache[key]
            for edge_path in config.edge_paths:
                for edges in _edge_chunks(edge_path, bucket):
                    for side in swept:
                        accumulate(edges, bucket, side, "rhs" if side == "lhs" else "lhs")
        for key in [k for k in grown if k[1] == part and config.entities[k[0]].num_partitions > 1]:
            finish(key)
    for key in [k for k in grown if config.entities[k[0]].num_partitions == 1]:
        finish(key)
    return files


def touches_new(config: ConfigSchema, bucket: Bucket, edges: EdgeList, known: KnownRows
                ) -> np.ndarray:
    """bool [E]: the edges with at least one entity past init_path's rows (featurized
    sides never count: their rows are features)."""
    rel_types = [config.relations[0]] if config.dynamic_relations else config.relations
    type_of = np.zeros(len(edges), np.int64) if config.dynamic_relations else edges.rel
    new = np.zeros(len(edges), bool)
    for side, part in (("lhs", bucket.lhs), ("rhs", bucket.rhs)):
        limit = np.array([
            np.iinfo(np.int64).max if config.entities[getattr(r, side)].featurized
            else known.partitions.get(partition_key(config, getattr(r, side), part), 0)
            for r in rel_types], np.int64)
        new |= getattr(edges, side) >= limit[type_of]
    return new
