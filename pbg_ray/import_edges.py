"""python -m pbg_ray.import_edges [PBG_CONFIG.py] importer.inputs=[train.tsv,test.tsv] [key=value ...]

Turns raw edge files (TSV, CSV, Parquet; plain or gzip) into the config's
entity_path and edge paths (edge_paths, then eval_edge_paths: one input file
each) in PBG's v1 layout. Settings live under `importer.` (see
pbg_ray/config/importer.py: ImportConfig). Prints one JSON line of statistics.
"""

from __future__ import annotations

import json

from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.engine.importer import import_graph


def run(config: ConfigSchema) -> None:
    print(json.dumps(import_graph(config)))  # Hydra has set up logging: warnings reach stderr


main = hydra_entry(run, __doc__, (
    "importer.", "entity_path", "edge_paths", "eval_edge_paths", "entities", "relations",
    "dynamic_relations", "entities.<name>.", "relations.<index>."))

if __name__ == "__main__":
    main()
