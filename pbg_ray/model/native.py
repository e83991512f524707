"""The kernel's optional C extensions (_rows.c, _loss.c): each is used where it is built,
unless the environment variable PBG_RAY_C_KERNELS is 0, which makes the kernel use its
torch code everywhere (the same results, slower): to tell whether a crash or a wrong
result comes from the C code. Set it where the train tasks' workers start (before a local
Ray starts, or in the cluster's environment)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

C_KERNELS_ENV = "PBG_RAY_C_KERNELS"


def extension(name: str) -> Optional[ModuleType]:
    """The C extension pbg_ray.model.<name>, or None: turned off, or not built."""
    if os.environ.get(C_KERNELS_ENV, "1") == "0":
        return None
    try:
        return importlib.import_module(f"pbg_ray.model.{name}")
    except ImportError:  # the optional extension was not built
        return None
