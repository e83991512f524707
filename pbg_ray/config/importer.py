"""The `importer` section of the config: what `python -m pbg_ray.import_edges` reads and how."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional


@dataclass
class ImportConfig:
    """`python -m pbg_ray.import_edges`: raw edge files into entity_path and edge paths."""

    # Raw files, one per output edge path: edge_paths then eval_edge_paths, in
    # that order. Entity and relation dictionaries come from the first file.
    inputs: List[str] = field(default_factory=list)
    # tsv, csv or parquet; null: from the extension (.tsv/.txt, .csv, .parquet/.pq,
    # each optionally .gz). Gzip is recognised by the file's first bytes.
    format: Optional[str] = None
    # Columns: an integer is a 0-based index, a string a column name (text
    # files then need a header line). rel_col null: every edge has relation 0.
    lhs_col: Any = 0
    rel_col: Any = 1
    rhs_col: Any = 2
    weight_col: Any = None
    # Text files: whether the first line names the columns (null: yes iff a
    # column is given by name); field delimiter (null: tab for tsv, comma for csv).
    header: Optional[bool] = None
    delimiter: Optional[str] = None
    # As in PBG: names seen fewer times are dropped with their edges.
    entity_min_count: int = 1
    relation_type_min_count: int = 1  # dynamic_relations only
    # Count and report malformed rows instead of stopping at the first one.
    skip_bad_rows: bool = False
    # Seeds the shuffle that spreads entities over partitions.
    seed: int = 0
    # Replace a different graph already in the output directories.
    overwrite: bool = False
    # Incremental import: a previous import's entity_path (never modified). Its entities
    # keep their partition and offset (and, with dynamic_relations, its relations their
    # ids); new names are appended to the ends of partitions, the smallest first. Known
    # names are kept whatever their count here.
    previous_entity_path: Optional[str] = None
    # With previous_entity_path: edge paths of that import, paired in order with this
    # import's outputs (edge_paths then eval_edge_paths); each output bucket then holds
    # the previous path's edges followed by the new ones. Empty: the new edges only.
    previous_edge_paths: List[str] = field(default_factory=list)

    def validate(self, fail: Callable[[str, str, str], None]) -> None:
        """Rules of this section; `fail(key, problem, fix)` raises."""
        for key in ("entity_min_count", "relation_type_min_count"):
            if getattr(self, key) < 0:
                fail(f"importer.{key}", f"must not be negative, got {getattr(self, key)}",
                     f"Set importer.{key} to 0 or more.")
        if self.previous_edge_paths and self.previous_entity_path is None:
            fail("importer.previous_edge_paths", "needs importer.previous_entity_path: the "
                 "entity dictionary those edges were imported with",
                 "Set importer.previous_entity_path, or leave previous_edge_paths empty.")
