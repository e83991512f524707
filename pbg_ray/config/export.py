"""The `export` section of the config: what `python -m pbg_ray.export` writes and where."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

# "bundle" is written by pbg_ray.checkpoints.bundle, the others by pbg_ray.io.embedding_tables.
EXPORT_FORMATS = ("tsv", "parquet", "bundle")


@dataclass
class ExportConfig:
    """`python -m pbg_ray.export`: a checkpoint's embeddings as TSV or Parquet, or a
    model bundle (pbg_ray.checkpoints.bundle)."""

    # tsv (torchbiggraph_export_to_tsv's layout), parquet, or bundle (<output>/bundle.zip)
    format: str = "tsv"
    version: Optional[int] = None  # checkpoint version; null: the newest
    output: Optional[str] = None  # directory; null: <checkpoint_path>/export
    # format=bundle: the checkpoint versions written as tags v{N}; null: `version` alone.
    versions: Optional[List[int]] = None
    # format=bundle: the precisions of each version's tags: fp32 (tag v{N}, with the
    # optimizer state), fp16 and int8 (scale per row) (tags v{N}-fp16, v{N}-int8: entity
    # embeddings reduced, relation parameters shared with the other tags).
    variants: List[str] = field(default_factory=lambda: ["fp32"])
