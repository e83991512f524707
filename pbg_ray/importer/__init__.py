"""Raw edge files (TSV, CSV, Parquet) into PBG's v1 layout (python -m pbg_ray.import_edges).

graph_import.py  import_graph: the recipe that runs the phases below, input by input
read.py          phase 1: raw tables (io/raw.py) -> names as ids -> spill files of id records
dictionaries.py  phase 2: ids -> partition and offset (min counts, seeded shuffle, growth)
routing.py       phase 3: spill files -> edge buckets (stable radix sort)
staging.py       phase 4: staging directories, moved into place; the import's manifest
name_index.py    the hash table that turns entity and relation names into ids
demo.py          the built-in demo graph, generated with planted structure
"""

from pbg_ray.importer.graph_import import import_graph

__all__ = ["import_graph"]
