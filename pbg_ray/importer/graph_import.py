"""Raw edge files -> PBG's v1 layout: entity dictionaries and edge buckets.

One parse per input: each batch's names become ids (io/name_index.py) and the
edges go to a spill file of compact id records. After the first input, each
entity type's dictionary is fixed: names seen fewer than entity_min_count times
are dropped, the rest put in a canonical order (by key, independent of row
order), shuffled with the seed and cut into contiguous partitions, as PBG does.
That is a remap of ids, applied while the spill is routed into buckets with a
stable radix sort. Later inputs (valid/test) look names up in the first
input's dictionaries; edges with unseen names are counted and reported.

An incremental import (importer.previous_entity_path) seeds each dictionary
with a previous import's names: they keep their partition and offset, and the
new names are appended to the ends of partitions, the smallest partitions
first; with importer.previous_edge_paths, the previous edges go into the output
buckets ahead of the new ones.

Everything is written into staging directories and moved into place at the
end, buckets first, entity files next, the manifest last: a failed import
leaves the output directories as they were.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

import h5py
import numpy as np
import pyarrow as pa
from tqdm import tqdm

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.io.edges import (
    FORMAT_VERSION, FORMAT_VERSION_ATTR, count_edges, edges_file, read_edges)
from pbg_ray.io.entities import (
    dynamic_rel_names_file, entity_count_file, load_entity_names, load_relation_names,
    save_dynamic_rel_count, save_entity_count, save_entity_names, save_relation_names)
from pbg_ray.io.files import write_text_atomic
from pbg_ray.io.raw import RawBatch, RawTable
from pbg_ray.io.storage import StoragePath, move_into, storage_path
from pbg_ray.types import Bucket

logger = logging.getLogger("pbg_ray")

MANIFEST = "pbg_ray_import.json"
SPILL_CHUNK = 1 << 20  # edges routed into buckets at a time
MAX_OPEN_BUCKETS = 256
GRAPH_FILE_PATTERNS = ("entity_count_*.txt", "entity_names_*.json", "dynamic_rel_count.txt",
                       "dynamic_rel_names.json", "edges_*_*.h5", MANIFEST)


def _spill_dtype(weighted: bool) -> np.dtype:
    fields = [("lhs", "<i8"), ("rhs", "<i8"), ("rel", "<i4")]
    return np.dtype(fields + [("weight", "<f4")] if weighted else fields)


@dataclasses.dataclass
class Dictionary:
    """One entity type's ids (order of first appearance) -> partition and offset."""

    part: np.ndarray  # int64 per id, -1: dropped (too rare)
    offset: np.ndarray  # int64 per id
    names: List[List[str]]  # per partition


