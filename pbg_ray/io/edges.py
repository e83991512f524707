"""Edge buckets: `edges_{lhs}_{rhs}.h5` in each edge path (PBG v1).

Each file holds int64 datasets `lhs`, `rhs`, `rel` of one length (the i-th
edge), optionally float32 `weight`, and for featurized entity types the
feature lists `lhsd_offsets`/`lhsd_data` and `rhsd_offsets`/`rhsd_data`
(offsets has one more element than there are edges and starts at 0; the
edge's `lhs`/`rhs` is then -1). The root attribute `format_version` is 1.

Files are read one edge chunk at a time (a slice of every dataset), never
whole. Whole-array writes are contiguous (no chunk padding: PBG 1.0.0 pads
every dataset to 50 MiB); streamed writes use 1 MiB HDF5 chunks.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import h5py
import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.files import PathLike, atomic_path, reading
from pbg_ray.io.storage import (
    FORMAT_VERSION, FORMAT_VERSION_ATTR, StoragePath, dataset_kind, dataset_type, open_v1_h5,
    storage_path)
from pbg_ray.types import Bucket, EdgeList, FeatureList

ID_DATASETS = ("lhs", "rhs", "rel")
FEATURE_SIDES = ("lhsd", "rhsd")
STREAM_CHUNK = 1 << 17  # elements per HDF5 chunk when appending (1 MiB of int64)




def edges_file(edge_path: PathLike, bucket: Bucket) -> StoragePath:
    return storage_path(edge_path) / f"edges_{bucket.lhs}_{bucket.rhs}.h5"


def chunk_bounds(num_edges: int, chunk_idx: int, num_chunks: int) -> tuple:
    """[begin, end) of edge chunk `chunk_idx` of `num_chunks`, split as PBG splits."""
    return chunk_idx * num_edges // num_chunks, (chunk_idx + 1) * num_edges // num_chunks


def _reimport() -> str:
    return "Import the edges again (python -m pbg_ray.import_edges)."


def _open(path: StoragePath) -> h5py.File:
    return open_v1_h5(path, "edge", "Every bucket needs a file, even an empty one; run the "
                      "importer or check edge_paths.", "Re-import the edges with pbg_ray.",
                      _reimport)


def _dataset(hf: h5py.File, name: str, integer: bool) -> h5py.Dataset:
    if name not in hf or not isinstance(hf[name], h5py.Dataset):
        raise PbgRayError(f"edge file {hf.filename!r} lacks the dataset {name!r}. "
                          f"An edge file needs 1-D datasets {', '.join(ID_DATASETS)}.")
    ds = hf[name]
    kind = "iu" if integer else "fiu"
    if ds.ndim != 1 or dataset_kind(ds) not in tuple(kind):
        want = "integer" if integer else "numeric"
        raise PbgRayError(f"edge file {hf.filename!r}: dataset {name!r} must be 1-D {want}, "
                          f"found {dataset_type(ds)}.")
    return ds


def _num_edges(hf: h5py.File) -> int:
    lengths = {name: _dataset(hf, name, True).shape[0] for name in ID_DATASETS}
    if "weight" in hf:
        lengths["weight"] = _dataset(hf, "weight", False).shape[0]
    if len(set(lengths.values())) != 1:
        raise PbgRayError(f"edge file {hf.filename!r}: datasets have different lengths "
                          f"{lengths}; they must all have one entry per edge.")
    return lengths["rel"]


def count_edges(edge_path: PathLike, bucket: Bucket) -> int:
    path = edges_file(edge_path, bucket)
    with reading(path, "edge", _reimport), _open(path) as hf:
        return _num_edges(hf)


def _read_features(hf: h5py.File, side: str, begin: int, end: int) -> Optional[FeatureList]:
    if f"{side}_offsets" not in hf:
        return None
    offsets_ds = _dataset(hf, f"{side}_offsets", True)
    data_ds = _dataset(hf, f"{side}_data", True)
    offsets = offsets_ds[begin:end + 1].astype(np.int64)
    if (len(offsets) != end - begin + 1 or np.any(np.diff(offsets) < 0)
            or (len(offsets) and (offsets[0] < 0 or offsets[-1] > data_ds.shape[0]))):
        raise PbgRayError(f"edge file {hf.filename!r}: {side}_offsets are not non-decreasing "
                          f"offsets into {side}_data with one entry per edge plus one.")
    data = data_ds[offsets[0]:offsets[-1]].astype(np.int64) if len(offsets) else np.empty(0, np.int64)
    return FeatureList(offsets - offsets[0], data)


def read_edges(edge_path: PathLike, bucket: Bucket, chunk_idx: int = 0,
               num_chunks: int = 1) -> EdgeList:
    """Read edge chunk `chunk_idx` of `num_chunks` of a bucket (only that slice)."""
    path = edges_file(edge_path, bucket)
    with reading(path, "edge"), _open(path) as hf:
        begin, end = chunk_bounds(_num_edges(hf), chunk_idx, num_chunks)

        def ids(name: str) -> np.ndarray:
            out = np.empty(end - begin, dtype=np.int64)
            if end > begin:
                ds = hf[name]
                if ds.dtype == np.int64:
                    ds.read_direct(out, source_sel=np.s_[begin:end])
                else:
                    out[:] = ds[begin:end]
            return out

        weight = hf["weight"][begin:end].astype(np.float32) if "weight" in hf else None
        return EdgeList(ids("lhs"), ids("rhs"), ids("rel"), weight,
                        _read_features(hf, "lhsd", begin, end),
                        _read_features(hf, "rhsd", begin, end))


class EdgeAppender:
    """Stream edges into one bucket file; the file appears only when complete.

        with EdgeAppender(edge_path, bucket) as out:
            out.append(edges)
    """

    def __init__(self, edge_path: PathLike, bucket: Bucket) -> None:
        self.path = edges_file(edge_path, bucket)
        self._atomic = atomic_path(self.path)
        self._hf: Optional[h5py.File] = None
        self._sizes: Dict[str, int] = {}

    def __enter__(self) -> "EdgeAppender":
        tmp = self._atomic.__enter__()
        self._hf = h5py.File(tmp, "w")
        self._hf.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
        for name in ID_DATASETS:
            self._create(name, np.int64)
        return self

    def _create(self, name: str, dtype) -> None:
        self._hf.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                chunks=(STREAM_CHUNK,))
        self._sizes[name] = 0

    def _extend(self, name: str, values: np.ndarray) -> None:
        ds = self._hf[name]
        old = self._sizes[name]
        ds.resize((old + len(values),))
        ds[old:] = values
        self._sizes[name] = old + len(values)

    def append(self, edges: EdgeList) -> None:
        n = self._sizes["rel"]
        for name in ID_DATASETS:
            self._extend(name, getattr(edges, name))
        if edges.weight is not None and "weight" not in self._sizes:
            self._create("weight", np.float32)
            self._extend("weight", np.ones(n, np.float32))
        if "weight" in self._sizes:
            self._extend("weight", np.ones(len(edges), np.float32) if edges.weight is None
                         else edges.weight)
        for side, features in (("lhsd", edges.lhs_features), ("rhsd", edges.rhs_features)):
            if features is None and f"{side}_offsets" not in self._sizes:
                continue
            if f"{side}_offsets" not in self._sizes:
                self._create(f"{side}_offsets", np.int64)
                self._create(f"{side}_data", np.int64)
                self._extend(f"{side}_offsets", np.zeros(n + 1, np.int64))
            if features is None:
                features = FeatureList(np.zeros(len(edges) + 1, np.int64), np.empty(0, np.int64))
            base = self._sizes[f"{side}_data"]
            self._extend(f"{side}_offsets", features.offsets[1:] + base)
            self._extend(f"{side}_data", features.data)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._hf.close()
        self._atomic.__exit__(exc_type, exc, tb)


def write_edges(edge_path: PathLike, bucket: Bucket, edges: EdgeList) -> None:
    """Write a whole bucket at once, contiguously (the file is as small as its data)."""
    with atomic_path(edges_file(edge_path, bucket)) as tmp:
        with h5py.File(tmp, "w") as hf:
            hf.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
            for name in ID_DATASETS:
                hf.create_dataset(name, data=np.asarray(getattr(edges, name), dtype=np.int64))
            if edges.weight is not None:
                hf.create_dataset("weight", data=np.asarray(edges.weight, dtype=np.float32))
            for side, features in (("lhsd", edges.lhs_features), ("rhsd", edges.rhs_features)):
                if features is not None:
                    hf.create_dataset(f"{side}_offsets", data=features.offsets.astype(np.int64))
                    hf.create_dataset(f"{side}_data", data=features.data.astype(np.int64))


def check_edges(edges: EdgeList, bucket: Bucket, config: ConfigSchema,
                entity_counts: Dict[str, List[int]], num_relation_ids: int,
                where: str) -> None:
    """Refuse edges whose relation id or entity offsets fall outside the graph.

    `where` names the file (and chunk) for the message. For featurized types
    the feature ids are checked against the partition's count instead.
    """
    if len(edges) == 0:
        return
    rel_lo, rel_hi = int(edges.rel.min()), int(edges.rel.max())
    if rel_lo < 0 or rel_hi >= num_relation_ids:
        bad = rel_lo if rel_lo < 0 else rel_hi
        raise PbgRayError(f"{where}: relation id {bad} is outside the config's "
                          f"{num_relation_ids} relation types (ids 0..{num_relation_ids - 1}). "
                          "The edges were imported with a different config.")
    rel_types = [config.relations[0]] if config.dynamic_relations else config.relations
    for side, offsets, features in (("lhs", edges.lhs, edges.lhs_features),
                                    ("rhs", edges.rhs, edges.rhs_features)):
        entity_of_rel = np.array([getattr(r, side) for r in rel_types], dtype=object)
        entity_ids = np.zeros(len(edges), dtype=np.int64) if config.dynamic_relations else edges.rel
        for entity in dict.fromkeys(entity_of_rel):
            mask = entity_of_rel[entity_ids] == entity if len(rel_types) > 1 else slice(None)
            econf = config.entities[entity]
            part = bucket.lhs if side == "lhs" else bucket.rhs
            part = part if econf.num_partitions > 1 else 0
            count = entity_counts[entity][part]
            if econf.featurized:
                if features is None:
                    raise PbgRayError(f"{where}: entity type {entity!r} is featurized but the file "
                                      f"has no {side}d_offsets/{side}d_data datasets.")
                ids = features.data if len(rel_types) == 1 else np.concatenate(
                    [features.data[features.offsets[i]:features.offsets[i + 1]]
                     for i in np.flatnonzero(mask)] or [np.empty(0, np.int64)])
            else:
                ids = offsets[mask]
            if len(ids) and (ids.min() < 0 or ids.max() >= count):
                bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                raise PbgRayError(f"{where}: {side} index {bad} is outside partition {part} of "
                                  f"entity type {entity!r}, which has {count} entities "
                                  "(entity_count file). Edges and entity counts don't match: "
                                  "re-import both together.")
