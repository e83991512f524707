"""Helpers of the importer's tests: raw edge files, configs that import them, and the
imported edges decoded back to names."""

from __future__ import annotations

import bz2
import collections
import gzip
from pathlib import Path
from typing import Any, List, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer import import_graph
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import load_entity_names, load_relation_names
from pbg_ray.types import Bucket
from tests.util import config_dict

RELATIONS = ["follows", "likes"]


def random_rows(n: int, seed: int = 0, num_names: int = 40) -> List[Tuple[str, str, str]]:
    """(lhs, relation, rhs) rows over `num_names` names, short ones and long ones."""
    rng = np.random.default_rng(seed)
    names = [f"n{i}" if i % 2 else f"entity-with-a-long-name-{i}" for i in range(num_names)]
    return [(names[rng.integers(num_names)], RELATIONS[rng.integers(2)],
             names[rng.integers(num_names)]) for _ in range(n)]


PYTHON_CODECS = {"gzip": gzip.compress, "bz2": bz2.compress}


def compress(data: bytes, codec: str) -> bytes:
    """`data` in the stream format of `codec` (gzip and bz2 by Python's own modules, zstd
    and LZ4 frames by Arrow's)."""
    if codec in PYTHON_CODECS:
        return PYTHON_CODECS[codec](data)
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, codec) as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


SUFFIX_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}


def write_text(path: Path, rows: Sequence[tuple], delimiter: str = "\t",
               header: Sequence[str] = None, codec: str = None) -> str:
    """Rows as delimited text, compressed with `codec` or as the suffix says (.gz, .bz2,
    .zst, .lz4); returns the path."""
    lines = [delimiter.join(header)] if header else []
    lines += [delimiter.join(map(str, r)) for r in rows]
    data = ("\n".join(lines) + "\n").encode()
    codec = codec or SUFFIX_CODECS.get(path.suffix)
    path.write_bytes(compress(data, codec) if codec else data)
    return str(path)


def write_parquet(path: Path, rows: Sequence[tuple], columns=("src", "rel", "dst"),
                  **kwargs: Any) -> str:
    pq.write_table(pa.table({c: [r[i] for r in rows] for i, c in enumerate(columns)}), path,
                   **kwargs)
    return str(path)


def make(tmp_path: Path, inputs: List[str], entities=None, relations=None,
         **importer: Any) -> ConfigSchema:
    """A config importing `inputs` under tmp_path: one node type in 2 partitions and the
    relations RELATIONS unless given; the first input to train, the others to eval0, eval1...
    Keyword arguments are importer settings (and dynamic_relations and the ray section)."""
    data = config_dict(
        tmp_path, entities=entities or {"node": {"num_partitions": 2}},
        relations=relations or [{"name": r, "lhs": "node", "rhs": "node"} for r in RELATIONS],
        edge_paths=[str(tmp_path / "train")], global_emb=False)
    if len(inputs) > 1:
        data["eval_edge_paths"] = [str(tmp_path / f"eval{i}") for i in range(1, len(inputs))]
    data.update({k: importer.pop(k) for k in ("dynamic_relations", "ray") if k in importer})
    data["importer"] = dict(inputs=inputs, **importer)
    return ConfigSchema.from_dict(data)


def decoded(config: ConfigSchema, edge_path: str, weights: bool = False) -> collections.Counter:
    """Every edge of an edge path as (lhs name, rel name, rhs name[, weight])."""
    rel_names = (load_relation_names(config.entity_path) if config.dynamic_relations
                 else [r.name for r in config.relations])
    names = {(t, p): load_entity_names(config.entity_path, t, p)
             for t, e in config.entities.items() for p in range(e.num_partitions)}
    out = []
    nparts = config.num_partitions()
    for lhs_p in range(nparts):
        for rhs_p in range(nparts):
            edges = read_edges(edge_path, Bucket(lhs_p, rhs_p))
            for i, (l, r, h) in enumerate(zip(edges.lhs, edges.rel, edges.rhs)):
                rel = config.relations[0 if config.dynamic_relations else r]
                lp = lhs_p if config.entities[rel.lhs].num_partitions > 1 else 0
                rp = rhs_p if config.entities[rel.rhs].num_partitions > 1 else 0
                row = (names[rel.lhs, lp][l], rel_names[r], names[rel.rhs, rp][h])
                out.append(row + (float(edges.weight[i]),) if weights else row)
    return collections.Counter(out)


def error_of(config: ConfigSchema) -> str:
    """The message of the PbgRayError that importing `config` raises."""
    with pytest.raises(PbgRayError) as err:
        import_graph(config)
    return str(err.value)
