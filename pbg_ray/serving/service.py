"""The HTTP service on Ray Serve: a FastAPI ingress (the router: names, queries, merging)
over one deployment per shard group (partitions p with p mod serve.shard_groups equal),
each replica holding its partitions' candidate sets and faiss indexes. The math is
pbg_ray.serving.shards's; indexes are built by Ray tasks and saved beside the version.

A new checkpoint version (serve.version null) is taken up without dropping requests: the
router's watcher builds the version's indexes, has the shards load it beside the one they
serve, then switches; a request names the version it started with, and shards keep the two
newest, loading a version on its first request if a replica missed the load. The command
learns of each switch by a call that waits for it (Router.newer_version).

A batch is answered per query (pbg_ray.serving.shards): a query naming an unknown
entity or relation gets {"error": ...} in its answer's place, and "errors" counts them; a
request wrong as a whole (not JSON, a missing field, k out of range, too many queries, an
unknown exclude path) gets a 4xx with {"error": ...}.
"""

# No `from __future__ import annotations`: FastAPI reads the request models from the route
# methods' annotations, which Serve's ingress moves out of this module's namespace.
import asyncio
import logging
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Union

import numpy as np
import ray
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve._private.constants import (
    SERVE_CONTROLLER_NAME, SERVE_LOGGER_NAME, SERVE_NAMESPACE)
from ray.serve.exceptions import (
    BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.config.serve import ServeConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.runtime.faults import fault_point, faults_dir
from pbg_ray.serving.shards import (
    Answer, ServingModel, ShardTables, build_set_index, drop_old_indexes, index_keys)

logger = logging.getLogger(__name__)
APPLICATION = "pbg_ray"
KEEP_VERSIONS = 2  # versions a shard holds: the one served and the one coming (or going)
# What a call to a shard group raises when no replica of it can answer (one died, or all are
# overloaded): the request gets a 503, and a retry succeeds once Serve has replaced it.
UNAVAILABLE = (ray.exceptions.RayActorError, ReplicaUnavailableError,
               DeploymentUnavailableError, BackPressureError)


@ray.remote
def build_index_task(config: Dict[str, Any], version: int, key: List[Any]) -> Dict[str, Any]:
    """Build (or find saved) one candidate set's index of `version`, on as many threads as
    the task has CPUs (builds run side by side)."""
    import faiss

    config = ConfigSchema.from_dict(config)
    faiss.omp_set_num_threads(max(1, int(config.serve.index_cpus)))
    return build_set_index(config, version, tuple(key))


async def build_indexes(config: ConfigSchema, version: int) -> Dict[str, Any]:
    """Every set's index of `version`, built by parallel Ray tasks (saved ones reused);
    older versions' saved indexes are removed. Returns the build's figures."""
    start = time.perf_counter()
    task = build_index_task.options(num_cpus=config.serve.index_cpus)
    plain = config.to_dict()
    figures = await asyncio.gather(*(task.remote(plain, version, list(key))
                                     for key in index_keys(config)))
    drop_old_indexes(config, [version - 1, version])
    return {"version": version, "seconds": time.perf_counter() - start,
            "built": [f for f in figures if f["seconds"] > 0],
            "kinds": sorted({f["kind"] for f in figures})}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Edge(Strict):
    lhs: str
    relation: str
    rhs: str


class ScoreRequest(Strict):
    edges: List[Edge] = Field(description="(lhs, relation, rhs) triples by names")


class TopRhsQuery(Strict):
    lhs: str
    relation: str


class TopLhsQuery(Strict):
    relation: str
    rhs: str


class TopOptions(Strict):
    k: int = Field(10, description="results per query (1 to serve.max_k)")
    exclude: List[str] = Field([], description="edge paths of the config (by path or last "
                               "name) whose known edges are left out")
    exact: bool = Field(False, description="score every candidate instead of the index")


class TopRhsRequest(TopOptions):
    queries: List[TopRhsQuery]


class TopLhsRequest(TopOptions):
    queries: List[TopLhsQuery]


class NeighborQuery(Strict):
    entity: Optional[str] = Field(None, description="an entity's name (itself left out)")
    vector: Optional[List[float]] = Field(None, description="or an entity vector")
    entity_type: Optional[str] = Field(None, description="needed with vector, or when the "
                                       "name is in several types")


class NeighborsRequest(Strict):
    queries: List[NeighborQuery]
    k: int = 10
    exact: bool = False


# The responses, for the OpenAPI page only (routes return plain dicts, never validated).
class Hit(BaseModel):
    name: str
    score: float


class QueryError(BaseModel):
    error: str = Field(description="why this query has no answer: an unknown entity or "
                       "relation (with the nearest known name), an entity on the wrong side "
                       "of the relation, a vector of the wrong length")


class Answered(BaseModel):
    version: int = Field(description="the checkpoint version that answered")
    errors: int = Field(description="how many queries have an error instead of an answer")


class ScoreResponse(Answered):
    scores: List[Union[float, QueryError]] = Field(
        description="per edge, in the request's order: its score, or its error")


class RankedResponse(Answered):
    results: List[Union[List[Hit], QueryError]] = Field(
        description="per query, in the request's order: the k best, best first, or its error")


class RequestError(BaseModel):
    error: str = Field(description="what is wrong with the request as a whole, and the fix")


ANSWERED = {400: {"model": RequestError, "description": "k out of range, no or too many "
                  "queries, an unknown exclude path"},
            422: {"model": RequestError, "description": "not JSON, a missing or unknown "
                  "field, a value of the wrong type"}}

app = FastAPI(title="pbg_ray", description=(
    "Link scores, top-k heads and tails, and nearest neighbours of a pbg_ray checkpoint, by "
    "names. Scores are the model's own (relation operator and comparator). Bodies are read "
    "as JSON whatever their Content-Type says (`curl -d` sends a form's). A batch is "
    "answered per query: a query naming an unknown entity or relation gets `{\"error\": "
    "...}` in its answer's place, `errors` counts those, and the other queries are "
    "answered; a request wrong as a whole gets a 4xx with `{\"error\": ...}`."))


@app.exception_handler(PbgRayError)
async def user_error(request: Request, err: PbgRayError) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": str(err)})


@app.exception_handler(RequestValidationError)
async def malformed(request: Request, err: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                         for e in err.errors())
    return JSONResponse(status_code=422, content={"error": f"malformed request: {problems}",
                                                  "detail": jsonable(err.errors())})


def jsonable(errors: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]


def per_query(key: str, version: int, answers: List[Answer]) -> Dict[str, Any]:
    """A batch's response: under `key` each query's answer (a score, or the k best as
    name and score) or {"error": ...}; "errors" counts the latter."""
    out = [{"error": str(a)} if isinstance(a, PbgRayError) else
           a if isinstance(a, float) else [{"name": name, "score": score} for name, score in a]
           for a in answers]
    return {"version": version, key: out,
            "errors": sum(isinstance(a, PbgRayError) for a in answers)}


class ShardUnavailable(Exception):
    """A shard group could not answer a request (its replica died or is overloaded)."""


async def unwrapped(response: Any, group: int) -> Any:
    """Shard group `group`'s answer; a PbgRayError it raised (a damaged edge file, say) as
    itself, so that the client gets its 4xx; an unavailable group as ShardUnavailable."""
    try:
        return await response
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, PbgRayError):
            raise err.cause from None
        raise
    except UNAVAILABLE as err:
        raise ShardUnavailable(
            f"shard group {group} (deployment Shard{group}) is unavailable: "
            f"{type(err).__name__}: {first_line(err)}. Serve replaces a replica that died; "
            "retry in a few seconds.") from err


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def described(err: BaseException) -> str:
    """An error in one line: a PbgRayError's message, another's type and message (a Ray
    task's: its cause's)."""
    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
    if isinstance(cause, PbgRayError):
        return str(cause)
    return f"{type(cause).__name__}: {first_line(cause)}"


