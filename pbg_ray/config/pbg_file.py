"""PBG config files: a Python module defining get_torchbiggraph_config(), loaded as
torchbiggraph_train loads it, with the keys that only describe how PBG distributes work
dropped (Ray takes that role); those and the PBG keys accepted but not acted on are
warned about."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any, Dict, Set, Union

from pbg_ray.errors import PbgRayError

logger = logging.getLogger("pbg_ray")

# Keys of torchbiggraph's config that describe how *it* distributes work. Ray
# takes that role here, so they are accepted (a PBG config loads unchanged)
# and dropped, with a warning saying what replaces them.
PBG_ONLY_KEYS = {
    "background_io": "partition I/O overlaps training through Ray's object store",
    "num_machines": "the Ray cluster decides the machines (ray.address)",
    "num_partition_servers": "partitions live in Ray actors (ray.num_partition_stores)",
    "distributed_init_method": "Ray connects the processes (ray.address)",
    "distributed_tree_init_order": "the bucket scheduler actor orders buckets",
}
# PBG keys the schema keeps (config.json carries them) but training does not act on:
# key -> (default, what replaces it); a value other than the default gets the warning.
IGNORED_KEYS = {
    "workers": (None, "each train task runs int(ray.cpus_per_trainer) Hogwild threads, and "
                      "ray.num_trainers tasks run at once"),
    "half_precision": (False, "pbg_ray trains in float32"),
}
_warned: Set[str] = set()  # keys warned about in this process


def drop_pbg_only_keys(data: Dict[str, Any], source: str, warn: bool = True) -> Dict[str, Any]:
    """A copy of a PBG config dict without the keys Ray makes meaningless. With `warn`, each
    such key, and each of IGNORED_KEYS set, is warned about once a process (a checkpoint's
    config.json is read without: its keys describe the run that wrote it, torchbiggraph's
    say, and its readers have nothing to change)."""
    ignored = {k: PBG_ONLY_KEYS[k] for k in PBG_ONLY_KEYS.keys() & data.keys()}
    ignored.update((k, instead) for k, (default, instead) in IGNORED_KEYS.items()
                   if data.get(k, default) != default)
    for key in sorted(ignored.keys() - _warned if warn else ()):
        _warned.add(key)
        logger.warning("%s: PBG key %r is ignored: %s", source, key, ignored[key])
    return {k: v for k, v in data.items() if k not in PBG_ONLY_KEYS}


def load_pbg_config_dict(path: Union[str, Path]) -> Dict[str, Any]:
    """The raw dict of a PBG config module (a .py file defining get_torchbiggraph_config())."""
    path = Path(path)
    if not path.is_file():
        raise PbgRayError(f"PBG config file {str(path)!r} does not exist.")
    spec = importlib.util.spec_from_file_location(f"_pbg_config_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise PbgRayError(f"PBG config file {str(path)!r} failed to import: {err!r}") from err
    getter = getattr(module, "get_torchbiggraph_config", None)
    if getter is None:
        raise PbgRayError(f"PBG config file {str(path)!r} defines no get_torchbiggraph_config(). "
                          "Add one that returns the config dict.")
    data = getter()
    if not isinstance(data, dict):
        raise PbgRayError(f"PBG config file {str(path)!r}: get_torchbiggraph_config() must return "
                          f"a dict, got {type(data).__name__}.")
    return drop_pbg_only_keys(data, str(path))

