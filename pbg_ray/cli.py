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
from pbg_ray.runtime.connect import kill_local_ray, local_ray
from pbg_ray.runtime.tasks import worker_died

logger = logging.getLogger("pbg_ray")

# conf/graph/demo.yaml's ${demo_graph:} (the demo graph, built on first use) and
# ${demo_checkpoint:} (where the demo trains, whatever the working directory).
OmegaConf.register_new_resolver("demo_graph", demo_graph_path, use_cache=True, replace=True)
OmegaConf.register_new_resolver("demo_checkpoint", demo_checkpoint_path, replace=True)

# Exit status of a command stopped by Ctrl-C (128 + SIGINT) or SIGTERM (128 + SIGTERM), as
# shells report them.
INTERRUPTED = 130
TERMINATED = 143
# How long a command asked to stop may take to unwind its work (a call to a Ray whose GCS a
# signal to the whole process group ended waits a minute) before it ends at once all the
# same: its line said, every process it started killed.
STOP_DEADLINE_S = 5.0


class CommandStop:
    """How a command ends once Ctrl-C (SIGINT) or SIGTERM asks it to, whether the signal
    reaches it alone or its whole process group: the first signal raises KeyboardInterrupt
    in its main thread (later ones are ignored while it unwinds), and the command ends with
    one line (report_errors) within STOP_DEADLINE_S, or is ended then."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None  # the signal that asked, once one did
        self.note: Optional[Callable[[], str]] = None  # what is complete (stop_note)
        self.command = ""  # the command line that resumes, where a note says what is complete
        self._said = threading.Lock()
        self._deadline: Optional[threading.Timer] = None

    def reset(self) -> None:
        """A command's start: no stop asked yet."""
        self.__init__()

    def ask(self, signum: int) -> bool:
        """Note a stop signal; the first arms the deadline. Whether it was the first."""
        if self.signum is not None:
            return False
        self.signum = signum
        self._deadline = threading.Timer(STOP_DEADLINE_S, self.end_now)
        self._deadline.daemon = True
        self._deadline.start()
        if local_ray():
            quiet_native_stderr()
        return True

    def status(self) -> int:
        return TERMINATED if self.signum == signal.SIGTERM else INTERRUPTED

    def say(self) -> None:
        """The command's line, once: `pbg_ray: interrupted` (or terminated), with what is
        complete and how to go on where the command says (stop_note)."""
        if not self._said.acquire(blocking=False):
            return
        word = "terminated" if self.signum == signal.SIGTERM else "interrupted"
        note = self.note() if self.note is not None else ""
        resume = f"; rerun `{self.command}` to resume" if note and self.command else ""
        print(f"pbg_ray: {word}{f'; {note}' if note else ''}{resume}", file=sys.stderr,
              flush=True)

    def end(self) -> None:
        """The end of a stopped command: its line, then, where it started a local Ray,
        end_now; else its exit status."""
        self.say()
        if local_ray():
            self.end_now()
        if self._deadline is not None:
            self._deadline.cancel()
        sys.exit(self.status())

    def end_now(self) -> None:
        """Say the line, end the local Ray (kill_local_ray: what the command started) and
        exit without Ray's exit handler, which would wait for a GCS that a signal to the
        command's group ended. What Ray's core worker in this process logs as its workers
        die (that it could not tell the driver of their tasks' end) is not printed: the
        line is the command's last. The exit status is the stop's whatever fails on the way
        (an error in a Timer's thread would not end the command, and the command's own
        unwinding would then end it with another status)."""
        self.say()
        try:
            logging.shutdown()
            sys.stdout.flush()
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), sys.stderr.fileno())
            kill_local_ray()
        finally:
            os._exit(self.status())

    def handle(self, signum: int, frame: Any) -> None:
        """The command's handler of SIGINT and SIGTERM."""
        if self.ask(signum):
            raise KeyboardInterrupt


STOP = CommandStop()