def _shuffled(index: NameIndex, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`ids` in a canonical order (by key, independent of row order), then shuffled."""
    canonical = ids[np.argsort(index.keys()[ids], kind="stable")]
    return canonical[rng.permutation(len(canonical))]


def partition_names(index: NameIndex, num_partitions: int, min_count: int,
                    rng: np.random.Generator) -> Dictionary:
    """PBG's dictionary: frequent-enough names, shuffled, cut into contiguous ranges
    (partition p holds positions ceil(p n / P) .. ceil((p + 1) n / P) - 1)."""
    order = _shuffled(index, np.flatnonzero(index.counts >= min_count), rng)
    n, parts = len(order), num_partitions
    position = np.arange(n, dtype=np.int64)
    part_of_position = position * parts // max(n, 1)
    starts = (np.arange(parts + 1, dtype=np.int64) * n + parts - 1) // parts
    part = np.full(len(index), -1, np.int64)
    offset = np.full(len(index), -1, np.int64)
    part[order] = part_of_position
    offset[order] = position - starts[part_of_position]
    ordered = index.names().take(pa.array(order))
    names = [ordered.slice(starts[p], starts[p + 1] - starts[p]).to_pylist() for p in range(parts)]
    return Dictionary(part, offset, names)


def fill_smallest(counts: np.ndarray, n: int) -> np.ndarray:
    """How many of `n` new entities each partition of `counts` [P] gets, the smallest
    filled first: all partitions below a level are raised to it, and what is left goes
    one each to the partitions at the level, lowest index first."""
    lo, hi = int(counts.min()), int(counts.min()) + n
    while lo < hi:  # the highest level reachable with n entities
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if np.maximum(mid - counts, 0).sum() <= n else (lo, mid - 1)
    added = np.maximum(lo - counts, 0)
    at_level = np.flatnonzero(counts + added == lo)
    added[at_level[:n - int(added.sum())]] += 1
    return added


def extend_names(index: NameIndex, previous: List[List[str]], min_count: int,
                 rng: np.random.Generator) -> Dictionary:
    """A previous dictionary grown by the new names of `index`, whose first ids are the
    previous names partition by partition (seeded before parsing). Known names keep
    their (partition, offset) whatever their count; new names seen min_count times are
    shuffled and appended to the ends of partitions (fill_smallest)."""
    counts = np.array([len(names) for names in previous], np.int64)
    known = int(counts.sum())
    new_ids = np.arange(known, len(index), dtype=np.int64)
    order = _shuffled(index, new_ids[index.counts[known:] >= min_count], rng)
    added = fill_smallest(counts, len(order))
    part = np.full(len(index), -1, np.int64)
    offset = np.full(len(index), -1, np.int64)
    part[:known] = np.repeat(np.arange(len(counts)), counts)
    offset[:known] = np.arange(known) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = np.concatenate([[0], np.cumsum(added)])
    ordered = index.names().take(pa.array(order))
    names = []
    for p, old in enumerate(previous):
        ids = order[starts[p]:starts[p + 1]]
        part[ids], offset[ids] = p, counts[p] + np.arange(len(ids))
        names.append(old + ordered.slice(starts[p], added[p]).to_pylist())
    return Dictionary(part, offset, names)


class GraphImport:
    """One import: the config's graph from `config.importer.inputs`."""

    def __init__(self, config: ConfigSchema) -> None:
        self.config = config
        self.settings = config.importer
        self.outputs = [storage_path(p) for p in config.edge_paths + config.eval_edge_paths]
        self.entity_path = storage_path(config.entity_path)
        self._check_settings()
        # Relation id -> index of its lhs / rhs entity type in `self.types`.
        self.relations = config.relations
        self.types = list(dict.fromkeys(t for r in self.relations for t in (r.lhs, r.rhs)))
        self.lhs_type = np.array([self.types.index(r.lhs) for r in self.relations], np.int64)
        self.rhs_type = np.array([self.types.index(r.rhs) for r in self.relations], np.int64)
        self.entity_index = {t: NameIndex(f"entity type {t!r}") for t in self.types}
        self.relation_index = NameIndex("relation names")
        if not config.dynamic_relations:
            self.relation_index.add(pa.array([r.name for r in self.relations], pa.string()))
        self.previous_names, self.previous_relations = self._load_previous()
        self.weighted = self.settings.weight_col is not None
        self.spill_dtype = _spill_dtype(self.weighted)
        self.num_parts = {side: max(config.entities[getattr(r, side)].num_partitions
                                    for r in self.relations) for side in ("lhs", "rhs")}

    def _check_settings(self) -> None:
        s, config = self.settings, self.config
        if len(s.inputs) != len(self.outputs):
            raise PbgRayError(
                f"importer.inputs lists {len(s.inputs)} file(s) but the config has "
                f"{len(self.outputs)} edge path(s) (edge_paths then eval_edge_paths: "
                f"{[str(p) for p in self.outputs]}). Give one input file per edge path.")
        if len(set(self.outputs)) != len(self.outputs):
            raise PbgRayError("edge_paths and eval_edge_paths repeat a directory; each input "
                              "needs its own output directory.")
        for key in ("entity_min_count", "relation_type_min_count"):
            if getattr(s, key) < 0:
                raise PbgRayError(f"importer.{key} must not be negative, got {getattr(s, key)}.")
        featurized = [name for name, e in config.entities.items() if e.featurized]
        if featurized:
            raise PbgRayError(f"entity types {featurized} are featurized; the importer reads "
                              "plain entity names only. Set featurized=false for them.")
        if config.dynamic_relations and s.rel_col is None:
            raise PbgRayError("dynamic_relations=true needs importer.rel_col: the column that "
                              "names each edge's relation.")
        if s.previous_entity_path is None:
            if s.previous_edge_paths:
                raise PbgRayError("importer.previous_edge_paths needs importer.previous_entity_path: "
                                  "the entity dictionary those edges were imported with.")
            return
        previous = storage_path(s.previous_entity_path).resolve()
        if not previous.is_dir():
            raise PbgRayError(f"importer.previous_entity_path {str(previous)!r} is not a "
                              "directory. Give a previous import's entity_path.")
        if previous == self.entity_path.resolve():
            raise PbgRayError(f"importer.previous_entity_path is entity_path ({str(previous)!r}); "
                              "the previous import is never modified in place. Point entity_path "
                              "at a new directory.")
        if len(s.previous_edge_paths) > len(self.outputs):
            raise PbgRayError(f"importer.previous_edge_paths lists {len(s.previous_edge_paths)} "
                              f"path(s) for {len(self.outputs)} output edge path(s). Give at most "
                              "one per output (edge_paths then eval_edge_paths).")
        outputs = {p.resolve() for p in self.outputs}
        for path in s.previous_edge_paths:
            if storage_path(path).resolve() in outputs:
                raise PbgRayError(f"importer.previous_edge_paths names {path!r}, an output edge "
                                  "path; the previous import is never modified in place. Write "
                                  "the grown graph's edges to new directories.")

    def _load_previous(self) -> tuple:
        """({entity type: names per partition}, relation names or None) of the previous
        import, seeded into the name indexes so that their ids come first."""
        path = self.settings.previous_entity_path
        if path is None:
            return {}, None
        names: Dict[str, List[List[str]]] = {}
        for name in self.types:
            parts = self.config.entities[name].num_partitions
            present = [entity_count_file(path, name, p).is_file() for p in range(parts + 1)]
            if not any(present):
                continue  # a new entity type: all its names are new
            if not all(present[:parts]) or present[parts]:
                found = sum(1 for _ in storage_path(path).glob(f"entity_count_{name}_*.txt"))
                raise PbgRayError(
                    f"importer.previous_entity_path {path!r} has {found} partition(s) of entity "
                    f"type {name!r}, the config {parts}. Known entities keep their partitions: "
                    f"set entities.{name}.num_partitions={found}.")
            names[name] = [load_entity_names(path, name, p) for p in range(parts)]
            self._seed(self.entity_index[name], [n for ns in names[name] for n in ns],
                       f"entity type {name!r}")
        if not self.config.dynamic_relations:
            self._check_previous_relations(storage_path(path))
            return names, None
        if not dynamic_rel_names_file(path).is_file():
            raise PbgRayError(f"importer.previous_entity_path {path!r} has no "
                              "dynamic_rel_names.json, so it wasn't imported with "
                              "dynamic_relations=true. Import both the same way.")
        relations = load_relation_names(path)
        self._seed(self.relation_index, relations, "relations")
        return names, relations

    def _seed(self, index: NameIndex, names: List[str], what: str) -> None:
        """Known names get the first ids, in the previous import's order."""
        index.add(pa.array(names, pa.string()))
        if len(index) != len(names):
            raise PbgRayError(f"importer.previous_entity_path {self.settings.previous_entity_path!r}"
                              f": {what} lists a name twice, so its ids are ambiguous. Fix the "
                              "previous import's entity files.")

    def _check_previous_relations(self, previous: StoragePath) -> None:
        """Relation ids are positions in `relations`: the previous import's must come first."""
        try:
            identity = json.loads((previous / MANIFEST).read_text())["identity"]
            before = [r["name"] for r in identity["relations"]]
        except (OSError, ValueError, KeyError, TypeError):
            return  # not imported by pbg_ray: nothing to compare with
        now = [r.name for r in self.relations]
        if now[:len(before)] != before:
            raise PbgRayError(f"the config's relations {now} don't start with those of the "
                              f"previous import {before} ({str(previous / MANIFEST)!r}); relation "
                              "ids would change. Keep the old relations first, in their order, "
                              "and add new ones at the end.")

    # --- parsing -------------------------------------------------------------

    def _relation_ids(self, batch: RawBatch, learn: bool) -> np.ndarray:
        if batch.rel is None:
            return np.zeros(len(batch), np.int64)
        if learn and self.config.dynamic_relations:
            return self.relation_index.add(batch.rel)
        return self.relation_index.lookup(batch.rel)

    def _entity_ids(self, batch: RawBatch, rel: np.ndarray, learn: bool) -> tuple:
        """(lhs ids, rhs ids), each within its own entity type; -1 where unseen."""
        lhs_ids = np.empty(len(batch), np.int64)
        rhs_ids = np.empty(len(batch), np.int64)
        rel_types = np.zeros(len(batch), np.int64) if self.config.dynamic_relations else rel
        for t, name in enumerate(self.types):
            index = self.entity_index[name]
            lmask = self.lhs_type[rel_types] == t
            rmask = self.rhs_type[rel_types] == t
            lhs = batch.lhs if lmask.all() else batch.lhs.filter(pa.array(lmask))
            rhs = batch.rhs if rmask.all() else batch.rhs.filter(pa.array(rmask))
            if not len(lhs) + len(rhs):
                continue
            both = pa.concat_arrays([lhs, rhs])
            ids = index.add(both) if learn else index.lookup(both)
            lhs_ids[lmask] = ids[:len(lhs)]
            rhs_ids[rmask] = ids[len(lhs):]
        return lhs_ids, rhs_ids

    def _parse(self, number: int, spill_path: Path, stats: Dict[str, Any]) -> None:
        """Read input `number` into a spill file of id records."""
        path = self.settings.inputs[number]
        table = RawTable(path, self.settings)
        learn = number == 0
        unseen = 0
        written = 0
        with open(spill_path, "wb") as spill, \
                tqdm(desc=f"import {Path(path).name}", unit=" edges", unit_scale=True,
                     disable=None, mininterval=1.0) as progress:
            for batch in table.batches():
                rel = self._relation_ids(batch, learn)
                if not self.config.dynamic_relations and (rel < 0).any():
                    bad = rel < 0
                    name = batch.rel[int(np.argmax(bad))].as_py()
                    names = [r.name for r in self.relations]
                    table.refuse(batch, bad, f"unknown relation name {name!r}"
                                 f"{did_you_mean(name, names)}",
                                 f"Relation names must be among the config's relations {names} "
                                 "(or set dynamic_relations=true).")
                    batch, rel = batch.take(~bad), rel[~bad]
                lhs, rhs = self._entity_ids(batch, rel, learn)
                known = (lhs >= 0) & (rhs >= 0) & (rel >= 0)
                unseen += int(len(known) - known.sum())
                records = np.empty(int(known.sum()), self.spill_dtype)
                records["lhs"], records["rhs"], records["rel"] = lhs[known], rhs[known], rel[known]
                if self.weighted:
                    records["weight"] = batch.weight[known]
                records.tofile(spill)
                written += len(records)
                progress.update(len(batch))
        stats.update(input=str(path), format=table.format, rows=table.num_rows,
                     bad_rows=table.bad_rows, bad_row_examples=table.bad_examples)
        if not learn:
            stats["dropped_unseen"] = unseen
            if unseen:
                logger.warning("%s: %d edges name entities or relations the first input (%s) "
                               "never mentions; they are left out.", path, unseen,
                               self.settings.inputs[0])
        if table.bad_rows:
            logger.warning("%s: skipped %d bad rows, e.g. %s", path, table.bad_rows,
                           "; ".join(table.bad_examples))

    # --- dictionaries --------------------------------------------------------

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.settings.seed, zlib.crc32(name.encode())])

    def _build_dictionaries(self) -> None:
        self.dictionaries = {
            name: extend_names(self.entity_index[name], self.previous_names[name],
                               self.settings.entity_min_count, self._rng(f"entity {name}"))
            if name in self.previous_names else
            partition_names(self.entity_index[name], self.config.entities[name].num_partitions,
                            self.settings.entity_min_count, self._rng(f"entity {name}"))
            for name in self.types}
        if self.config.dynamic_relations:
            min_count, rng = self.settings.relation_type_min_count, self._rng("relations")
            relations = (partition_names(self.relation_index, 1, min_count, rng)
                         if self.previous_relations is None else
                         extend_names(self.relation_index, [self.previous_relations], min_count, rng))
            self.relation_remap = relations.offset  # -1: too rare
            self.relation_names = relations.names[0]
            if not self.relation_names:
                raise PbgRayError(f"no relation type occurs importer.relation_type_min_count="
                                  f"{self.settings.relation_type_min_count} times in "
                                  f"{self.settings.inputs[0]!r}. Lower the minimum.")
        else:
            self.relation_remap = np.arange(len(self.relations), dtype=np.int64)
            self.relation_names = [r.name for r in self.relations]

    def _side(self, records: np.ndarray, rel: np.ndarray, side: str, first_edge: int) -> tuple:
        """(partition, offset) of one side of each record; partition -1 if dropped."""
        types = self.lhs_type if side == "lhs" else self.rhs_type
        of_edge = types[np.zeros(len(records), np.int64) if self.config.dynamic_relations
                        else np.maximum(rel, 0)]
        ids = records[side]
        part = np.empty(len(records), np.int64)
        offset = np.empty(len(records), np.int64)
        for t, name in enumerate(self.types):
            mask = of_edge == t if len(self.types) > 1 else slice(None)
            d = self.dictionaries[name]
            part[mask], offset[mask] = d.part[ids[mask]], d.offset[ids[mask]]
            if self.config.entities[name].num_partitions == 1 and self.num_parts[side] > 1:
                # Unpartitioned types spread their edges over all buckets (v1 spec).
                spread = (first_edge + np.arange(len(records))) % self.num_parts[side]
                part[mask] = np.where(part[mask] < 0, -1, spread[mask])
        return part, offset

    def _routed(self, spill_path: Path) -> Any:
        """Yield (bucket index, lhs, rhs, rel, weight) per spill chunk, dropped edges removed."""
        count = spill_path.stat().st_size // self.spill_dtype.itemsize
        with open(spill_path, "rb") as f:
            for first in range(0, count, SPILL_CHUNK):
                records = np.fromfile(f, self.spill_dtype, count=min(SPILL_CHUNK, count - first))
                rel = self.relation_remap[records["rel"]]
                lhs_part, lhs = self._side(records, rel, "lhs", first)
                rhs_part, rhs = self._side(records, rel, "rhs", first)
                keep = (rel >= 0) & (lhs_part >= 0) & (rhs_part >= 0)
                bucket = lhs_part[keep] * self.num_parts["rhs"] + rhs_part[keep]
                weight = records["weight"][keep] if self.weighted else None
                yield bucket, lhs[keep], rhs[keep], rel[keep], weight

    # --- buckets -------------------------------------------------------------

    def _bucket(self, index: int) -> Bucket:
        return Bucket(index // self.num_parts["rhs"], index % self.num_parts["rhs"])

    def _write_buckets(self, spill_path: Path, stage: Path,
                       previous: Optional[str]) -> Dict[str, int]:
        num_buckets = self.num_parts["lhs"] * self.num_parts["rhs"]
        sizes = np.zeros(num_buckets, np.int64)
        for bucket, *_ in self._routed(spill_path):
            sizes += np.bincount(bucket, minlength=num_buckets)
        total = int(spill_path.stat().st_size // self.spill_dtype.itemsize)
        new_edges = int(sizes.sum())
        old = np.array([count_edges(previous, self._bucket(b)) if previous else 0
                        for b in range(num_buckets)], np.int64)
        sizes += old
        sort_dtype = np.uint16 if num_buckets <= 1 << 16 else np.int64  # radix sort below 2^16
        for group in range(0, num_buckets, MAX_OPEN_BUCKETS):
            ids = range(group, min(group + MAX_OPEN_BUCKETS, num_buckets))
            files = {b: self._create_bucket(stage, b, int(sizes[b])) for b in ids}
            filled = {b: int(old[b]) for b in ids}
            try:
                for b in ids:
                    if old[b]:
                        self._copy_previous(previous, self._bucket(b), files[b])
                for bucket, lhs, rhs, rel, weight in self._routed(spill_path):
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

    def _copy_previous(self, previous: str, bucket: Bucket, hf: h5py.File) -> None:
        """The previous import's edges of `bucket` into the first rows of hf's datasets."""
        num_chunks = max(1, -(-count_edges(previous, bucket) // SPILL_CHUNK))
        at = 0
        for chunk in range(num_chunks):
            edges = read_edges(previous, bucket, chunk, num_chunks)
            if edges.weight is not None and not self.weighted:
                raise PbgRayError(f"{str(edges_file(previous, bucket))!r} (importer."
                                  "previous_edge_paths) holds edge weights; set importer.weight_col "
                                  "so that the grown graph keeps them.")
            end = at + len(edges)
            for name in ("lhs", "rhs", "rel"):
                hf[name][at:end] = getattr(edges, name)
            if self.weighted:
                hf["weight"][at:end] = 1.0 if edges.weight is None else edges.weight
            at = end

    def _create_bucket(self, stage: Path, index: int, size: int) -> h5py.File:
        """An edge file with contiguous datasets of the bucket's final size."""
        hf = h5py.File(edges_file(stage, self._bucket(index)), "w")
        hf.attrs[FORMAT_VERSION_ATTR] = FORMAT_VERSION
        for name in ("lhs", "rhs", "rel"):
            hf.create_dataset(name, shape=(size,), dtype=np.int64)
        if self.weighted:
            hf.create_dataset("weight", shape=(size,), dtype=np.float32)
        return hf

    # --- output directories --------------------------------------------------

    def _graph_files(self) -> List[Path]:
        dirs = [self.entity_path] + self.outputs
        return sorted({p for d in dirs if d.is_dir() for pattern in GRAPH_FILE_PATTERNS
                       for p in d.glob(pattern)})

    def _identity(self) -> Dict[str, Any]:
        """What makes two imports the same: inputs (with size and mtime), graph, settings."""
        inputs = []
        for path in self.settings.inputs:
            stat = Path(path).stat() if Path(path).is_file() else None
            inputs.append({"path": os.path.abspath(path), "size": stat and stat.st_size,
                           "mtime_ns": stat and stat.st_mtime_ns})
        config = self.config.to_dict()
        settings = {k: v for k, v in config["importer"].items() if k not in ("inputs", "overwrite")}
        return {"inputs": inputs, "outputs": [str(p) for p in self.outputs],
                "entities": config["entities"], "relations": config["relations"],
                "dynamic_relations": config["dynamic_relations"], "importer": settings}

    def _previous_import(self) -> Optional[Dict[str, Any]]:
        """The stats of this very import if it is already done; refuses a different
        graph in the output directories unless importer.overwrite is set."""
        existing = self._graph_files()
        if not existing:
            return None
        manifest = self.entity_path / MANIFEST
        try:
            previous = json.loads(manifest.read_text())
        except (OSError, ValueError):
            previous = {}
        if previous.get("identity") == self._identity():
            return previous.get("stats")
        if self.settings.overwrite:
            return None
        raise PbgRayError(
            f"the output directories already hold a different graph ({len(existing)} files, e.g. "
            f"{str(existing[0])!r}){'' if previous else ', not imported by pbg_ray'}. Set "
            "importer.overwrite=true to replace it, or point entity_path and edge_paths elsewhere.")

    def _commit(self, entity_stage: Path, edge_stages: List[Path], stats: Dict[str, Any]) -> None:
        """Move the staged files into place (rename, or upload to object storage):
        buckets, entity files, manifest last."""
        for path in self._graph_files():
            if path.name == MANIFEST:
                path.unlink()  # first: a half-replaced graph must not look complete
        for path in self._graph_files():
            path.unlink()
        for stage, output in zip(edge_stages, self.outputs):
            for path in sorted(stage.glob("edges_*_*.h5")):
                move_into(path, output / path.name)
        for path in sorted(entity_stage.iterdir()):
            if path.name != MANIFEST:
                move_into(path, self.entity_path / path.name)
        write_text_atomic(self.entity_path / MANIFEST,
                          json.dumps({"identity": self._identity(), "stats": stats}, indent=1))

    # --- the whole import ----------------------------------------------------

    @staticmethod
    def _stage_dir(output: StoragePath, scratch: Path) -> Path:
        """Where files for `output` are written first: inside it when it is local (then
        renamed into place), in local scratch space for object storage (then uploaded)."""
        return output if isinstance(output, Path) else scratch

    def run(self) -> Dict[str, Any]:
        previous = self._previous_import()
        if previous is not None:
            logger.warning("%s already holds this import; nothing to do.", self.entity_path)
            return previous
        started = time.perf_counter()
        tag = f".import-{os.getpid()}"
        scratch = Path(tempfile.mkdtemp(prefix="pbg_ray-import-"))
        entity_stage = self._stage_dir(self.entity_path, scratch) / f"{tag}-entities"
        edge_stages = [self._stage_dir(out, scratch) / f"{tag}-edges{i}"
                       for i, out in enumerate(self.outputs)]
        stages = [entity_stage] + edge_stages + [scratch]
        try:
            for stage in stages:
                stage.mkdir(parents=True, exist_ok=True)
            per_input = []
            for number, stage in enumerate(edge_stages):
                stats: Dict[str, Any] = {"output": str(self.outputs[number])}
                spill = stage / "spill.bin"
                self._parse(number, spill, stats)
                if number == 0:
                    self._build_dictionaries()
                previous = self.settings.previous_edge_paths[number:number + 1]
                stats.update(self._write_buckets(spill, stage, previous[0] if previous else None))
                spill.unlink()
                per_input.append(stats)
            self._write_entities(entity_stage)
            seconds = time.perf_counter() - started
            rows = sum(s["rows"] for s in per_input)
            result = {
                "inputs": per_input,
                "entities": {t: sum(map(len, self.dictionaries[t].names)) for t in self.types},
                **({"new_entities": {t: sum(map(len, self.dictionaries[t].names))
                                     - sum(map(len, self.previous_names.get(t, [])))
                                     for t in self.types}}
                   if self.settings.previous_entity_path else {}),
                "relations": len(self.relation_names),
                "seconds": round(seconds, 3),
                "rows_per_second": round(rows / seconds) if seconds else None,
            }
            self._commit(entity_stage, edge_stages, result)
            return result
        finally:
            for stage in stages:
                shutil.rmtree(stage, ignore_errors=True)

    def _write_entities(self, stage: Path) -> None:
        for name, econf in self.config.entities.items():
            dictionary = self.dictionaries.get(name)
            for part in range(econf.num_partitions):
                names = dictionary.names[part] if dictionary else []
                save_entity_names(stage, name, part, names)
                save_entity_count(stage, name, part, len(names))
        if self.config.dynamic_relations:
            save_relation_names(stage, self.relation_names)
            save_dynamic_rel_count(stage, len(self.relation_names))


def import_graph(config: ConfigSchema) -> Dict[str, Any]:
    """Import `config.importer.inputs` into config's entity_path and edge paths; returns stats."""
    return GraphImport(config).run()
