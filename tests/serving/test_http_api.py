"""The HTTP service over real HTTP: a checkpoint the engine trained, served on Ray Serve on a
free loopback port with faiss indexes over two shard groups; its scores and rankings are
the Predictor's and eval's, bad requests get 4xx JSON errors, and a new version is taken up
while requests keep succeeding; a shard replica that dies mid-request, or any
unexpected error, is a JSON 5xx, and the service goes on."""

import asyncio
import dataclasses
import json
import logging
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import ray
import torch

from pbg_ray import predict
from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.filtered import rank_counts
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.evaluation.questions import answer_json
from pbg_ray.io.edges import read_edges
from pbg_ray.serving.http_api import JsonErrors, unwrapped
from pbg_ray.serving.index import INDEX_DIRECTORY
from pbg_ray.serving.launch import start_service, stop_service
from pbg_ray.types import Bucket
from tests.fault_injection import FAULTS_DIR, armed
from tests.util import config_dict, write_random_graph

# The module's server takes a training run, the index build tasks and Serve's start.
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, ray_session):
    """(config, httpx client) of a trained one-epoch checkpoint served by the application,
    following the newest version (serve.follow=newest: its best/, kept as validation would
    have kept it, stays at version 1); serve is shut down after the module."""
    from pbg_ray.training.trainer import Trainer

    root = tmp_path_factory.mktemp("served")
    config = ConfigSchema.from_dict(config_dict(
        root, num_epochs=1, serve={"port": free_port(), "index": "hnsw", "shard_groups": 2,
                                   "index_cpus": 0.5, "reload_interval": 0.5, "max_k": 100,
                                   "follow": "newest"}))
    write_random_graph(config, num_edges=200)
    Trainer(config).run()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.preserve_version(1, storage.best_path(), config)
    started = start_service(config)
    with httpx.Client(base_url=started["url"], timeout=60) as client:
        yield config, client
    stop_service()


@pytest.fixture
def predictor(served):
    """The Predictor of the version the service serves now (test_a_new_version_... adds one)."""
    config, client = served
    return Predictor.load(config.checkpoint_path, version=client.get("/health").json()["version"])


def test_the_commands_own_router_notices_stay_off_its_terminal(served):
    """The request router in the process that started the service carries only its watch of
    the versions: its notices (a queue-length probe answered late on a busy machine) are
    left out, Serve's other warnings are not."""
    from ray.serve._private.constants import SERVE_LOGGER_NAME
    from ray.serve._private.request_router import request_router

    serve_logger = logging.getLogger(SERVE_LOGGER_NAME)
    shown = []
    handler = logging.Handler()
    handler.emit = shown.append
    serve_logger.addHandler(handler)
    try:
        for source in (request_router.__file__, __file__):
            serve_logger.handle(serve_logger.makeRecord(
                SERVE_LOGGER_NAME, logging.WARNING, source, 1,
                "Failed to get queue length from Replica within 0.1s.", (), None))
    finally:
        serve_logger.removeHandler(handler)
    assert [record.pathname for record in shown] == [__file__]