def quiet_native_stderr() -> None:
    """From a stop of a command with a local Ray on, what Ray writes to this process's
    stderr goes to /dev/null: its core worker's lines as the signal to the command's group
    ends its workers (that it could not tell the driver of their tasks' end), and its
    loggers'. The command's own lines (sys.stderr, pbg_ray's logger) go on to the stderr the
    command had, so its stop line is the only one (end_now ends the command with it)."""
    try:
        fd = sys.stderr.fileno()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError, RuntimeError):
        # Not a file (a caller's capture: nothing of Ray's reaches it), or the signal came
        # in the middle of a write to it (a reentrant flush): left as it is.
        return
    own = os.fdopen(os.dup(fd), "w", buffering=1, encoding=sys.stderr.encoding,
                    errors="backslashreplace")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    sys.stderr = own
    for handler in logger.handlers:
        if isinstance(handler.formatter, CommandFormatter):
            handler.setStream(own)


@contextlib.contextmanager
def stop_note(note: Callable[[], str]) -> Iterator[None]:
    """Within it (and as a stop unwinds it), a stop's line says `note()`: what is complete,
    and how to go on (the command line that resumes)."""
    STOP.note = note
    yield
    STOP.note = None


@contextlib.contextmanager
def command_signals() -> Iterator[None]:
    """Within it, SIGINT and SIGTERM stop the command (CommandStop); the handlers before are
    back after it. Python's own SIGINT handler would raise KeyboardInterrupt at each Ctrl-C
    while the command unwinds; SIGTERM would kill it with no line (or with the native stack
    dump that ray.init installs: connect_ray keeps these handlers across it)."""
    STOP.reset()
    previous = {signum: signal.signal(signum, STOP.handle)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """Within it, Ctrl-C and SIGTERM interrupt nothing: each sets the event it yields, for a
    loop that waits in slices to see it and end in order. (A KeyboardInterrupt raised
    inside Ray's or Serve's own calls can leave one of them half done, and the stop then
    waits on it.) Leaving it after a stop was asked raises KeyboardInterrupt, so that the
    command ends as a stopped one (report_errors: one line, status 130 or 143)."""
    stop = threading.Event()

    def asked(signum: int, frame: Any) -> None:
        STOP.ask(signum)
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
    """Print a PbgRayError as one line and exit with status 2, and a stop (Ctrl-C or SIGTERM,
    CommandStop) as one line with status 130 or 143: no traceback; pbg_ray's log lines in
    the same style meanwhile (command_logging). The outermost one of a command's calls sets
    SIGINT's and SIGTERM's handlers for its length (command_signals)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        outermost = signal.getsignal(signal.SIGTERM) != STOP.handle
        try:
            with command_signals() if outermost else contextlib.nullcontext(), \
                    command_logging():
                return func(*args, **kwargs)
        except KeyboardInterrupt:
            if STOP.signum is None:  # Ctrl-C before the handlers were set, or raised in code
                STOP.ask(signal.SIGINT)
            STOP.end()
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

    # Whether the command line names a config file.
    given = {"config_file": False}

    @hydra.main(version_base=None, config_path="pkg://pbg_ray.conf", config_name="config")
    @report_errors
    def run(cfg: DictConfig) -> Any:
        config = to_config(cfg)
        setup_logging(config)
        if not given["config_file"] and Path(config.entity_path).is_relative_to(demo_graph_dir()):
            print(f"pbg_ray: no config file given: {doc.split()[2]} uses the built-in demo graph "
                  f"({demo_graph_dir()}) and its checkpoint ({config.checkpoint_path})",
                  file=sys.stderr)
        return task(config)

    @report_errors
    def main() -> None:
        argv = sys.argv[1:]
        if any(arg in ("--help", "-h") for arg in argv):
            print(hydra_help(doc, keys, examples), end="")
            return
        STOP.command = shlex.join(doc.split()[:3] + argv)
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
