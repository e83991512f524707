"""What every command (`python -m pbg_ray.<command>`) shares: a `--help` in one style (usage,
arguments, the keys set most often, examples, where the full reference is), bad input and
Ctrl-C turned into one line, and for the Hydra commands the Hydra main over conf/config.yaml
with per-job paths in a multirun."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pbg_ray.config import ConfigSchema
from pbg_ray.config.hydra import (
    check_flags, check_overrides, composed_defaults, composition_error, config_dirs,
    is_pbg_config_file, name_sweep_jobs, split_overrides, to_config, use_pbg_config_file)
from pbg_ray.config.reference import REFERENCE, key_help
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.demo import demo_checkpoint_path, demo_graph_dir, demo_graph_path
from pbg_ray.io.storage import sibling
from pbg_ray.runtime.tasks import worker_died

logger = logging.getLogger("pbg_ray")

# conf/graph/demo.yaml's ${demo_graph:} (the demo graph, built on first use) and
# ${demo_checkpoint:} (where the demo trains, whatever the working directory).
OmegaConf.register_new_resolver("demo_graph", demo_graph_path, use_cache=True, replace=True)
OmegaConf.register_new_resolver("demo_checkpoint", demo_checkpoint_path, replace=True)

# Exit status of a command stopped by Ctrl-C (128 + SIGINT), or by SIGTERM where it stops on
# it as on Ctrl-C (stop_on_sigterm, 128 + SIGTERM), as shells report them.
INTERRUPTED = 130
TERMINATED = 143
# Whether SIGTERM came (stop_on_sigterm): the KeyboardInterrupt it raised may reach
# report_errors as a plain one (Ray's waits raise their own on any signal handler's error).
SIGTERM_RECEIVED = threading.Event()


def stop_on_sigterm() -> None:
    """From now on SIGTERM stops this process as Ctrl-C does (a KeyboardInterrupt), ending
    it with one line and status 143. Call it after connecting to Ray: the driver's native
    handler that ray.init installs (a stack dump, then an abort) is replaced."""

    def terminated(signum: int, frame: Any) -> None:
        SIGTERM_RECEIVED.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)


@contextlib.contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """Within it, Ctrl-C and SIGTERM interrupt nothing: each sets the event it yields, for a
    loop that waits in slices to see it and end in order. (A KeyboardInterrupt raised
    inside Ray's or Serve's own calls can leave one of them half done, and the stop then
    waits on it.) Leaving it after a stop was asked raises KeyboardInterrupt, so that the
    command ends as a stopped one (report_errors: one line, status 130 or 143)."""
    stop = threading.Event()

    def asked(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            SIGTERM_RECEIVED.set()
        stop.set()

    previous = {signum: signal.signal(signum, asked) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stop.is_set():
        raise KeyboardInterrupt


class CommandFormatter(logging.Formatter):
    """pbg_ray's log lines in the style of its errors: `pbg_ray: warning: ...`."""

    def format(self, record: logging.LogRecord) -> str:
        return f"pbg_ray: {record.levelname.lower()}: {record.getMessage()}"


@contextlib.contextmanager
def command_logging() -> Iterator[None]:
    """While a command runs, pbg_ray's own log lines go to stderr in its style (not in the
    format of the handler Hydra gives the root logger, nor bare, as Python prints a record
    no handler takes), WARNING and above unless setup_logging says otherwise; after it,
    the logger is as it was (a command called in a process that goes on)."""
    if any(isinstance(h.formatter, CommandFormatter) for h in logger.handlers):
        yield  # a command inside a command (Hydra's main inside its wrapper)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(CommandFormatter())
    before = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]


def setup_logging(config: ConfigSchema) -> None:
    """pbg_ray's log lines at INFO with `verbose`, WARNING otherwise."""
    logger.setLevel(logging.INFO if config.verbose else logging.WARNING)