def post(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def everyone(predictor, entity):
    return [n for part in predictor.names(entity) for n in part]


def test_scores_are_the_predictors(served, predictor):
    config, client = served
    users, items = everyone(predictor, "user"), everyone(predictor, "item")
    triples = [(u, "likes", i) for u in users[::7] for i in items[::3]] + \
              [(u, "follows", v) for u in users[::5] for v in users[::4]]
    got = post(client, "/score", {"queries": [dict(zip(("lhs", "relation", "rhs"), t))
                                              for t in triples]})
    assert got["version"] == predictor.embedding_source.version
    np.testing.assert_allclose([a["score"] for a in got["answers"]], predictor.score(triples),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("side,relation", [("rhs", "likes"), ("rhs", "follows"),
                                           ("lhs", "follows"), ("lhs", "likes"),
                                           ("rhs", "tagged")])
def test_top_k_is_the_predictors(served, predictor, side, relation, exact):
    """Exact search and the HNSW index (these tables are small enough for it to find every
    best candidate) rank and score as the Predictor does, per relation operator."""
    config, client = served
    rconf = next(r for r in config.relations if r.name == relation)
    given = everyone(predictor, rconf.lhs if side == "rhs" else rconf.rhs)[::9]
    queries = [{"lhs": n, "relation": relation} if side == "rhs" else
               {"relation": relation, "rhs": n} for n in given]
    got = [a["hits"] for a in post(client, f"/top_{side}", {"queries": queries, "k": 6,
                                                            "exact": exact})["answers"]]
    for name, answer in zip(given, got):
        want = (predictor.top_rhs(name, relation, k=6) if side == "rhs"
                else predictor.top_lhs(relation, name, k=6))
        assert [a["name"] for a in answer] == [n for n, _ in want]
        np.testing.assert_allclose([a["score"] for a in answer], [s for _, s in want],
                                   rtol=1e-5, atol=1e-5)


def predict_batch(config, version, command, lines, options, tmp_path):
    """`python -m pbg_ray.predict` in batch mode (its Ray tasks): each line's answer, in the
    file's order, its line number and the question's fields (which it carries) left out."""
    queries, output = tmp_path / f"{command}.tsv", tmp_path / f"{command}.jsonl"
    queries.write_text("".join("\t".join(line) + "\n" for line in lines))
    with pytest.raises(SystemExit) as ended:  # a line names what the model lacks
        predict.main([config.checkpoint_path, "--version", str(version), command,
                      "--queries", str(queries), "--output", str(output), *options])
    assert ended.value.code == 1
    answers = [json.loads(line) for line in output.read_text().splitlines()]
    fields = predict.FIELDS[command]
    assert [tuple(a[f] for f in fields) for a in answers] == [tuple(line) for line in lines]
    return [{k: v for k, v in a.items() if k not in ("line", *fields)} for a in answers]


def test_the_api_the_predict_command_and_the_service_answer_alike(served, predictor, tmp_path):
    """One scoring core and one vocabulary: on one checkpoint version, the Python API (its
    answers as api.answer_json writes them), the predict command's lines and the service's
    answers are the same objects, {"score"}, {"hits": [{"name", "score"}]} or {"error"}:
    the same scores, top-k (known edges excluded) and neighbours, and the same error for a
    name the model lacks."""
    config, client = served
    version = predictor.embedding_source.version
    users, items = everyone(predictor, "user")[::13], everyone(predictor, "item")[::7]
    edges = [(u, "likes", i) for u, i in zip(users, items)] + [("user-0-1", "likes", "itme-0-1")]
    tops = [(u, "follows") for u in users] + [("usr-0-1", "likes")]
    names = users[:3] + ["nobody-0-1"]
    path = config.edge_paths[0]

    def api(call):
        try:
            return answer_json(call())
        except PbgRayError as err:
            return answer_json(err)

    def http(route, body):
        got = post(client, route, body)
        assert got["version"] == version
        return got["answers"]

    def same(*answers):
        for got in answers[1:]:
            assert len(got) == len(answers[0])
            for a, b in zip(got, answers[0]):
                assert a.keys() == b.keys() and len(a) == 1, (a, b)
                if "score" in b:
                    assert a["score"] == pytest.approx(b["score"], rel=1e-5, abs=1e-5)
                elif "hits" in b:
                    assert [h["name"] for h in a["hits"]] == [h["name"] for h in b["hits"]]
                    np.testing.assert_allclose([h["score"] for h in a["hits"]],
                                               [h["score"] for h in b["hits"]],
                                               rtol=1e-5, atol=1e-5)
                else:
                    assert a == b

    same([api(lambda: predictor.score(e)) for e in edges],
         predict_batch(config, version, "score", edges, [], tmp_path),
         http("/score", {"queries": [dict(zip(("lhs", "relation", "rhs"), e)) for e in edges]}))
    same([api(lambda: predictor.top_rhs(*q, k=5, exclude=path)) for q in tops],
         predict_batch(config, version, "top-rhs", tops, ["-k", "5", "--exclude", path],
                       tmp_path),
         http("/top_rhs", {"queries": [{"lhs": u, "relation": r} for u, r in tops], "k": 5,
                           "exact": True, "exclude": [path]}))
    same([api(lambda: predictor.neighbors(n, k=4)) for n in names],
         predict_batch(config, version, "neighbors", [(n,) for n in names], ["-k", "4"],
                       tmp_path),
         http("/neighbors", {"queries": [{"entity": n} for n in names], "k": 4, "exact": True}))


def test_exclusion_of_known_edges_is_the_predictors(served, predictor):
    config, client = served
    path = config.edge_paths[0]
    for name in everyone(predictor, "user")[::11]:
        for by in (path, "edges"):  # by path or by the path's last name
            got = post(client, "/top_rhs", {"queries": [{"lhs": name, "relation": "likes"}],
                                            "k": 100, "exclude": [by]})["answers"][0]["hits"]
            want = predictor.top_rhs(name, "likes", k=100, exclude=[path])
            assert [a["name"] for a in got] == [n for n, _ in want]


def test_ranks_agree_with_eval(served, predictor):
    """For each edge of a bucket, the candidates the service scores at or above the true
    rhs are eval's raw rank count (pbg_ray.evaluation.filtered.rank_counts)."""
    config, client = served
    bucket = Bucket(1, 0)
    edges = read_edges(config.edge_paths[0], bucket)
    edges = edges[np.flatnonzero(edges.rel == 1)[:12]]  # likes: user -> item
    tables = {(e, p): torch.from_numpy(predictor.embedding_source.read(e, p))
              for e, econf in config.entities.items() for p in range(econf.num_partitions)}
    counts = sum(rank_counts(predictor.scorer, bucket, edges, part, tables, {})["rhs"]
                 for part in range(2))
    users, items = predictor.names("user"), predictor.names("item")
    queries = [{"lhs": users[1][lhs], "relation": "likes"} for lhs in edges.lhs]
    got = [a["hits"] for a in post(client, "/top_rhs", {"queries": queries, "k": 100,
                                                         "exact": True})["answers"]]
    for answer, rhs, count in zip(got, edges.rhs, counts):
        scores = {a["name"]: a["score"] for a in answer}
        true = scores.pop(items[0][rhs])
        assert sum(s >= true for s in scores.values()) == count


def test_neighbors_of_an_entity_and_of_a_vector(served, predictor):
    config, client = served
    name = everyone(predictor, "item")[5]
    got = post(client, "/neighbors", {"queries": [{"entity": name}], "k": 5})["answers"][0]["hits"]
    want = predictor.neighbors(name, k=5)
    assert [a["name"] for a in got] == [n for n, _ in want]
    np.testing.assert_allclose([a["score"] for a in got], [s for _, s in want], rtol=1e-5)
    part, offset = predictor.entity_names.lookup([("item", name)])["item", name]
    row = predictor.embedding_source.read("item", part)[offset:offset + 1]
    vector = predictor.scorer.entity_vectors("item", torch.from_numpy(row))
    by_vector = post(client, "/neighbors", {"queries": [{"vector": vector[0].tolist(),
                                                         "entity_type": "item"}],
                                            "k": 6, "exact": True})["answers"][0]["hits"]
    assert by_vector[0]["name"] == name  # itself first, then the same neighbours
    assert [a["name"] for a in by_vector[1:]] == [n for n, _ in want]


def test_direct_ingress_is_refused_beside_a_serve_already_running(served):
    config, client = served
    with pytest.raises(PbgRayError, match="serve.ingress=proxy"):
        start_service(config)
    assert client.get("/health").json()["status"] == "ok"


def test_a_batch_answers_as_single_requests(served, predictor):
    config, client = served
    queries = [{"lhs": n, "relation": r} for n in everyone(predictor, "user")[:4]
               for r in ("likes", "follows")]
    batch = post(client, "/top_rhs", {"queries": queries, "k": 3})["answers"]
    single = [post(client, "/top_rhs", {"queries": [q], "k": 3})["answers"][0] for q in queries]
    assert batch == single


def test_metadata_health_and_openapi(served, predictor):
    config, client = served
    meta, version = client.get("/metadata").json(), predictor.embedding_source.version
    assert meta["version"] == version and meta["dimension"] == config.dimension
    assert meta["entity_types"]["user"] == {"count": sum(map(len, predictor.names("user"))),
                                           "partitions": 2, "dimension": config.dimension}
    assert [r["name"] for r in meta["relations"]] == ["follows", "likes", "tagged"]
    assert client.get("/health").json() == {"status": "ok", "version": version}
    openapi = client.get("/openapi.json").json()
    paths = openapi["paths"]
    assert {"/score", "/top_rhs", "/top_lhs", "/neighbors", "/metadata", "/health"} <= set(paths)
    # The per-query errors and the content types taken are documented.
    assert "answered per query" in openapi["info"]["description"]
    assert "whatever their Content-Type says" in openapi["info"]["description"]
    for path, answers in (("/score", "ScoreResponse"), ("/top_rhs", "RankedResponse"),
                          ("/neighbors", "RankedResponse")):
        responses = paths[path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
            answers)
        assert {"400", "422"} <= set(responses)
        assert '{"error": ...}' in paths[path]["post"]["description"]
        assert "errors" in openapi["components"]["schemas"][answers]["properties"]
    assert client.get("/docs").status_code == 200


BAD_REQUESTS = [  # wrong as a whole: a 4xx
    ("/top_rhs", {"queries": [{"lhs": "user-0-1", "relation": "likes"}], "k": 0}, 400,
     r"k=0 is out of range: ask for 1 to 100"),
    ("/top_rhs", {"queries": [{"lhs": "user-0-1", "relation": "likes"}], "k": 101}, 400,
     r"k=101 is out of range"),
    ("/top_rhs", {"queries": [{"lhs": "user-0-1", "relation": "likes"}], "k": "ten"}, 422,
     r"malformed request: k: "),
    ("/top_rhs", {"queries": []}, 400, r"0 queries in one request"),
    ("/score", {"queries": [{"lhs": "user-0-1", "relation": "likes", "rhs": "item-0-1"}] * 1025},
     400, r"1025 queries in one request: send 1 to 1024 \(serve.max_batch\)"),
    ("/top_rhs", {"queries": [{"lhs": "user-0-1", "relation": "likes"}],
                  "exclude": ["edgez"]}, 400,
     r"'edgez' is not an edge path of the served config \(did you mean 'edges'\?\)"),
    ("/top_rhs", {"query": [{"lhs": "user-0-1", "relation": "likes"}]}, 422,
     r"queries: Field required; query: Extra inputs are not permitted"),
    ("/score", {"queries": [{"lhs": "user-0-1", "rhs": "item-0-1"}]}, 422,
     r"queries\.0\.relation: Field required"),
]

@pytest.mark.parametrize("path,body,status,message", BAD_REQUESTS)
def test_bad_requests_get_4xx_json_errors(served, path, body, status, message):
    response = served[1].post(path, json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert re.search(message, response.json()["error"]), response.json()["error"]


# (path, a good query, a bad one (its JSON), the bad one's error): wrong on its own, a query
# gets its error in its answer's place.
QUERY_ERRORS = [
    ("/score", {"lhs": "user-0-1", "relation": "likes", "rhs": "item-0-1"},
     '{"lhs": "user-0-1", "relation": "like", "rhs": "item-0-1"}',
     r"^unknown relation 'like' \(did you mean 'likes'\?\)"),
    ("/score", {"lhs": "user-0-1", "relation": "likes", "rhs": "item-0-1"},
     '{"lhs": "user-0-300", "relation": "likes", "rhs": "item-0-1"}',
     r"^unknown user entity 'user-0-300' \(did you mean 'user-0-3"),
    ("/top_rhs", {"lhs": "user-0-1", "relation": "likes"},
     '{"lhs": "item-0-1", "relation": "likes"}',
     r"^'item-0-1' is an entity of type 'item', not of type 'user'"),
    ("/top_lhs", {"relation": "likes", "rhs": "item-0-1"},
     '{"relation": "likes", "rhs": "user-0-1"}', r"not of type 'item'"),
    ("/neighbors", {"entity": "item-0-1"}, '{"vector": [1.0, 2.0], "entity_type": "item"}',
     r"^vector has 2 values; item embeddings have 8"),
    ("/neighbors", {"entity": "item-0-1"}, '{"vector": [1, 1, 1, 1, 1, 1, 1, 1]}',
     r"needs entity_type"),
    ("/neighbors", {"entity": "item-0-1"}, '{"entity": "item-0-1", "entity_type": "itme"}',
     r"^unknown entity type 'itme' \(did you mean 'item'\?\)"),
    ("/neighbors", {"entity": "item-0-1"}, '{"entity": "nobody-0-1"}', r"is unknown"),
    ("/neighbors", {"entity": "item-0-1"}, '{"entity_type": "item"}',
     r"either entity .* or vector"),
    ("/neighbors", {"entity": "item-0-1"},  # Python's JSON parser (the server's) takes NaN
     '{"vector": [1, 1, 1, 1, 1, 1, 1, NaN], "entity_type": "item"}', r"all finite"),
]


@pytest.mark.parametrize("path,good,bad,message", QUERY_ERRORS)
def test_a_bad_query_gets_its_error_and_the_others_their_answers(served, path, good, bad,
                                                                 message):
    client = served[1]
    answers = "answers"
    alone = post(client, path, {"queries": [good]})
    body = f'{{"queries": [{json.dumps(good)}, {bad}, {json.dumps(good)}]}}'
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["errors"] == 1 and alone["errors"] == 0
    assert got[answers][0] == got[answers][2] == alone[answers][0]
    assert list(got[answers][1]) == ["error"], got
    assert re.search(message, got[answers][1]["error"]), got[answers][1]["error"]


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded",
                                          "text/plain"])
def test_a_json_body_is_read_as_json_whatever_its_content_type(served, content_type):
    """`curl -d` sends a form's content type, other clients text/plain or none."""
    client = served[1]
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post("/neighbors", content=json.dumps(NEIGHBOURS), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json() == post(client, "/neighbors", NEIGHBOURS)


def test_a_body_that_is_not_json_and_an_unknown_route_are_4xx(served):
    client = served[1]
    response = client.post("/top_rhs", content=b"{not json", headers={
        "content-type": "application/json"})
    assert response.status_code == 422 and "malformed request" in response.json()["error"]
    assert client.get("/nowhere").status_code == 404
    assert client.get("/health").status_code == 200  # the server lives on


def test_a_new_version_is_taken_up_while_requests_succeed(served):
    """Train one more version while a client loop queries; every request succeeds and the
    version the answers name goes from the served one to the next (serve.follow=newest:
    though best/ keeps version 1)."""
    from pbg_ray.training.trainer import Trainer

    config, client = served
    served_version = client.get("/health").json()["version"]
    new = served_version + 1
    statuses, versions = [], []
    done = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=60) as own:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and len(statuses) < 20000:
                response = own.post("/top_rhs", json={
                    "queries": [{"lhs": "user-0-1", "relation": "likes"}], "k": 3})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    versions.append(response.json()["version"])
                    if versions[-1] == new and done.is_set():
                        return

    loop = threading.Thread(target=load)
    loop.start()
    Trainer(dataclasses.replace(config, num_epochs=new)).run()
    done.set()
    loop.join()
    assert statuses and set(statuses) == {200}
    assert versions[0] == served_version and versions[-1] == new
    assert versions == sorted(versions)
    assert client.get("/metadata").json()["version"] == new
    # The live service answers from the new version's own indexes, as its Predictor does.
    assert (Path(config.checkpoint_path) / INDEX_DIRECTORY / f"v{new}").is_dir()
    newer = Predictor.load(config.checkpoint_path, version=new)
    users = everyone(newer, "user")[::13]
    got = post(client, "/top_rhs", {"queries": [{"lhs": u, "relation": "likes"} for u in users],
                                    "k": 5})
    assert got["version"] == new
    for user, answer in zip(users, [a["hits"] for a in got["answers"]]):
        want = newer.top_rhs(user, "likes", k=5)
        assert [a["name"] for a in answer] == [n for n, _ in want]
        np.testing.assert_allclose([a["score"] for a in answer], [s for _, s in want],
                                   rtol=1e-5, atol=1e-5)


def shard_replica(group: int):
    """The actor handle of shard group `group`'s replica (Serve names its replicas)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"#Shard{group}#" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace="serve")


NEIGHBOURS = {"queries": [{"entity": "user-0-1"}], "k": 3}  # searched in both shard groups


def test_a_shard_replica_dying_mid_request_is_answered_in_json_and_serving_goes_on(served):
    """A request held inside shard group 0's replica while the test kills that replica
    (ray.kill) is answered in JSON: with a 503 naming the group, or, where the replica died
    before Serve's router had taken its acceptance of the request (a race inside Serve,
    router.py's _route_and_send_request_once), by the replica Serve starts in its place,
    with the answer the service gave before. The requests after it succeed."""
    client = served[1]
    before = client.post("/neighbors", json=NEIGHBOURS)
    assert before.status_code == 200, before.text
    answers = {}
    with armed("serve.shard_search", action="hold") as fired:
        request = threading.Thread(target=lambda: answers.update(
            first=client.post("/neighbors", json=NEIGHBOURS)))
        request.start()
        deadline = time.monotonic() + 60
        while not fired() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fired(), "no request reached a shard's search"
        held = int(next(FAULTS_DIR.glob("serve.shard_search.fired-*")).name.rsplit("-", 1)[1])
        title = " ".join(psutil.Process(held).cmdline())  # ray::ServeReplica:pbg_ray:Shard<g>
        group = int(re.search(r"pbg_ray:Shard(\d+)", title).group(1))
        ray.kill(shard_replica(group), no_restart=True)
        request.join(timeout=120)
    first = answers["first"]
    assert first.headers["content-type"] == "application/json", first.text
    if first.status_code == 200:  # retried by Serve on the new replica
        assert first.json() == before.json()
    else:
        assert first.status_code == 503, first.text
        assert re.search(rf"shard group {group} \(deployment Shard{group}\) is unavailable: "
                         r"\w+Error", first.json()["error"]), first.json()["error"]
    statuses = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and statuses[-3:] != [200] * 3:
        response = client.post("/neighbors", json=NEIGHBOURS)
        assert response.headers["content-type"] == "application/json", response.text
        statuses.append(response.status_code)
        time.sleep(0.2 if response.status_code == 200 else 1)
    assert statuses[-3:] == [200] * 3, statuses
    assert set(statuses) <= {200, 503}, statuses


@ray.remote
class Stuck:
    """An actor whose call never returns: killed, the call's result is an ActorDiedError,
    as a shard replica's is when it dies after Serve's router took the request."""

    def wait(self) -> None:
        threading.Event().wait()


def test_a_shard_group_that_died_with_the_request_is_a_json_503_naming_it(ray_session):
    """The router's await of a shard group's answer that fails with the actor's death is a
    503 naming the group, with Retry-After, from the application's error middleware."""
    stuck = Stuck.remote()
    answer = stuck.wait.remote()
    ray.kill(stuck)

    async def route(scope, receive, send):
        await unwrapped(answer, 1)

    async def request():
        transport = httpx.ASGITransport(app=JsonErrors(route))
        async with httpx.AsyncClient(transport=transport, base_url="http://pbg") as client:
            return await client.post("/neighbors", json=NEIGHBOURS)

    response = asyncio.run(request())
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "5"
    assert re.fullmatch(r"shard group 1 \(deployment Shard1\) is unavailable: ActorDiedError: "
                        r".+ Serve replaces a replica that died; retry in a few seconds\.",
                        response.json()["error"]), response.json()["error"]


def test_an_unexpected_error_in_a_shard_is_a_json_500_and_serving_goes_on(served):
    client = served[1]
    with armed("serve.shard_search", action="raise") as fired:
        response = client.post("/neighbors", json=NEIGHBOURS)
        assert fired()
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"].startswith(
        "internal error answering /neighbors: FaultInjected: fault injected at "
        "serve.shard_search"), response.json()["error"]
    assert post(client, "/neighbors", NEIGHBOURS)["answers"][0]["hits"]
