"""Starting and stopping the service: Serve's environment and ports, the served version's
indexes built, the deployments run, the versions taken up reported, and a stop that leaves
nothing of the service running."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
from typing import Any, Dict, Iterator, Optional, Sequence

import ray
from ray import serve
from ray.serve._private.constants import (
    SERVE_CONTROLLER_NAME, SERVE_LOGGER_NAME, SERVE_NAMESPACE)
from ray.serve.handle import DeploymentResponse

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema, ServeConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.entity_names import names_bytes
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.runtime.budget import (
    ACTOR, DRIVER, GIB, RAY_PROCESSES, TASK_WORKER, MemoryBudget, MemoryPlan, memory_budget)
from pbg_ray.runtime.connect import check_plan_fits, connect_ray, starts_local_ray
from pbg_ray.serving.http_api import UNAVAILABLE, Router, Shard
from pbg_ray.serving.index import build_indexes, replica_bytes


logger = logging.getLogger("pbg_ray")
APPLICATION = "pbg_ray"
# How often the watch of the versions taken up looks whether a stop was asked.
STOP_CHECK_S = 0.5


# Ray Serve's throughput-optimized mode switch by switch (what RAY_SERVE_THROUGHPUT_OPTIMIZED=1
# sets; that switch also has the controller print a banner of them on the terminal): calls
# between deployments over gRPC instead of Ray actor calls, user code and the handles'
# routing on the replica's event loop, Serve's own logs buffered and in its log files only,
# the garbage collector frozen after start-up.
THROUGHPUT_OPTIMIZED = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                        "RAY_SERVE_LOG_TO_STDERR": "0",
                        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
                        "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1"}


def serve_env(serve_config: ServeConfig) -> Dict[str, str]:
    """Environment of Serve's controller and of the replicas: THROUGHPUT_OPTIMIZED.

    serve.ingress=direct: the router replicas answer HTTP themselves (Serve's direct
    ingress), on the node of the command that started the service, on serve.port and the
    ports after it, one per router replica, not behind Serve's proxy; a replica Serve
    replaces takes its port again at once (no quarantine, which exists for load balancers
    in front of the replicas, and no drain period before a stopped replica closes).
    serve.ingress=proxy: Serve's HTTP proxy listens on serve.port and forwards each request
    to a router replica."""
    if serve_config.ingress == "proxy":
        return {**THROUGHPUT_OPTIMIZED, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    return {**THROUGHPUT_OPTIMIZED, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(serve_config.port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(serve_config.port
                                                          + serve_config.router_replicas),
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def proxy_port(serve_config: ServeConfig) -> int:
    """The port of Serve's HTTP proxy: serve.port behind serve.ingress=proxy; with direct
    ingress, where Serve still starts its proxy, a free one that nobody is told of (Serve's
    line "Application ... is ready at" that port is kept off the terminal: start_service)."""
    if serve_config.ingress == "proxy":
        return serve_config.port
    with socket.socket() as probe:
        probe.bind((serve_config.host, 0))
        return probe.getsockname()[1]


class DriverRouterNotices(logging.Filter):
    """Leaves out the notices of Serve's request router in the command's own process. That
    router carries only the command's watch of the versions taken up (version_changes);
    requests are routed in the proxy and the router replicas, whose notices stay in Ray's
    logs. Its notices, that a router replica answered its queue-length probe late (a busy
    machine) or not at all (a replica ending), concern that internal call alone, which
    waits and asks again, and would reach the terminal of a command that promises one line
    on stopping."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.module != "request_router"


DRIVER_ROUTER_NOTICES = DriverRouterNotices()


def start_service(config: ConfigSchema) -> Dict[str, Any]:
    """Connect to Ray, build the served version's indexes and start the application on
    serve.host:serve.port, with the model that version was trained with
    (CheckpointManager.with_trained_model). Returns the URL, the version and the index
    build's figures.
    Serve's INFO lines in this process (started, deploying, ready at its proxy's port,
    deleting) are left out: the caller says what is served where, and so are the notices of
    this process's request router (DriverRouterNotices)."""
    config = config.checked().with_absolute_paths()
    located, version = CheckpointManager(config.checkpoint_path).locate(
        config, config.serve.version, "serve.version", best=config.serve.follow == "best")
    config = located.with_trained_model(config, version)
    serve_logger = logging.getLogger(SERVE_LOGGER_NAME)
    serve_logger.setLevel(logging.WARNING)
    serve_logger.addFilter(DRIVER_ROUTER_NOTICES)
    config = index_for_budget(
        config, memory_budget(config.ray) if starts_local_ray(config.ray) else None)
    check_serving_fits(config)
    connect_ray(config.ray)
    serve_config = config.serve
    if serve_config.ingress == "direct" and serve_running():
        raise PbgRayError(
            "Ray Serve already runs on this Ray cluster, and serve.ingress=direct needs a Serve "
            "started by pbg_ray (its controller assigns the router's port serve.port when it "
            "starts). Stop the other Serve (`serve shutdown -y`) or set serve.ingress=proxy.")
    built = asyncio.run(build_indexes(config, version))
    env = {"env_vars": serve_env(serve_config)}
    serve.start(http_options={"host": serve_config.host, "port": proxy_port(serve_config)},
                controller_options={"runtime_env": env})
    plain = config.to_dict()
    shards = [Shard.options(name=f"Shard{g}", num_replicas=serve_config.shard_replicas,
                            ray_actor_options={"num_cpus": serve_config.shard_cpus,
                                               "runtime_env": env})
              .bind(plain, g, version) for g in range(serve_config.shard_groups)]
    router_options = {"num_cpus": 0, "runtime_env": env}
    if serve_config.ingress == "direct":  # on this node, whose address serve.port is at
        router_options["resources"] = {f"node:{ray.util.get_node_ip_address()}": 0.001}
    router = Router.options(num_replicas=serve_config.router_replicas,
                            ray_actor_options=router_options).bind(plain, version, shards)
    serve.run(router, name=APPLICATION, route_prefix="/")
    return {"url": f"http://{serve_config.host}:{serve_config.port}", "version": version,
            "index": built}