def per_job_paths(config: ConfigSchema) -> ConfigSchema:
    """In a Hydra multirun, each job's own checkpoint_path and tensorboard_dir: the configured
    ones with the job's swept values appended (`model-lr=0.1`; its number when nothing is
    swept), beside them, never inside another run's; rerunning the sweep resumes each job."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return config
    job = HydraConfig.get().job
    name = job.override_dirname.replace("/", "_") or str(job.num)
    own = lambda path: path and sibling(path, name)  # noqa: E731
    return dataclasses.replace(config, checkpoint_path=own(config.checkpoint_path),
                               tensorboard_dir=own(config.tensorboard_dir))


def user_error(err: BaseException) -> Optional[PbgRayError]:
    """The PbgRayError that `err` is or carries (a Ray task's error wraps its cause), or
    the one that says a task's worker died on every try (runtime.tasks.worker_died)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, PbgRayError):
        return cause
    return err if isinstance(err, PbgRayError) else worker_died(err)


def report_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Print a PbgRayError as one line and exit with status 2, Ctrl-C as one line (what
    the command says about it, if anything) with status 130, and SIGTERM (after
    stop_on_sigterm) as one line with status 143: no traceback; pbg_ray's log lines in
    the same style meanwhile (command_logging)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            with command_logging():
                return func(*args, **kwargs)
        except KeyboardInterrupt as err:
            if SIGTERM_RECEIVED.is_set():
                print("pbg_ray: terminated", file=sys.stderr)
                sys.exit(TERMINATED)
            print(f"pbg_ray: interrupted{f'; {err}' if str(err) else ''}", file=sys.stderr)
            sys.exit(INTERRUPTED)
        except Exception as err:
            error = user_error(err)
            if error is None:
                raise
            print(f"pbg_ray: error: {error}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def command_parser(doc: str, examples: Sequence[str], keys: Sequence[str] = (),
                   reference: str = "") -> argparse.ArgumentParser:
    """The parser, or for a Hydra command the help, of a command whose module docstring is
    `doc` (first paragraph: the usage line; the rest: what it does): `keys` listed with their
    meanings and the defaults a run composes, then `examples`, then where the full reference
    is."""
    usage, _, description = doc.strip().partition("\n\n")
    epilog = []
    if keys:
        epilog.append("keys set most often, with the defaults a run composes (the schema's, "
                      "PBG's for PBG's keys,\nunder conf/'s ray=local and tune=asha; the "
                      "demo's where its graph, model and training differ):\n"
                      + key_help(keys, defaults=composed_defaults()))
    epilog.append("examples:\n" + "\n".join(f"  {example}" for example in examples))
    epilog.append(f"reference: {reference or REFERENCE}")
    return argparse.ArgumentParser(
        prog=" ".join(usage.split()[:3]), usage=usage, description=description,
        epilog="\n\n".join(epilog),
        formatter_class=functools.partial(argparse.RawDescriptionHelpFormatter, width=100))


def hydra_help(doc: str, keys: Sequence[str], examples: Sequence[str]) -> str:
    """`--help` of a Hydra command, in the style of the argparse ones."""
    parser = command_parser(doc, examples, keys)
    parser.add_argument("config", nargs="?", metavar="PBG_CONFIG.py", help=(
        "a PBG config file: a .py defining get_torchbiggraph_config(), as torchbiggraph_train "
        "takes; without it, the built-in demo graph (conf/config.yaml)"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=(
        "set any key, over the file's value: lr=0.05 ray.placement=disk "
        "relations.0.operator=diagonal 'eval_edge_paths=[data/test]'"))
    parser.add_argument("-m", "--multirun", action="store_true", help=(
        "a Hydra sweep: one job per combination of comma-separated values (lr=0.01,0.1)"))
    parser.add_argument("--cfg", metavar="job", help="print the composed config; run nothing")
    parser.add_argument("--hydra-help", action="store_true", help="Hydra's own flags")
    return parser.format_help()


def hydra_entry(task: Callable[[ConfigSchema], Any], doc: str, keys: Sequence[str],
                examples: Sequence[str]) -> Callable[[], None]:
    """Wrap `task(config)` as a Hydra main over conf/config.yaml (or the PBG config file given
    first); `--help` prints `doc`, the arguments, `keys` (single keys, or sections by their
    prefix: "ray.") with their meanings and defaults, and `examples`."""

    # The command line as typed, for the line Ctrl-C prints, and whether it names a file.
    given = {"command": "", "config_file": False}

    @hydra.main(version_base=None, config_path="pkg://pbg_ray.conf", config_name="config")
    @report_errors
    def run(cfg: DictConfig) -> Any:
        config = to_config(cfg)
        setup_logging(config)
        if not given["config_file"] and Path(config.entity_path).is_relative_to(demo_graph_dir()):
            print(f"pbg_ray: no config file given: {doc.split()[2]} uses the built-in demo graph "
                  f"({demo_graph_dir()}) and its checkpoint ({config.checkpoint_path})",
                  file=sys.stderr)
        try:
            return task(config)
        except KeyboardInterrupt as err:
            if str(err):  # the task said what is complete: the same command goes on from there
                raise KeyboardInterrupt(f"{err}; rerun `{given['command']}` to resume") from None
            raise

    @report_errors
    def main() -> None:
        argv = sys.argv[1:]
        if any(arg in ("--help", "-h") for arg in argv):
            print(hydra_help(doc, keys, examples), end="")
            return
        given["command"] = shlex.join(doc.split()[:3] + argv)
        check_flags(argv)
        given["config_file"] = is_pbg_config_file(argv)
        argv = use_pbg_config_file(argv)
        overrides = split_overrides(argv)
        check_overrides(overrides)
        sys.argv = sys.argv[:1] + argv + name_sweep_jobs(argv, overrides)
        # Hydra then raises its own errors instead of printing them: one line each here.
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            run()
        except (HydraException, OmegaConfBaseException, yaml.YAMLError) as err:
            raise composition_error(err, config_dirs(argv)) from None

    return main
