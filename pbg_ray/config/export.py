"""The `export` section of the config: what `python -m pbg_ray.export` writes and where."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from pbg_ray.config.options import Fail, each, one_of, option

# "bundle" is written by pbg_ray.checkpoints.bundle, the others by pbg_ray.io.embedding_tables.
EXPORT_FORMATS = ("tsv", "parquet", "bundle")
PRECISIONS = ("fp32", "fp16", "int8")  # a bundle's variants of a version


@dataclass
class ExportConfig:
    """`python -m pbg_ray.export`: a checkpoint's embeddings as TSV or Parquet, or a
    model bundle (pbg_ray.checkpoints.bundle), written by a Ray task per entity partition."""

    format: str = option("tsv", check=one_of(EXPORT_FORMATS), help=
        "tsv (torchbiggraph_export_to_tsv's layout), parquet (a dataset of one file per "
        "entity partition), or bundle (<output>/bundle.zip); _SUCCESS is written last")
    version: Optional[int] = option(None, help=
        "The checkpoint version to export; null: the best on validation (best/) where "
        "training kept one (validation.edge_paths), else the newest.")
    output: Optional[str] = option(None, location=True, help=
        "The output directory, a local path or a URI (s3://bucket/dir, as checkpoint_path); "
        "null: <checkpoint_path>/export.")
    versions: Optional[List[int]] = option(None, help=
        "format=bundle: the checkpoint versions written as tags v{N}; null: `version` alone.")
    variants: List[str] = option(factory=lambda: ["fp32"], check=each(one_of(PRECISIONS)), help=
        "format=bundle: the precisions of each version's tags: fp32 (tag v{N}, with the "
        "optimizer state), fp16 and int8 (scale per row) (tags v{N}-fp16, v{N}-int8: entity "
        "embeddings reduced, relation parameters shared with the other tags).")

    def validate(self, fail: Fail) -> None:
        """The rule across this section's fields; `fail(key, problem, fix)` raises."""
        if self.format != "bundle" and (self.versions is not None or self.variants != ["fp32"]):
            fail("export.versions", "export.versions and export.variants apply to "
                 f"export.format=bundle, not to format={self.format}",
                 "Use export.version to pick the version exported.")
