"""What every Hydra command (`python -m pbg_ray.<command>`) shares: the Hydra main over
conf/config.yaml, a `--help` that teaches the command's keys, per-job paths in a multirun,
and bad input turned into one clear error line."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from typing import Any, Callable, Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pbg_ray.config import ConfigSchema
from pbg_ray.config.hydra import check_overrides, split_overrides, to_config, use_pbg_config_file
from pbg_ray.config.reference import markdown
from pbg_ray.errors import PbgRayError
from pbg_ray.importer import demo  # noqa: F401  registers the ${demo_graph:} resolver
from pbg_ray.io.storage import join

logger = logging.getLogger("pbg_ray")

HOW_TO_CONFIGURE = """\
Configuration: with no argument, the built-in demo graph (conf/config.yaml). A PBG config
file (a .py defining get_torchbiggraph_config(), as torchbiggraph_train takes) as the first
argument replaces it. Any key is set with key=value after it (lr=0.05, ray.placement=disk,
relations.0.operator=diagonal); Hydra's multirun sweeps with -m and comma lists
(lr=0.01,0.1). Every key: docs/configuration.md; Hydra's own flags: --hydra-help.
"""


def setup_logging(config: ConfigSchema) -> None:
    """INFO with `verbose`, WARNING otherwise."""
    logging.basicConfig(level=logging.INFO if config.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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


def help_text(doc: str, keys: Sequence[str]) -> str:
    """The command's docstring, how to configure it, and the reference of its keys."""
    return f"{doc.strip()}\n\n{HOW_TO_CONFIGURE}\n{markdown(keys)}"


def hydra_entry(task: Callable[[ConfigSchema], Any], doc: str,
                keys: Sequence[str]) -> Callable[[], None]:
    """Wrap `task(config)` as a Hydra main over conf/config.yaml; `--help` prints `doc` and
    the key reference of `keys`: sections by their prefix ("ray."; "" for all PBG keys, as in
    pbg_ray.config.reference.SECTIONS) and single keys ("entity_path")."""

    @hydra.main(version_base=None, config_path="pkg://pbg_ray.conf", config_name="config")
    @report_errors
    def run(cfg: DictConfig) -> Any:
        return task(to_config(cfg))

    @report_errors
    def main() -> None:
        if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
            print(help_text(doc, keys))
            return
        argv = use_pbg_config_file(sys.argv[1:])
        check_overrides(split_overrides(argv))
        sys.argv = sys.argv[:1] + argv
        run()

    return main