def serving_plan(config: ConfigSchema, counts: Dict[str, Sequence[int]]) -> MemoryPlan:
    """What the service holds on a local Ray: every shard replica's tables, candidate
    vectors and indexes, every router replica's names of all entities, and the processes
    (Serve's controller, the router replicas and the shard replicas each a process with
    torch loaded)."""
    serve_config = config.serve
    held = (serve_config.shard_replicas * sum(
        replica_bytes(config, counts, g) for g in range(serve_config.shard_groups))
        + serve_config.router_replicas * names_bytes(config, counts))
    replicas = serve_config.router_replicas + serve_config.shard_groups * serve_config.shard_replicas
    return MemoryPlan("this service", None, held, 0, 0,
                      RAY_PROCESSES + DRIVER + ACTOR + replicas * TASK_WORKER)


def index_for_budget(config: ConfigSchema, budget: Optional[MemoryBudget]) -> ConfigSchema:
    """The config to serve: serve.index=auto becomes ivfpq (the vectors left in the
    checkpoint's files) where the auto choice's plan does not fit `budget` (the local Ray's;
    None on a cluster), with a warning saying so; any other config as it is."""
    if config.serve.index != "auto" or budget is None:
        return config
    plan = serving_plan(config, load_entity_counts(config))
    if plan.total <= budget.bytes:
        return config
    logger.warning("serve.index=auto: the vectors and their indexes need about %.2f GiB, and "
                   "the service may use %s; serving with serve.index=ivfpq (compressed codes "
                   "in memory, the vectors read from the checkpoint for the hits).",
                   plan.total / GIB, budget)
    return dataclasses.replace(config, serve=dataclasses.replace(config.serve, index="ivfpq"))


def check_serving_fits(config: ConfigSchema) -> None:
    """Refuse a service on the local Ray whose plan exceeds the memory budget."""
    serve_config = config.serve
    counts = load_entity_counts(config)

    def fix(budget: MemoryBudget) -> str:
        ways = []
        compressed = dataclasses.replace(config, serve=dataclasses.replace(
            serve_config, index="ivfpq"))
        if serve_config.index != "ivfpq" and \
                serving_plan(compressed, counts).total <= budget.bytes:
            ways.append("serve.index=ivfpq (compressed codes in memory, the vectors read from "
                        "the checkpoint for the hits)")
        if serve_config.shard_replicas > 1:
            ways.append("serve.shard_replicas=1 (one copy of each shard group)")
        return "; or ".join(ways + [
            "serve from a Ray cluster whose nodes each hold a shard group (ray.address, "
            "serve.shard_groups=<nodes>); or give it more memory (ray.memory_budget states "
            "it in bytes where the detected limit is wrong)"])

    check_plan_fits(config.ray, serving_plan(config, counts), fix)


def serve_running() -> bool:
    """Whether a Ray Serve controller runs on the connected Ray cluster."""
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def version_changes(version: int, stop: threading.Event) -> Iterator[Dict[str, Any]]:
    """Each change of what the service serves, as the router takes up (or fails to take up)
    a version newer than `version` (Router.newer_version), until `stop` is set; {"version":
    the one served, "failure": {"version", "error"} of the newest failure or None}."""
    router = serve.get_app_handle(APPLICATION)
    failure = None
    while not stop.is_set():
        news = awaited(router.newer_version.remote(version, failure), stop)
        if news is not None:
            yield news
            version, failure = news["version"], news["failure"]


def awaited(response: DeploymentResponse, stop: threading.Event) -> Optional[Dict[str, Any]]:
    """The response's result, waited for STOP_CHECK_S at a time until it comes; None when the
    router replica asked died (Serve starts another), or once `stop` is set: then the call is
    cancelled, so that none is left waiting to hold up the router replica's stop."""
    while not stop.is_set():
        try:
            return response.result(timeout_s=STOP_CHECK_S)
        except TimeoutError:
            continue
        except UNAVAILABLE:
            return None
    response.cancel()
    return None


def stop_service() -> None:
    """Delete the application (its replicas finish the requests they hold), then end Serve:
    its controller stops the proxies and ends itself. (serve.shutdown() asks it that with
    Ray's retries, and Ray prints that the call "failed" and "will be retried" as the
    controller ends; asked here without retries, serve.shutdown() then only drops Serve's
    handle of it.) Serve's notices of replicas ending (in this process's handles) are what
    was asked for: left out. (On the local Ray that `serve` starts, a stop ends the whole
    Ray at once instead: cli.CommandStop.)"""
    logging.getLogger(SERVE_LOGGER_NAME).setLevel(logging.ERROR)
    serve.delete(APPLICATION)
    if serve_running():
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        try:
            ray.get(controller.graceful_shutdown.options(max_task_retries=0).remote())
        except ray.exceptions.RayActorError:
            pass  # it ended, as asked
    serve.shutdown()
