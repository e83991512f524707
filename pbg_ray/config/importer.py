"""The `importer` section of the config: what `python -m pbg_ray.import_edges` reads and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from pbg_ray.config.options import Fail, not_negative, one_of, option

ENGINES = ("local", "ray", "auto")


@dataclass
class ImportConfig:
    """`python -m pbg_ray.import_edges`: raw edge files into entity_path and edge paths."""

    inputs: List[str] = option(factory=list, location=True, help=
        "Raw inputs, one per output edge path: edge_paths then eval_edge_paths, in that order. "
        "Each is a file, a directory of shards (its files below it; names starting with _ or . "
        "left out) or a glob, on a local path or a URI (s3://, gs://, hdfs://; credentials "
        "from the environment). Entity and relation dictionaries come from the first input.")
    format: Optional[str] = option(None, help=
        "tsv, csv or parquet; null: from the extension (.tsv/.txt, .csv, .parquet/.pq, each "
        "optionally .gz, .bz2, .zst or .lz4). Compressed text (gzip, bzip2, zstd, LZ4 frames) "
        "is recognised by the file's first bytes.")
    lhs_col: Any = option(0, help=
        "The lhs column: an integer is a 0-based index, a string a column name (text files "
        "then need a header line).")
    rel_col: Any = option(1, help="The relation column; null: every edge has relation 0.")
    rhs_col: Any = option(2, help="The rhs column.")
    weight_col: Any = option(None, help="The weight column; null: no weights.")
    header: Optional[bool] = option(None, help=
        "Text files: whether the first line names the columns; null: yes iff a column is "
        "given by name.")
    delimiter: Optional[str] = option(None, help=
        "Text files: the field delimiter; null: tab for tsv, comma for csv.")
    entity_min_count: int = option(1, check=not_negative, help=
        "Names seen fewer times are dropped with their edges, as in PBG.")
    relation_type_min_count: int = option(1, check=not_negative, help=
        "Relations seen fewer times are dropped with their edges (dynamic_relations only).")
    skip_bad_rows: bool = option(False, help=
        "Count and report malformed rows instead of stopping at the first one.")
    seed: int = option(0, check=not_negative, help=
        "Seeds the shuffle that spreads entities over partitions.")
    overwrite: bool = option(False, help=
        "Replace a different graph already in the output directories.")
    engine: str = option("auto", check=one_of(ENGINES), help=
        "local: one process reads the inputs one after the other; ray: Ray tasks read shards "
        "in parallel, dictionary shards (Ray actors) give names their ids by hash partition, "
        "spilling them to disk where a local Ray's memory plan is reached, and Ray tasks "
        "write buckets in parallel (on ray.address, or a local Ray); auto: ray when joining a multi-node cluster "
        "(ray.address set) or when the inputs hold more than ray_min_bytes, else local. Both "
        "give the same entity files and the same edges in every bucket.")
    ray_min_bytes: int = option(4 << 30, check=not_negative, help=
        "engine=auto: inputs of more bytes are imported with the Ray engine.")
    previous_entity_path: Optional[str] = option(None, location=True, help=
        "Incremental import: a previous import's entity_path (never modified). Its entities "
        "keep their partition and offset (and, with dynamic_relations, its relations their "
        "ids); new names are appended to the ends of partitions, the smallest first. Known "
        "names are kept whatever their count here.")
    previous_edge_paths: List[str] = option(factory=list, location=True, help=
        "With previous_entity_path: edge paths of that import, paired in order with this "
        "import's outputs (edge_paths then eval_edge_paths); each output bucket then holds "
        "the previous path's edges followed by the new ones. Empty: the new edges only.")

    def validate(self, fail: Fail) -> None:
        """The rule across this section's fields; `fail(key, problem, fix)` raises."""
        if self.previous_edge_paths and self.previous_entity_path is None:
            fail("importer.previous_edge_paths", "needs importer.previous_entity_path: the "
                 "entity dictionary those edges were imported with",
                 "Set importer.previous_entity_path, or leave previous_edge_paths empty.")