class JsonBodies:
    """ASGI middleware: a request's body is read as JSON whatever its Content-Type says
    (`curl -d` sends application/x-www-form-urlencoded, other clients text/plain or none);
    every route takes JSON. (A page of another site may thus post a query here, as it could
    post a form: every route only reads, and the answer is the page's to read only if this
    service allowed it, which it does not.)"""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)


class JsonErrors:
    """ASGI middleware: an exception no route handles (a shard group unavailable, a bug)
    answers as JSON, 503 for ShardUnavailable and 500 otherwise, naming what happened,
    instead of a plain-text traceback; the replica keeps serving."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:
            if started:  # an answer is on its way: nothing else can be sent
                raise
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if isinstance(err, ShardUnavailable):
                response = JSONResponse(status_code=503, content={"error": str(err)},
                                        headers={"Retry-After": "5"})
            else:
                response = JSONResponse(status_code=500, content={"error": (
                    f"internal error answering {scope['path']}: {described(err)} (the "
                    "traceback is in the Serve replica's log)")})
            await response(scope, receive, send)


app.add_middleware(JsonErrors)
app.add_middleware(JsonBodies)


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


# No access-log line per request.
LOGGING = {"enable_access_log": False}


@serve.deployment(max_ongoing_requests=8, logging_config=LOGGING)
class Shard:
    """One shard group's partitions, at the newest versions asked for. Searches run on the
    replica's event loop one at a time (serve.shard_threads threads each): CPU-bound work
    that threads of the replica would only interleave."""

    def __init__(self, config: Dict[str, Any], shard: int, version: int) -> None:
        import faiss

        self.config = ConfigSchema.from_dict(config)
        torch.set_num_threads(self.config.serve.shard_threads)
        faiss.omp_set_num_threads(self.config.serve.shard_threads)
        self.shard = shard
        self.tables: Dict[int, ShardTables] = {}
        self.lock = threading.Lock()
        if CheckpointManager(self.config.checkpoint_path).has_model(version):
            self.load(version)
        # else: a replica Serve started (after one died) once newer versions replaced the
        # one the application started with; each request's version loads on first use.

    def load(self, version: int) -> int:
        with self.lock:
            if version not in self.tables:
                self.tables[version] = ShardTables(self.config, version, self.shard)
                for old in sorted(self.tables)[:-KEEP_VERSIONS]:
                    del self.tables[old]
        return version

    def at(self, version: int) -> ShardTables:
        tables = self.tables.get(version)
        if tables is None:
            self.load(version)
            tables = self.tables[version]
        return tables

    async def rows(self, version: int, entity: str, part: int, offsets: np.ndarray
                   ) -> np.ndarray:
        return self.at(version).rows(entity, part, offsets)

    async def search(self, version: int, *args: Any) -> Any:
        found = self.at(version).search_group(*args)
        if faults_dir():  # after the search, off the event loop: by then Serve's router has
            await asyncio.to_thread(fault_point, "serve.shard_search")  # its acceptance
        return found


@serve.deployment(max_ongoing_requests=256, logging_config=LOGGING)
@serve.ingress(app)
class Router:
    """The HTTP API; answers come from the shards (one handle per shard group)."""

    def __init__(self, config: Dict[str, Any], version: int, shards: List[Any]) -> None:
        self.config = ConfigSchema.from_dict(config)
        self.shards = shards
        self.model = ServingModel(self.config, version)
        self.watcher: Optional[asyncio.Task] = None
        # The newest take-up that failed ({"version", "error"}), None once one succeeds;
        # `changed` tells newer_version of a switch or a failure.
        self.failure: Optional[Dict[str, Any]] = None
        self.changed = asyncio.Condition()

    def current(self) -> ServingModel:
        """The model requests start with; starts the version watcher on first use."""
        if (self.watcher is None and self.config.serve.version is None
                and self.config.serve.reload_interval > 0):
            self.watcher = asyncio.get_running_loop().create_task(self.watch())
        return self.model

    async def watch(self) -> None:
        """Take up each newer checkpoint version: indexes, shards, then the model; a take-up
        that failed (a version removed under us, say) is tried again at the next check."""
        checkpoint = CheckpointManager(self.config.checkpoint_path)
        while True:
            await asyncio.sleep(self.config.serve.reload_interval)
            version = None
            try:
                version = checkpoint.version()
                if version > self.model.version:
                    await build_indexes(self.config, version)
                    await asyncio.gather(*(s.load.remote(version) for s in self.shards))
                    self.model = ServingModel(self.config, version, self.model)
                    await self.tell(None)
            except Exception as err:
                logger.exception("taking up checkpoint version %s failed", version)
                await self.tell({"version": version, "error": described(err)})

    async def tell(self, failure: Optional[Dict[str, Any]]) -> None:
        async with self.changed:
            self.failure = failure
            self.changed.notify_all()

    async def newer_version(self, version: int, failure: Optional[Dict[str, Any]]
                            ) -> Dict[str, Any]:
        """Returns once the version served is newer than `version` or a take-up failed
        otherwise than `failure` (what the caller heard last): {"version": the one served,
        "failure": the newest failure or None}. The command prints a line of each."""
        self.current()  # the watcher runs from the first call on
        async with self.changed:
            await self.changed.wait_for(lambda: self.model.version > version
                                        or self.failure not in (None, failure))
            return {"version": self.model.version, "failure": self.failure}

    def access(self, model: ServingModel):
        """The shards' rows and search as the model's callables, at its version."""
        version = model.version

        async def rows(entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
            group = part % self.config.serve.shard_groups
            return await unwrapped(self.shards[group].rows.remote(version, entity, part,
                                                                  offsets), group)

        def search(shard: int):
            async def call(*args: Any):
                return await unwrapped(self.shards[shard].search.remote(version, *args), shard)
            return call

        return rows, search

    @app.get("/health")
    async def health(self) -> Dict[str, Any]:
        return {"status": "ok", "version": self.current().version}

    @app.get("/metadata")
    async def metadata(self) -> Dict[str, Any]:
        return self.current().metadata()

    @app.post("/score", response_model=None, responses={200: {"model": ScoreResponse},
                                                         **ANSWERED})
    async def score(self, request: ScoreRequest) -> Dict[str, Any]:
        """The model's score of each edge; an edge naming an unknown entity or relation
        gets {"error": ...} instead."""
        model = self.current()
        rows, _ = self.access(model)
        scores = await model.score(rows, [(e.lhs, e.relation, e.rhs) for e in request.edges])
        return per_query("scores", model.version, scores)

    @app.post("/top_rhs", response_model=None, responses={200: {"model": RankedResponse},
                                                           **ANSWERED})
    async def top_rhs(self, request: TopRhsRequest) -> Dict[str, Any]:
        """The k best tails (rhs) of each (lhs, relation); a query naming an unknown entity
        or relation gets {"error": ...} instead."""
        return await self.top("rhs", [(q.lhs, q.relation) for q in request.queries], request)

    @app.post("/top_lhs", response_model=None, responses={200: {"model": RankedResponse},
                                                           **ANSWERED})
    async def top_lhs(self, request: TopLhsRequest) -> Dict[str, Any]:
        """The k best heads (lhs) of each (relation, rhs); a query naming an unknown entity
        or relation gets {"error": ...} instead."""
        return await self.top("lhs", [(q.rhs, q.relation) for q in request.queries], request)

    async def top(self, side: str, queries: List[Any], request: TopOptions) -> Dict[str, Any]:
        model = self.current()
        answers = await model.top(*self.access(model), side, queries, request.k,
                                  request.exclude, request.exact)
        return per_query("results", model.version, answers)

    @app.post("/neighbors", response_model=None, responses={200: {"model": RankedResponse},
                                                             **ANSWERED})
    async def neighbors(self, request: NeighborsRequest) -> Dict[str, Any]:
        """The k entities nearest to each entity (itself left out) or vector; a query
        naming an unknown entity or type, or a vector of the wrong length, gets
        {"error": ...} instead."""
        model = self.current()
        answers = await model.neighbors(*self.access(model), [q.model_dump() for q in
                                                              request.queries],
                                        request.k, request.exact)
        return per_query("results", model.version, answers)


def start_service(config: ConfigSchema) -> Dict[str, Any]:
    """Connect to Ray, build the served version's indexes and start the application on
    serve.host:serve.port. Returns the URL, the version and the index build's figures.
    Serve's INFO lines in this process (started, deploying, ready at its proxy's port,
    deleting) are left out: the caller says what is served where."""
    config = config.checked().with_absolute_paths()
    logging.getLogger(SERVE_LOGGER_NAME).setLevel(logging.WARNING)
    connect_ray(config.ray)
    serve_config = config.serve
    if serve_config.ingress == "direct" and serve_running():
        raise PbgRayError(
            "Ray Serve already runs on this Ray cluster, and serve.ingress=direct needs a Serve "
            "started by pbg_ray (its controller assigns the router's port serve.port when it "
            "starts). Stop the other Serve (`serve shutdown -y`) or set serve.ingress=proxy.")
    checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
        config, config.serve.version, "serve.version")
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


def serve_running() -> bool:
    """Whether a Ray Serve controller runs on the connected Ray cluster."""
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def version_changes(version: int) -> Iterator[Dict[str, Any]]:
    """Each change of what the service serves, as the router takes up (or fails to take up)
    a version newer than `version` (Router.newer_version), for ever; {"version": the one
    served, "failure": {"version", "error"} of the newest failure or None}."""
    router = serve.get_app_handle(APPLICATION)
    failure = None
    while True:
        response = router.newer_version.remote(version, failure)
        try:
            news = response.result()
        except UNAVAILABLE:  # the router replica asked died; Serve starts another
            continue
        except BaseException:  # stopped (Ctrl-C, SIGTERM): no call left waiting, which
            response.cancel()  # would hold up the router replica's stop
            raise
        yield news
        version, failure = news["version"], news["failure"]


def stop_service(end_serve: bool = True) -> None:
    """Delete the application (its replicas finish the requests they hold), then, with
    end_serve, end Serve: its controller stops the proxies and ends itself. (serve.shutdown()
    asks it that with Ray's retries, and Ray prints that the call "failed" and "will be
    retried" as the controller ends; asked here without retries, serve.shutdown() then only
    drops Serve's handle of it.) Without end_serve, Serve's controller and proxies are left
    to the end of the Ray they run on: a driver that holds a handle (version_changes) would
    have Ray print the same of its handle's calls to the ended controller. Serve's notices
    of replicas ending (in this process's handles) are what was asked for: left out."""
    logging.getLogger(SERVE_LOGGER_NAME).setLevel(logging.ERROR)
    serve.delete(APPLICATION)
    if not end_serve:
        return
    if serve_running():
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        try:
            ray.get(controller.graceful_shutdown.options(max_task_retries=0).remote())
        except ray.exceptions.RayActorError:
            pass  # it ended, as asked
    serve.shutdown()
