"""Exported embeddings: TSV in torchbiggraph_export_to_tsv's layout, or Parquet.

TSV: `entities.tsv` has one line per entity, its name then its values ("%.9f",
tab-separated); `relation_types.tsv` one line per operator parameter: relation
name, side, operator, parameter, shape ("8" or "8x8"), then its values
(flattened). Parquet: `entities.parquet` has one row per entity (type,
partition, offset, name, embedding as a fixed-size list of float32; with
entity types of several dimensions, one `entities_dim{D}.parquet` per
dimension), `relation_types.parquet` the same columns as the TSV with the
values as a list of float32.

Both files appear only when complete.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pbg_ray.config.export import EXPORT_FORMATS
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.io.files import PathLike, atomic_path
from pbg_ray.io.storage import StoragePath, storage_path

TSV_ROWS_PER_WRITE = 4096



class EmbeddingTables(contextlib.ExitStack):
    """Writes the export's files into `directory`; use as a context manager."""

    def __init__(self, directory: PathLike, fmt: str) -> None:
        super().__init__()
        if fmt not in EXPORT_FORMATS:
            raise PbgRayError(f"export.format: unknown format {fmt!r}{did_you_mean(fmt, EXPORT_FORMATS)}. "
                              f"Valid values: {', '.join(EXPORT_FORMATS)}.")
        self.directory = storage_path(directory)
        self.format = fmt
        self.files: List[StoragePath] = []
        self._entity_writers: Dict[int, pq.ParquetWriter] = {}
        self._relation_rows: List[tuple] = []
        self._dims: Optional[set] = None

    def _open(self, name: str) -> Path:
        """A temporary path that replaces directory/name when the export succeeds."""
        self.files.append(self.directory / name)
        return self.enter_context(atomic_path(self.directory / name))

    def expect_dimensions(self, dims: set) -> None:
        """The entity dimensions to come (Parquet files are split by dimension)."""
        self._dims = dims
        if self.format == "tsv":
            self._entities_tsv = self.enter_context(open(self._open("entities.tsv"), "wt"))

    def write_entities(self, entity: str, part: int, names: List[str], embeddings: np.ndarray) -> None:
        """One partition: names [N], float32 embeddings [N, D]."""
        if self.format == "tsv":
            fmt = "%s" + "\t%.9f" * embeddings.shape[1] + "\n"
            for start in range(0, len(names), TSV_ROWS_PER_WRITE):
                stop = start + TSV_ROWS_PER_WRITE
                self._entities_tsv.write("".join(
                    fmt % (name, *row) for name, row in zip(names[start:stop],
                                                            embeddings[start:stop].tolist())))
            return
        dim = embeddings.shape[1]
        writer = self._entity_writers.get(dim)
        batch = pa.record_batch({
            "type": pa.array([entity] * len(names), pa.string()),
            "partition": pa.array(np.full(len(names), part, np.int32)),
            "offset": pa.array(np.arange(len(names), dtype=np.int64)),
            "name": pa.array(names, pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(
                pa.array(np.ascontiguousarray(embeddings, np.float32).ravel()), dim),
        })
        if writer is None:
            name = "entities.parquet" if len(self._dims) == 1 else f"entities_dim{dim}.parquet"
            writer = self._entity_writers[dim] = pq.ParquetWriter(self._open(name), batch.schema)
            self.callback(writer.close)
        writer.write_batch(batch)

    def write_relation_parameter(self, relation: str, side: str, operator: str, param: str,
                                 value: np.ndarray) -> None:
        shape = "x".join(str(d) for d in value.shape)
        self._relation_rows.append((relation, side, operator, param, shape,
                                    np.asarray(value, np.float32).ravel()))

    def __exit__(self, *exc) -> bool:
        if exc[0] is None:
            self._write_relations()
        return super().__exit__(*exc)

    def _write_relations(self) -> None:
        rows = self._relation_rows
        if self.format == "tsv":
            with open(self._open("relation_types.tsv"), "wt") as f:
                f.write("".join("\t".join(row[:5]) + "".join("\t%.9f" % x for x in row[5].tolist())
                                + "\n" for row in rows))
            return
        columns = list(zip(*rows)) or [[]] * 6
        table = pa.table({
            "relation": pa.array(columns[0], pa.string()), "side": pa.array(columns[1], pa.string()),
            "operator": pa.array(columns[2], pa.string()), "param": pa.array(columns[3], pa.string()),
            "shape": pa.array(columns[4], pa.string()),
            "values": pa.array([list(v) for v in columns[5]], pa.list_(pa.float32())),
        })
        pq.write_table(table, self._open("relation_types.parquet"))
