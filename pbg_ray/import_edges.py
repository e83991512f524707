"""python -m pbg_ray.import_edges [PBG_CONFIG.py] 'importer.inputs=[FILE,...]' [key=value ...]

Turns raw edge files (TSV, CSV, Parquet; text plain or compressed) into the config's
entity_path and edge paths (edge_paths, then eval_edge_paths: one input file
each) in PBG's v1 layout. Settings live under `importer.` (see
pbg_ray/config/importer.py: ImportConfig). Prints one JSON line of statistics.
"""

from __future__ import annotations

import json

from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.importer.ray_engine import import_graph

EXAMPLES = (
    "python -m pbg_ray.import_edges config.py 'importer.inputs=[train.tsv]'",
    "python -m pbg_ray.import_edges config.py 'importer.inputs=[train.tsv,test.tsv]' \\\n"
    "      'eval_edge_paths=[data/test]'        # one edge path per input file",
    "python -m pbg_ray.import_edges config.py 'importer.inputs=[edges.csv]' \\\n"
    "      importer.lhs_col=src importer.rel_col=null importer.rhs_col=dst   # by column name",
)


def run(config: ConfigSchema) -> None:
    print(json.dumps(import_graph(config)))


main = hydra_entry(run, __doc__, (
    "importer.inputs", "importer.format", "importer.lhs_col", "importer.rel_col",
    "importer.rhs_col", "importer.header", "importer.entity_min_count", "importer.skip_bad_rows",
    "importer.overwrite", "importer.previous_entity_path", "entity_path", "edge_paths",
    "eval_edge_paths", "entities.<name>.num_partitions", "dynamic_relations"), EXAMPLES)

if __name__ == "__main__":
    main()
