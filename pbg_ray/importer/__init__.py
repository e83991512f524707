"""Raw edge files (TSV, CSV, Parquet) into PBG's v1 layout (python -m pbg_ray.import_edges).

graph_import.py  import_graph: the recipe that runs the phases below, input by input
read.py          phase 1: raw tables (io/raw.py) -> names as ids -> spill files of id records
dictionaries.py  phase 2: ids -> partition and offset (min counts, seeded shuffle, growth)
routing.py       phase 3: spill files -> edge buckets (stable radix sort)
staging.py       phase 4: staging directories, moved into place; the import's manifest
name_index.py    the hash table that turns entity and relation names into ids
demo.py          the built-in demo graph, generated with planted structure

ray_engine.py    the importer on Ray tasks and actors, and the choice of engine
plan.py          the memory plan of an import, for both engines

import_graph loads on first use: the commands import demo.py (where the demo is), and
the readers' pandas and pyarrow stay out of the drivers that import no edges.
"""

import importlib
from typing import Any

__all__ = ["import_graph"]


def __getattr__(name: str) -> Any:
    if name != "import_graph":
        raise AttributeError(f"module 'pbg_ray.importer' has no attribute {name!r}")
    return importlib.import_module("pbg_ray.importer.graph_import").import_graph
