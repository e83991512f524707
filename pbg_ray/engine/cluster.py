"""Connecting the driver to Ray."""

from __future__ import annotations

import logging

import ray

from pbg_ray.config import RayConfig


def connect_ray(ray_config: RayConfig) -> None:
    """Join ray.address, or start a local Ray; keep one already connected."""
    if ray.is_initialized():
        return
    ray.init(address=ray_config.address, num_cpus=ray_config.num_cpus,
             object_store_memory=ray_config.object_store_memory,
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
