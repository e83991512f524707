"""The configuration: every key a run reads, with its type, default, help text and checks.

schema.py       ConfigSchema (PBG's keys and the sections below), EntitySchema, RelationSchema
ray.py          the `ray` section: where and how the work runs
importer.py     the `importer` section (python -m pbg_ray.import_edges)
export.py       the `export` section (python -m pbg_ray.export)
eval.py         the `eval` section (python -m pbg_ray.eval)
model_selection.py  the `validation` section (validation while training, early stopping)
incremental.py  the `incremental` section (training a grown graph from init_path)
tune.py         the `tune` section (python -m pbg_ray.tune)
serve.py        the `serve` section (python -m pbg_ray.serve)
options.py      option(): a field with its help text, check and location flag; the checks
components.py   the names of operators, comparators, losses and regularizers
validation.py   the rules of a whole config: the fields' checks and the rules across fields
convert.py      plain data into the schema's dataclasses, with errors naming the key
pbg_file.py     PBG config files (get_torchbiggraph_config()); the PBG keys Ray makes moot
hydra.py        the schema in Hydra's ConfigStore, command-line overrides checked first
reference.py    the key reference (docs/configuration.md, --help) from the help texts

Imports nothing of pbg_ray but types and errors, and neither torch, ray nor pyarrow.
"""

from pbg_ray.config.eval import EvalConfig
from pbg_ray.config.export import ExportConfig
from pbg_ray.config.importer import ImportConfig
from pbg_ray.config.incremental import IncrementalConfig
from pbg_ray.config.model_selection import ValidationConfig
from pbg_ray.config.pbg_file import load_pbg_config_dict
from pbg_ray.config.ray import RayConfig
from pbg_ray.config.schema import ConfigSchema, EntitySchema, RelationSchema, load_pbg_config_file
from pbg_ray.config.serve import ServeConfig
from pbg_ray.config.tune import TuneConfig

__all__ = [
    "ConfigSchema", "EntitySchema", "EvalConfig", "ExportConfig", "ImportConfig",
    "IncrementalConfig", "RayConfig", "RelationSchema", "ServeConfig", "TuneConfig",
    "ValidationConfig",
    "load_pbg_config_dict", "load_pbg_config_file",
]
