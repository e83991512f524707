"""The config's side of Hydra: the schema in Hydra's ConfigStore (conf/config.yaml builds
on it, so every key has its documented default and Hydra knows the types), command-line
overrides checked against the schema before Hydra runs, a PBG config file as the primary
config, and the composed config turned into a validated ConfigSchema."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Dict, List

import yaml
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from pbg_ray.config.convert import check_part, check_value
from pbg_ray.config.pbg_file import load_pbg_config_dict
from pbg_ray.config.reference import SECTIONS, rows
from pbg_ray.config.schema import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean

SCHEMA_NAME = "pbg_ray_schema"
# Hydra's settings for every command: a run writes no output directory, .hydra/ or log file
# into the working directory (hydra.run.dir=DIR hydra.output_subdir=.hydra ask for them);
# a multirun keeps Hydra's sweep directory (multirun.yaml), without a folder per job.
HYDRA_SETTINGS_NAME = "pbg_ray_hydra"
HYDRA_SETTINGS = {"hydra": {"run": {"dir": "."}, "sweep": {"subdir": "."}, "output_subdir": None,
                            "job": {"chdir": False}}}
# The defaults of a PBG config file, as conf/config.yaml's without the graph, model and
# training groups (the file holds those keys): no log file, and the logging of `verbose`.
PBG_FILE_DEFAULTS = [SCHEMA_NAME, HYDRA_SETTINGS_NAME, {"ray": "local"}, {"tune": "asha"},
                     "_self_", {"override hydra/job_logging": "none"}]
CONFIG_GROUPS = ("graph", "model", "training", "ray", "tune")
# Hydra flags that take the next argument as their value.
_HYDRA_VALUE_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                      "--cfg", "-c", "--package", "-p", "--info", "-i",
                      "--experimental-rerun", "--shell-completion", "-sc"}
# Hydra flags that stand alone.
_HYDRA_FLAGS = {"-h", "--help", "--hydra-help", "--version", "--resolve", "-m", "--multirun",
                "-r", "--run"}
PBG_CONFIG_NAME = "pbg_config_file"
# What every run composes before its file and command line: PBG_FILE_DEFAULTS alone.
EVERY_RUN_NAME = "pbg_ray_every_run"


def register_configs() -> None:
    """The schema and Hydra's settings in Hydra's ConfigStore, as conf/config.yaml's
    defaults name them."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=ConfigSchema)
    ConfigStore.instance().store(name=HYDRA_SETTINGS_NAME, node=HYDRA_SETTINGS)
    ConfigStore.instance().store(name=EVERY_RUN_NAME, node={"defaults": PBG_FILE_DEFAULTS})


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


def check_flags(argv: List[str]) -> None:
    """Refuse an option Hydra does not know, such as `--lr 0.05`, naming the key=value
    form that sets it (Hydra would report a lexer error on the value)."""
    for index, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        if not arg.startswith("-") or flag in _HYDRA_FLAGS | _HYDRA_VALUE_FLAGS:
            continue
        if index > 0 and argv[index - 1] in _HYDRA_VALUE_FLAGS:
            continue  # a flag's value
        key = flag.lstrip("-").replace("-", "_")
        value = arg.split("=", 1)[1] if "=" in arg else (
            argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("-")
            and "=" not in argv[index + 1] else "<value>")
        raise PbgRayError(f"command line: {arg}: keys are set as key=value, not as options: "
                          f"write {key}={value} (--help lists the options).")


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


def is_pbg_config_file(argv: List[str]) -> bool:
    """Whether the command line starts with a PBG config file (a .py)."""
    return bool(argv) and argv[0].endswith(".py") and "=" not in argv[0]


def use_pbg_config_file(argv: List[str]) -> List[str]:
    """`python -m pbg_ray.train path/to/pbg_config.py k=v ...`, as with
    torchbiggraph_train: the module's dict becomes the primary config."""
    if not is_pbg_config_file(argv):
        return argv
    data = load_pbg_config_dict(Path(argv[0]))
    check_part(data, ConfigSchema, "", argv[0])
    node = {"defaults": PBG_FILE_DEFAULTS, **data}
    ConfigStore.instance().store(name=PBG_CONFIG_NAME, node=node)
    return [f"--config-name={PBG_CONFIG_NAME}"] + argv[1:]


