"""Connecting the driver to Ray, and getting task results with the project's errors."""

from __future__ import annotations

import logging
import os

from typing import Any

import ray
from ray.exceptions import RayTaskError

from pbg_ray.config import RayConfig
from pbg_ray.errors import PbgRayError

# Ray's notice, each time ray.init() starts a local Ray, that it turned token authentication
# on: nothing the user of a local run can act on. Only the notice is dropped: authentication
# stays as Ray sets it, and joining a cluster (ray.address) is left as it is.
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


def not_token_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(TOKEN_NOTICE)


def connect_ray(ray_config: RayConfig) -> None:
    """Join ray.address (RAY_ADDRESS, as `ray job submit` sets it, when that is null), or
    start a local Ray, never joining one that `ray start` left on this machine; keep one
    already connected."""
    if ray.is_initialized():
        return
    address = ray_config.address or (None if os.environ.get("RAY_ADDRESS") else "local")
    token_logger = logging.getLogger(TOKEN_LOGGER)
    token_logger.addFilter(not_token_notice)
    try:
        ray.init(address=address, num_cpus=ray_config.num_cpus,
                 object_store_memory=ray_config.object_store_memory,
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    finally:
        token_logger.removeFilter(not_token_notice)


def get_results(refs: Any) -> Any:
    """ray.get, re-raising a task's PbgRayError as itself (one clear line for the user)."""
    try:
        return ray.get(refs)
    except RayTaskError as err:
        if isinstance(err.cause, PbgRayError):
            raise err.cause from None
        raise
