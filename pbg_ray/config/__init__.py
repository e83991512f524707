"""The configuration: every key a run reads, with its type, default, help text and checks.

schema.py       ConfigSchema (PBG's keys), EntitySchema, RelationSchema, RayConfig, and
                the conversion of plain dicts into them with errors that name the key
importer.py     the `importer` section (python -m pbg_ray.import_edges)
export.py       the `export` section (python -m pbg_ray.export)
eval.py         the `eval` section (python -m pbg_ray.eval)
incremental.py  the `incremental` section (training a grown graph from init_path)
tune.py         the `tune` section (python -m pbg_ray.tune)

Imports nothing of pbg_ray but types and errors, and neither torch, ray nor pyarrow.
"""

from pbg_ray.config.schema import (
    ConfigSchema, EntitySchema, RayConfig, RelationSchema, check_value, load_pbg_config_dict,
    load_pbg_config_file, schema_type)

__all__ = [
    "ConfigSchema", "EntitySchema", "RayConfig", "RelationSchema", "check_value",
    "load_pbg_config_dict", "load_pbg_config_file", "schema_type",
]
