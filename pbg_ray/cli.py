"""What every `python -m pbg_ray.<entry>` shares: Hydra composition, the PBG
config-file shortcut, and turning bad input into one clear error line."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pbg_ray.config import ConfigSchema, check_value, load_pbg_config_dict
from pbg_ray.errors import PbgRayError
from pbg_ray.importer import demo  # noqa: F401  registers the ${demo_graph:} resolver
from pbg_ray.io.storage import join

logger = logging.getLogger("pbg_ray")

CONFIG_GROUPS = ("graph", "model", "training", "ray", "tune")
# Hydra flags that take the next argument as their value.
_HYDRA_VALUE_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                      "--cfg", "-c", "--package", "-p", "--info", "-i",
                      "--experimental-rerun", "--shell-completion", "-sc"}
PBG_CONFIG_NAME = "pbg_config_file"


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
        if (key.replace("/", ".").split(".")[0] == "hydra" or key in CONFIG_GROUPS or override.is_add()
                or override.is_delete() or override.package is not None):
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
            check_value(key, value)


def _use_pbg_config_file(argv: List[str]) -> List[str]:
    """`python -m pbg_ray.train path/to/pbg_config.py k=v ...`, as with
    torchbiggraph_train: the module's dict becomes the primary config."""
    if not argv or not argv[0].endswith(".py") or "=" in argv[0]:
        return argv
    data = load_pbg_config_dict(Path(argv[0]))
    node = {"defaults": ["pbg_ray_schema", {"ray": "local"}, "_self_"], **data}
    ConfigStore.instance().store(name=PBG_CONFIG_NAME, node=node)
    return [f"--config-name={PBG_CONFIG_NAME}"] + argv[1:]


def to_config(cfg: DictConfig) -> ConfigSchema:
    """The composed Hydra config, resolved and validated, with absolute paths."""
    data = OmegaConf.to_container(cfg, resolve=True)
    return ConfigSchema.from_dict(data, source="config").with_absolute_paths()


def per_job_paths(config: ConfigSchema) -> ConfigSchema:
    """In a Hydra multirun, each job's own checkpoint_path and tensorboard_dir.

    A path inside the job's output directory (the demo graph's default) is already the
    job's own; any other one gets the job's sweep subdirectory appended (`.../0`,
    `.../1`, as under hydra.sweep.dir), so no job resumes or overwrites another's
    checkpoint, and rerunning the sweep resumes each job where it stopped.
    """
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return config
    hydra_config = HydraConfig.get()
    output_dir = os.path.abspath(hydra_config.runtime.output_dir)
    subdir = os.path.relpath(output_dir, os.path.abspath(hydra_config.sweep.dir))

    def own(path: Optional[str]) -> Optional[str]:
        if path is None or path == output_dir or path.startswith(output_dir + os.sep):
            return path
        return join(path, subdir)

    return dataclasses.replace(config, checkpoint_path=own(config.checkpoint_path),
                               tensorboard_dir=own(config.tensorboard_dir))


def report_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Print a PbgRayError as one line and exit with status 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except PbgRayError as err:
            print(f"pbg_ray: error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def hydra_entry(task: Callable[[ConfigSchema], Any]) -> Callable[[], None]:
    """Wrap `task(config)` as a Hydra main over conf/config.yaml."""

    @hydra.main(version_base=None, config_path="pkg://pbg_ray.conf", config_name="config")
    @report_errors
    def run(cfg: DictConfig) -> Any:
        return task(to_config(cfg))

    @report_errors
    def main() -> None:
        argv = _use_pbg_config_file(sys.argv[1:])
        check_overrides(split_overrides(argv))
        sys.argv = sys.argv[:1] + argv
        run()

    return main