def name_sweep_jobs(argv: List[str], overrides: List[str]) -> List[str]:
    """In a multirun, the Hydra setting that names each job after its swept values alone
    (hydra.job.override_dirname `dimension=50,lr=0.1`, not the keys every job shares)."""
    if not {"-m", "--multirun"} & set(argv):
        return []
    fixed = [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)
             if not o.is_sweep_override()]
    return ["hydra.job.config.override_dirname.exclude_keys=["
            + ",".join(f"'{key}'" for key in fixed) + "]"] if fixed else []


def config_dirs(argv: List[str]) -> List[Path]:
    """Where Hydra looks for YAML configs: the --config-dir of `argv`, then conf/."""
    dirs = [Path(value) for flag, value in zip(argv, argv[1:]) if flag in ("--config-dir", "-cd")]
    dirs += [Path(arg.split("=", 1)[1]) for arg in argv if arg.startswith("--config-dir=")]
    return dirs + [Path(importlib.util.find_spec("pbg_ray.conf").origin).parent]


def composition_error(err: Exception, dirs: List[Path]) -> PbgRayError:
    """Hydra's (or YAML's) error while composing the config, as the project's one line: for a
    mistyped key or bad value in a YAML file, the same line as on the command line, naming
    the file."""
    if isinstance(err, MissingConfigException) and err.options:
        group, _, name = (err.missing_cfg_file or "").rpartition("/")
        return PbgRayError(f"command line: {group}={name}: no such option"
                           f"{did_you_mean(name, err.options)}. Options of {group!r}: "
                           f"{', '.join(err.options)} (a YAML file of your own: put it in "
                           f"DIR/{group}/ and add --config-dir DIR).")
    text = str(err)
    match = re.match(r"In '([^']+)'", text)
    files = [d / f"{match.group(1)}.yaml" for d in dirs] if match else []
    for path in (f for f in files if f.is_file()):
        header = path.read_text().partition("\n")[0]
        data = {key: value for key, value in (yaml.safe_load(path.read_text()) or {}).items()
                if key not in ("defaults", "hydra")}  # Hydra's own keys
        package = match.group(1).rpartition("/")[0]
        if "@package _global_" not in header and package:
            data = functools.reduce(lambda inner, name: {name: inner},
                                    reversed(package.split("/")), data)
        check_part(data, ConfigSchema, "", str(path))
        text = f"{path}: {text.partition(':')[2]}"
    return PbgRayError(" ".join(text.replace("\t", " ").split()))


def composed_defaults() -> Dict[str, str]:
    """What --help says of a key's default where conf/ sets one: the value every run
    composes (conf/'s ray and tune options over the schema: "Default: 8 (tune=asha)."),
    and the demo's (conf/config.yaml) where it differs ("Default: 1 (the demo: 10).");
    keys conf/ leaves at the schema's default are not listed."""
    with initialize_config_module("pbg_ray.conf", version_base=None):
        every, demo = (OmegaConf.to_container(compose(name), resolve=False)
                       for name in (EVERY_RUN_NAME, "config"))
    options = {next(iter(d)): d[next(iter(d))] for d in PBG_FILE_DEFAULTS
               if isinstance(d, dict) and next(iter(d)) in CONFIG_GROUPS}
    texts = {}
    for _, prefix, cls in SECTIONS:
        for key, _, schema_default, _ in rows(cls, prefix):
            if "<" in key:  # entities.<name>.*, relations.<index>.*
                continue
            ours, theirs = (functools.reduce(lambda d, k: d[k], key.split("."), c)
                            for c in (every, demo))
            text = "required" if ours == "???" else json.dumps(ours)
            notes = []
            if text != schema_default.strip("`"):  # set by a group of PBG_FILE_DEFAULTS
                group = key.split(".")[0]
                notes.append(f"{group}={options[group]}")
            if theirs != ours:
                notes.append("the demo sets it" if "${" in str(theirs)
                             else f"the demo: {json.dumps(theirs)}")
            if notes:
                head = "Required" if text == "required" else f"Default: {text}"
                texts[key] = f"{head} ({'; '.join(notes)})."
    return texts


def to_config(cfg: DictConfig) -> ConfigSchema:
    """The composed Hydra config, resolved and validated, with absolute paths."""
    data = OmegaConf.to_container(cfg, resolve=True)
    return ConfigSchema.from_dict(data, source="config").with_absolute_paths()


register_configs()
