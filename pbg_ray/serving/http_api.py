"""The HTTP API on Ray Serve: a FastAPI ingress (the router: names, queries, merging) over
one deployment per shard group (partitions p with p mod serve.shard_groups equal), each
replica holding its partitions' candidate sets and indexes.

A new checkpoint version (serve.version null: a new best on validation, or with
serve.follow=newest a newer version) is taken up without dropping requests: the router's
watcher builds the version's indexes, has the shards load it beside the one they serve
(from best/ or a snapshot where the checkpoint dropped it), then switches; a request names the version it started with, and shards keep the two
newest, loading a version on its first request if a replica missed the load."""

# No `from __future__ import annotations`: FastAPI reads the request models from the route
# methods' annotations, which Serve's ingress moves out of this module's namespace.
import asyncio
import logging
import threading
from typing import Any, Dict, List, Optional, Union

import numpy as np
import ray
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.exceptions import (
    BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation import questions
from pbg_ray.runtime.faults import fault_point, faults_dir
from pbg_ray.serving.index import build_indexes
from pbg_ray.serving.names import ServingModel
from pbg_ray.serving.shards import ShardTables


logger = logging.getLogger(__name__)


KEEP_VERSIONS = 2  # versions a shard holds: the one served and the one coming (or going)


# What a call to a shard group raises when no replica of it can answer (one died, or all are
# overloaded): the request gets a 503, and a retry succeeds once Serve has replaced it.
UNAVAILABLE = (ray.exceptions.RayActorError, ReplicaUnavailableError,
               DeploymentUnavailableError, BackPressureError)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Edge(Strict):
    lhs: str
    relation: str
    rhs: str


class ScoreRequest(Strict):
    queries: List[Edge] = Field(description="(lhs, relation, rhs) triples by names")


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


# The responses, for the OpenAPI page only (routes return plain dicts, never validated):
# each query's answer as questions.answer_json writes it, as the predict command does.
class Hit(BaseModel):
    name: str
    score: float


class ScoreAnswer(BaseModel):
    score: float = Field(description="the model's score of the edge")


class HitsAnswer(BaseModel):
    hits: List[Hit] = Field(description="the k best entities, best first")


class QueryError(BaseModel):
    error: str = Field(description="why this query has no answer: an unknown entity or "
                       "relation (with the nearest known name), an entity on the wrong side "
                       "of the relation, a vector of the wrong length")


class Answered(BaseModel):
    version: int = Field(description="the checkpoint version that answered")
    errors: int = Field(description="how many queries have an error instead of an answer")


class ScoreResponse(Answered):
    answers: List[Union[ScoreAnswer, QueryError]] = Field(
        description="per query, in the request's order: its score, or its error")


class RankedResponse(Answered):
    answers: List[Union[HitsAnswer, QueryError]] = Field(
        description="per query, in the request's order: its hits, or its error")


class RequestError(BaseModel):
    error: str = Field(description="what is wrong with the request as a whole, and the fix")


ANSWERED = {400: {"model": RequestError, "description": "k out of range, no or too many "
                  "queries, an unknown exclude path"},
            422: {"model": RequestError, "description": "not JSON, a missing or unknown "
                  "field, a value of the wrong type"}}


app = FastAPI(title="pbg_ray", description=(
    "Link scores, top-k heads and tails, and nearest neighbours of a pbg_ray checkpoint, by "
    "names. Scores are the model's own (relation operator and comparator). Bodies are read "
    "as JSON whatever their Content-Type says (`curl -d` sends a form's). Every route takes "
    "`queries` and answers `answers`, one per query in its order: `{\"score\": s}` for an "
    "edge, `{\"hits\": [{\"name\": n, \"score\": s}, ...]}` for the k best or nearest "
    "entities (as the predict command's lines and the Python API's Hit(name, score)). A "
    "batch is answered per query: a query naming an unknown entity or relation gets "
    "`{\"error\": ...}` as its answer, `errors` counts those, and the other queries are "
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


def response_of(version: int, answers: List[questions.Answer]) -> Dict[str, Any]:
    """A batch's response: each query's answer (questions.answer_json: its score, its
    hits, or its error), and how many are errors."""
    return {"version": version, "answers": [questions.answer_json(a) for a in answers],
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


# No access-log line per request.
LOGGING = {"enable_access_log": False}
# How often a stopping replica looks whether the requests it holds are done (Serve's
# default, 2 s, is waited once even by a replica that holds none: every stop took that).
DRAIN_CHECK_S = 0.1


@serve.deployment(max_ongoing_requests=8, logging_config=LOGGING,
                  graceful_shutdown_wait_loop_s=DRAIN_CHECK_S)
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
        if CheckpointManager(self.config.checkpoint_path).holding(version).has_model(version):
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
        if faults_dir():  # after the search, off the event loop: the replica has sent its
            # acceptance by then (Serve's router may not have taken it yet, and retries a
            # request whose replica dies before it has)
            await asyncio.to_thread(fault_point, "serve.shard_search")
        return found


@serve.deployment(max_ongoing_requests=256, logging_config=LOGGING,
                  graceful_shutdown_wait_loop_s=DRAIN_CHECK_S)
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
        """Take up each newer checkpoint version that serve.follow names (the new best, or
        the newest): indexes, shards, then the model; a take-up that failed (a version
        removed under us, say) is tried again at the next check."""
        checkpoint = CheckpointManager(self.config.checkpoint_path)
        while True:
            await asyncio.sleep(self.config.serve.reload_interval)
            version = None
            try:
                version = checkpoint.default_version(best=self.config.serve.follow == "best")
                if version > self.model.version:
                    await build_indexes(self.config, version, self.model.version)
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
        scores = await model.score(rows, [(e.lhs, e.relation, e.rhs) for e in request.queries])
        return response_of(model.version, scores)

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
        return response_of(model.version, answers)

    @app.post("/neighbors", response_model=None, responses={200: {"model": RankedResponse},
                                                             **ANSWERED})
    async def neighbors(self, request: NeighborsRequest) -> Dict[str, Any]:
        """The k entities nearest to each entity (itself left out) or vector; a query
        naming an unknown entity or type, or a vector of the wrong length, gets
        {"error": ...} instead."""
        model = self.current()
        asked = [questions.NeighborQuery(q.entity, q.entity_type, q.vector)
                 for q in request.queries]
        answers = await model.neighbors(*self.access(model), asked, request.k, request.exact)
        return response_of(model.version, answers)
