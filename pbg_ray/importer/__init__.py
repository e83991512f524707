"""Raw edge files (TSV, CSV, Parquet) into PBG's v1 layout (python -m pbg_ray.import_edges).

graph_import.py  entity dictionaries, partitioning, bucket routing, staging and commit
name_index.py    the hash table that turns entity and relation names into ids
demo.py          the built-in demo graph, generated with planted structure
"""

from pbg_ray.importer.graph_import import import_graph

__all__ = ["import_graph"]
