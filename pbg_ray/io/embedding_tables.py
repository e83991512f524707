"""Exported embeddings: TSV in torchbiggraph_export_to_tsv's layout, or Parquet, written
one entity partition at a time to a local directory or a URI (io/storage.py).

TSV: `entities.tsv` has one line per entity, its name then its values ("%.9f",
tab-separated); `relation_types.tsv` one line per operator parameter: relation
name, side, operator, parameter, shape ("8" or "8x8"), then its values
(flattened). Parquet: a dataset `entities/` with one file per entity partition,
`{type}_{partition}.parquet`, of one row per entity (type, partition, offset, name,
embedding as a fixed-size list of float32; with entity types of several dimensions,
one dataset `entities_dim{D}/` per dimension, since a dataset has one schema), and
`relation_types.parquet` with the same columns as the TSV, the values as a list of
float32.

Every file is written whole under a temporary name (or uploaded whole) and appears
only when complete; `_SUCCESS` (a JSON summary) is written last, once every file of
the export is there, and removed first when an export begins, so a reader that checks
for it never reads a partial export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pbg_ray.io.files import PathLike, atomic_path, write_text_atomic
from pbg_ray.io.storage import StoragePath, storage_path

TSV_ROWS_PER_WRITE = 4096
SUCCESS_FILE = "_SUCCESS"  # Hadoop's name: Spark and warehouse loaders look for it
ENTITIES_TSV = "entities.tsv"
# (relation, side, operator, parameter, shape, float32 values flattened)
RelationRow = Tuple[str, str, str, str, str, np.ndarray]


def begin_export(directory: PathLike) -> StoragePath:
    """The output directory, with the marker of an earlier export removed (it would
    vouch for files this export is about to replace)."""
    directory = storage_path(directory)
    (directory / SUCCESS_FILE).unlink(missing_ok=True)
    return directory


def abandon_export(directory: StoragePath, files: Iterable[StoragePath], created: bool) -> None:
    """A failed export's `files` removed (no complete-looking piece of it is left), and its
    local `directory` too if the export `created` it and nothing else is in it (but the
    empty folders the export made, such as a Parquet dataset's)."""
    for path in files:
        path.unlink(missing_ok=True)
    if created and isinstance(directory, Path) and directory.is_dir():
        folders = sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True)
        for folder in [*folders, directory]:  # the deepest first
            if not any(folder.iterdir()):
                folder.rmdir()


def finish_export(directory: StoragePath, summary: Mapping[str, Any]) -> None:
    """The marker, written last: every file of the export is complete."""
    write_text_atomic(directory / SUCCESS_FILE, json.dumps(summary, indent=1) + "\n")


def tsv_entities(names: Sequence[str], embeddings: np.ndarray) -> List[bytes]:
    """One partition's lines of entities.tsv, in pieces of TSV_ROWS_PER_WRITE lines."""
    fmt = "%s" + "\t%.9f" * embeddings.shape[1] + "\n"
    return ["".join(fmt % (name, *row) for name, row in zip(
                names[start:start + TSV_ROWS_PER_WRITE],
                embeddings[start:start + TSV_ROWS_PER_WRITE].tolist())).encode("utf-8")
            for start in range(0, len(names), TSV_ROWS_PER_WRITE)]


def write_tsv_entities(directory: StoragePath, parts: Iterable[List[bytes]]) -> StoragePath:
    """entities.tsv from the partitions' lines, in order, one partition in memory at a time."""
    path = directory / ENTITIES_TSV
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for pieces in parts:
            f.writelines(pieces)
    return path


def parquet_dataset(directory: StoragePath, dim: int, dims: Iterable[int]) -> StoragePath:
    """The dataset directory of entities of dimension `dim`, given every dimension of the export."""
    return directory / ("entities" if len(set(dims)) == 1 else f"entities_dim{dim}")


def parquet_file(directory: StoragePath, entity: str, part: int, dim: int,
                 dims: Iterable[int]) -> StoragePath:
    return parquet_dataset(directory, dim, dims) / f"{entity}_{part}.parquet"


def write_parquet_entities(path: StoragePath, entity: str, part: int, names: Sequence[str],
                           embeddings: np.ndarray) -> None:
    """One partition as one Parquet file: names [N], float32 embeddings [N, D]."""
    dim = embeddings.shape[1]
    table = pa.table({
        "type": pa.array([entity] * len(names), pa.string()),
        "partition": pa.array(np.full(len(names), part, np.int32)),
        "offset": pa.array(np.arange(len(names), dtype=np.int64)),
        "name": pa.array(names, pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(embeddings, np.float32).ravel()), dim),
    })
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def remove_stale(directory: StoragePath, keep: Iterable[StoragePath]) -> None:
    """Delete the Parquet files of an earlier export in `directory` that this one did not
    write (it had other partitions)."""
    keep = {str(p) for p in keep}
    if directory.is_dir():
        for path in directory.glob("*.parquet"):
            if str(path) not in keep:
                path.unlink(missing_ok=True)


def write_relation_types(directory: StoragePath, fmt: str, rows: List[RelationRow]) -> StoragePath:
    """relation_types.tsv or relation_types.parquet."""
    if fmt == "tsv":
        path = directory / "relation_types.tsv"
        write_text_atomic(path, "".join(
            "\t".join(row[:5]) + "".join("\t%.9f" % x for x in row[5].tolist()) + "\n"
            for row in rows))
        return path
    columns = list(zip(*rows)) or [[]] * 6
    table = pa.table({
        "relation": pa.array(columns[0], pa.string()), "side": pa.array(columns[1], pa.string()),
        "operator": pa.array(columns[2], pa.string()), "param": pa.array(columns[3], pa.string()),
        "shape": pa.array(columns[4], pa.string()),
        "values": pa.array([list(v) for v in columns[5]], pa.list_(pa.float32())),
    })
    path = directory / "relation_types.parquet"
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path


def relation_row(relation: str, side: str, operator: str, param: str,
                 value: np.ndarray) -> RelationRow:
    shape = "x".join(str(d) for d in value.shape)
    return (relation, side, operator, param, shape, np.asarray(value, np.float32).ravel())

