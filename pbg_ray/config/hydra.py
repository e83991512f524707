"""The config's side of Hydra: the schema in Hydra's ConfigStore (conf/config.yaml builds
on it, so every key has its documented default and Hydra knows the types), command-line
overrides checked against the schema before Hydra runs, a PBG config file as the primary
config, and the composed config turned into a validated ConfigSchema."""

from __future__ import annotations

from pathlib import Path
from typing import List

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf

from pbg_ray.config.convert import check_value
from pbg_ray.config.pbg_file import load_pbg_config_dict
from pbg_ray.config.schema import ConfigSchema
from pbg_ray.errors import PbgRayError

SCHEMA_NAME = "pbg_ray_schema"
CONFIG_GROUPS = ("graph", "model", "training", "ray", "tune")
# Hydra flags that take the next argument as their value.
_HYDRA_VALUE_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                      "--cfg", "-c", "--package", "-p", "--info", "-i",
                      "--experimental-rerun", "--shell-completion", "-sc"}
PBG_CONFIG_NAME = "pbg_config_file"


def register_configs() -> None:
    """The schema in Hydra's ConfigStore, as conf/config.yaml's defaults name it."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=ConfigSchema)


def split_overrides(argv: List[str]) -> List[str]:
    """The `key=value` overrides among Hydra's command-line arguments."""
    overrides, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _HYDRA_VALUE_FLAGS
        else:
            overrides.append(arg)
    return overrides


def check_overrides(overrides: List[str]) -> None:
    """Refuse unknown keys and ill-typed values before Hydra runs, with the
    project's error (Hydra's own would name neither the nearest key nor the fix)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        hint = (" Quote values that hold '=' or '&', such as storage URIs: "
                "\"checkpoint_path='s3://bucket/dir?endpoint_override=host:9000&scheme=http'\"."
                if any("://" in o for o in overrides) else "")
        raise PbgRayError(f"command line: {err}{hint}") from None
    for override in parsed:
        key = override.key_or_group
        # hydra.* settings and hydra/* group choices (hydra/launcher=ray) are Hydra's.
        if (key.replace("/", ".").split(".")[0] == "hydra" or key in CONFIG_GROUPS
                or override.is_add() or override.is_delete() or override.package is not None):
            continue  # group choices and additions are checked by Hydra / from_dict
        if key.startswith("tune.search_space.") and isinstance(override.value(), dict):
            # Hydra merges a mapping into the one there: {loguniform} + {uniform} is no spec.
            raise PbgRayError(
                f"command line: {key}: a sampling spec is replaced, not overridden: write "
                f"'~{key}' '+{key}=...' (or put the search space in conf/tune/<name>.yaml "
                "and pick it with tune=<name>).")
        values = (list(override.sweep_iterator()) if override.is_sweep_override()
                  else [override.value()])
        for value in values:
            check_value(ConfigSchema, key, value)


def use_pbg_config_file(argv: List[str]) -> List[str]:
    """`python -m pbg_ray.train path/to/pbg_config.py k=v ...`, as with
    torchbiggraph_train: the module's dict becomes the primary config."""
    if not argv or not argv[0].endswith(".py") or "=" in argv[0]:
        return argv
    data = load_pbg_config_dict(Path(argv[0]))
    node = {"defaults": [SCHEMA_NAME, {"ray": "local"}, "_self_"], **data}
    ConfigStore.instance().store(name=PBG_CONFIG_NAME, node=node)
    return [f"--config-name={PBG_CONFIG_NAME}"] + argv[1:]


def to_config(cfg: DictConfig) -> ConfigSchema:
    """The composed Hydra config, resolved and validated, with absolute paths."""
    data = OmegaConf.to_container(cfg, resolve=True)
    return ConfigSchema.from_dict(data, source="config").with_absolute_paths()


register_configs()
