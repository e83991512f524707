"""PBG config files: a Python module defining get_torchbiggraph_config(), loaded as
torchbiggraph_train loads it, with the keys that only describe how PBG distributes work
dropped (Ray takes that role)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Dict, Union

from pbg_ray.config.schema import ConfigSchema, drop_pbg_only_keys
from pbg_ray.errors import PbgRayError


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


def load_pbg_config_file(path: Union[str, Path]) -> ConfigSchema:
    """Load and validate a PBG config module, as torchbiggraph_train would."""
    return ConfigSchema.from_dict(load_pbg_config_dict(path), source=str(path))
