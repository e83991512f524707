"""The routing phase: a spill file of id records -> PBG's edge buckets.

Each record's ids become (partition, offset) through the dictionaries; edges whose
entities or relation were dropped as too rare are left out, and unpartitioned entity
types spread their edges over all buckets (v1 spec) by a hash of the edge
(`BucketRouter.buckets`, which the Ray engine shares). A first pass over the spill
counts each bucket's edges, so that every bucket file is created at its final size; a
second pass groups each chunk of edges by bucket with a stable radix sort (a bucket
keeps the input's order) and writes it, at most MAX_OPEN_BUCKETS files open at a time.
With importer.previous_edge_paths, each bucket starts with the previous import's edges
of that bucket.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import h5py
import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.dictionaries import Dictionaries
from pbg_ray.importer.read import EntityTypes
from pbg_ray.io.edges import (
    FORMAT_VERSION, FORMAT_VERSION_ATTR, count_edges, edges_file, read_edges)
from pbg_ray.io.name_keys import mix
from pbg_ray.io.storage import ObjectPath, StoragePath, uploading
from pbg_ray.types import Bucket

SPILL_CHUNK = 1 << 20  # edges routed into buckets at a time
MAX_OPEN_BUCKETS = 256


class BucketRouter:
    """Spill files of one import into bucket files, through its fixed dictionaries."""

    def __init__(self, config: ConfigSchema, types: EntityTypes, spill_dtype: np.dtype,
                 dictionaries: Optional[Dictionaries] = None) -> None:
        self.config = config
        self.types = types
        self.spill_dtype = spill_dtype
        self.weighted = "weight" in spill_dtype.names
        self.dictionaries = dictionaries
        self.num_parts = {side: max(config.entities[getattr(r, side)].num_partitions
                                    for r in config.relations) for side in ("lhs", "rhs")}
        self.num_buckets = self.num_parts["lhs"] * self.num_parts["rhs"]

    def bucket(self, index: int) -> Bucket:
        """The bucket of a bucket index (lhs partition major)."""
        return Bucket(index // self.num_parts["rhs"], index % self.num_parts["rhs"])

    def buckets(self, rel: np.ndarray, lhs_part: np.ndarray, lhs: np.ndarray,
                rhs_part: np.ndarray, rhs: np.ndarray) -> np.ndarray:
        """The bucket index of each edge, -1 where a relation or entity was dropped (part
        or rel -1). Unpartitioned entity types spread their edges over all buckets (v1
        spec) by a hash of the edge, so that the bucket depends on the edge alone."""
        spread = mix(lhs.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                     ^ rhs.astype(np.uint64) ^ (rel.astype(np.uint64) << np.uint64(40)))
        parts = {}
        for side, part in (("lhs", lhs_part), ("rhs", rhs_part)):
            of_edge = self.types.of_edges(side, rel)
            for t, name in enumerate(self.types.names):
                if self.config.entities[name].num_partitions == 1 and self.num_parts[side] > 1:
                    mask = (of_edge == t) & (part >= 0)
                    part = np.where(mask, (spread % np.uint64(self.num_parts[side])).astype(
                        np.int64), part)
            parts[side] = part
        keep = (rel >= 0) & (parts["lhs"] >= 0) & (parts["rhs"] >= 0)
        return np.where(keep, parts["lhs"] * self.num_parts["rhs"] + parts["rhs"], -1)

    def _side(self, records: np.ndarray, rel: np.ndarray, side: str) -> tuple:
        """(partition, offset) of one side of each record in its type's dictionary."""
        of_edge = self.types.of_edges(side, rel)
        ids = records[side]
        part = np.empty(len(records), np.int64)
        offset = np.empty(len(records), np.int64)
        for t, name in enumerate(self.types.names):
            mask = of_edge == t if len(self.types.names) > 1 else slice(None)
            d = self.dictionaries.entities[name]
            part[mask], offset[mask] = d.part[ids[mask]], d.offset[ids[mask]]
        return part, offset

    def routed(self, spill_path: Path) -> Iterator[tuple]:
        """(bucket index, lhs, rhs, rel, weight or None) per spill chunk, dropped edges
        left out."""
        count = spill_path.stat().st_size // self.spill_dtype.itemsize
        with open(spill_path, "rb") as f:
            for first in range(0, count, SPILL_CHUNK):
                records = np.fromfile(f, self.spill_dtype, count=min(SPILL_CHUNK, count - first))
                rel = self.dictionaries.relation_ids[records["rel"]]
                lhs_part, lhs = self._side(records, rel, "lhs")
                rhs_part, rhs = self._side(records, rel, "rhs")
                bucket = self.buckets(rel, lhs_part, lhs, rhs_part, rhs)
                keep = bucket >= 0
                weight = records["weight"][keep] if self.weighted else None
                yield bucket[keep], lhs[keep], rhs[keep], rel[keep], weight

    def write_buckets(self, spill_path: Path, directory: Path,
                      previous: Optional[str]) -> Dict[str, Any]:
        """Every bucket file of the spill's edges in `directory`, each led by the
        bucket's edges in the `previous` edge path; returns the counts."""
        sizes = np.zeros(self.num_buckets, np.int64)
        for bucket, *_ in self.routed(spill_path):
            sizes += np.bincount(bucket, minlength=self.num_buckets)
        total = int(spill_path.stat().st_size // self.spill_dtype.itemsize)
        new_edges = int(sizes.sum())
        old = np.array([count_edges(previous, self.bucket(b)) if previous else 0
                        for b in range(self.num_buckets)], np.int64)
        sizes += old
        sort_dtype = np.uint16 if self.num_buckets <= 1 << 16 else np.int64  # radix below 2^16
        for group in range(0, self.num_buckets, MAX_OPEN_BUCKETS):
            ids = range(group, min(group + MAX_OPEN_BUCKETS, self.num_buckets))
            files = {b: self._create_bucket(edges_file(directory, self.bucket(b)), int(sizes[b]))
                     for b in ids}
            filled = {b: int(old[b]) for b in ids}
            try:
                for b in ids:
                    if old[b]:
                        self._copy_previous(previous, self.bucket(b), files[b])
                for bucket, lhs, rhs, rel, weight in self.routed(spill_path):
                    order = np.argsort(bucket.astype(sort_dtype), kind="stable")
                    bounds = np.searchsorted(bucket[order], [ids.start, ids.stop])
                    order = order[bounds[0]:bounds[1]]
                    counts = np.bincount(bucket[order] - ids.start, minlength=len(ids))
                    ends = np.cumsum(counts)
                    columns = {"lhs": lhs[order], "rhs": rhs[order], "rel": rel[order]}
                    if weight is not None:
                        columns["weight"] = weight[order]
                    for b, end, n in zip(ids, ends, counts):
                        if n:
                            at = filled[b]
                            for name, values in columns.items():
                                files[b][name][at:at + n] = values[end - n:end]
                            filled[b] = at + n
            finally:
                for hf in files.values():
                    hf.close()
        stats = {"edges": int(sizes.sum()), "dropped_rare": total - new_edges}
        return {**stats, "previous_edges": int(old.sum())} if previous else stats

    def write_bucket(self, directory: StoragePath, index: int, columns: Dict[str, np.ndarray],
                     previous: Optional[str]) -> int:
        """One bucket file in `directory` (local, or uploaded to object storage): the
        bucket's edges in the `previous` edge path, then `columns` (lhs, rhs, rel[,
        weight]); returns the previous edges' count."""
        old = count_edges(previous, self.bucket(index)) if previous else 0
        path = edges_file(directory, self.bucket(index))
        with contextlib.ExitStack() as stack:
            local = stack.enter_context(uploading(path)) if isinstance(path, ObjectPath) else path
            with self._create_bucket(local, old + len(columns["lhs"])) as hf:
                if old:
                    self._copy_previous(previous, self.bucket(index), hf)
                for name, values in columns.items():
                    hf[name][old:] = values
        return old

    def _copy_previous(self, previous: str, bucket: Bucket, hf: h5py.File) -> None:
        """The previous import's edges of `bucket` into the first rows of hf's datasets."""
        num_chunks = max(1, -(-count_edges(previous, bucket) // SPILL_CHUNK))
        at = 0
        for chunk in range(num_chunks):
            edges = read_edges(previous, bucket, chunk, num_chunks)
            if edges.weight is not None and not self.weighted:
                raise PbgRayError(f"{str(edges_file(previous, bucket))!r} (importer."
                                  "previous_edge_paths) holds edge weights; set "
                                  "importer.weight_col so that the grown graph keeps them.")
            end = at + len(edges)
            for name in ("lhs", "rhs", "rel"):
                hf[name][at:end] = getattr(edges, name)
            if self.weighted:
                hf["weight"][at:end] = 1.0 if edges.weight is None else edges.weight
            at = end

    def _create_bucket(self, path: Path, size: int) -> h5py.File:
        """An edge file with contiguous datasets of the bucket's final size."""
        hf = h5py.File(path, "w")
        hf.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
        for name in ("lhs", "rhs", "rel"):
            hf.create_dataset(name, shape=(size,), dtype=np.int64)
        if self.weighted:
            hf.create_dataset("weight", shape=(size,), dtype=np.float32)
        return hf
