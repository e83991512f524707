"""`python -m pbg_ray.serve` as a user runs it: a PBG config file and overrides in, the
service up on the port asked for (answered by the router replica itself, or by Serve's
proxy), with no line of Ray's or Serve's; a line for each new version taken up; Ctrl-C and
SIGTERM stopping it with one line and no process of its Ray left; the examples of `--help`
and of the README working as printed; bad settings as one line."""

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import List, Optional, Tuple

import httpx
import psutil
import pytest
from hydra import compose, initialize_config_module

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema, load_pbg_config_file
from pbg_ray.config.hydra import to_config
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.io.entities import save_entity_count, save_entity_names
from tests.commands.test_cli import assert_one_error_line, command, pbg_module, run, tiny_graph
from tests.util import commit_random_version, random_checkpoint

REPO = Path(__file__).resolve().parents[2]
# Generous bounds on waits that end at an event (a line printed, a process ended); reaching
# one fails the test.
GUARD_S = 300


def test_a_bad_serve_setting_is_one_line(tmp_path):
    module = pbg_module(tmp_path / "config.py", tiny_graph(tmp_path))
    code, _, err = run("serve", [module, "serve.index=hnws"], tmp_path)
    assert code == 2
    assert_one_error_line(err, "serve.index", "did you mean 'hnsw'?")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def listener(port: int) -> str:
    """The process title of what listens on a loopback TCP port."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return " ".join(psutil.Process(conn.pid).cmdline())
    return ""


class Service:
    """`python -m pbg_ray.serve ARGS` in its own session (as a terminal's foreground job)
    on a Ray of its own (RAY_TMPDIR), its stdout read line by line, its stderr kept."""

    def __init__(self, args: List[str], cwd: Path, **env: str) -> None:
        self.ray_tmp = tempfile.mkdtemp(prefix="pbg-sv-", dir="/tmp")  # short socket paths
        self.proc = command("serve", args, cwd, env=dict(os.environ, RAY_TMPDIR=self.ray_tmp,
                                                         **env), start_new_session=True)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.error_lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.printed: List[str] = []
        self.stderr: List[str] = []
        self.readers = [threading.Thread(target=read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.lines),
                                              (self.proc.stderr, self.error_lines))]
        for reader in self.readers:
            reader.start()

    def line(self, stream: str = "stdout") -> str:
        """The next line of stdout (or stderr), once printed."""
        lines = self.lines if stream == "stdout" else self.error_lines
        try:
            line = lines.get(timeout=GUARD_S)
        except queue.Empty:
            pytest.fail(f"no line from the command; so far: {self.printed} {self.stderr}")
        if line is None:
            self.end()
            pytest.fail(f"the command ended: {self.printed} {self.stderr} "
                        f"{list(self.error_lines.queue)}")
        (self.printed if stream == "stdout" else self.stderr).append(line)
        return line

    def started(self) -> dict:
        """The start's two lines (the URL, the JSON one) read, the JSON one parsed; the
        processes of the service then (the local Ray's included) noted."""
        first = self.line()
        started = json.loads(self.line())
        assert first.startswith(f"serving version {started['version']} of ")
        assert first.endswith(f" at {started['url']} (API: {started['url']}/docs); Ctrl-C stops")
        self.processes = psutil.Process(self.proc.pid).children(recursive=True)
        return started

    def end(self) -> None:
        """Kill what is left of the command's process group; wait for its output."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing is left of it
        self.proc.wait()
        for reader in self.readers:
            reader.join(GUARD_S)

    def stop(self, sig: int, group: bool) -> Tuple[int, str]:
        """`sig` to the whole process group (as Ctrl-C in a terminal, `timeout`, or `kill --
        -PGID` send it: the local Ray's processes get it too) or to the command alone (as a
        service manager may send it); (exit status, stderr) once the command ended. It
        printed nothing on stdout since the lines read."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(GUARD_S)
        except subprocess.TimeoutExpired:  # (the test's end() kills it)
            pytest.fail(f"still running {GUARD_S} s after {signal.Signals(sig).name}; its "
                        f"stderr: {self.stderr + list(self.error_lines.queue)}")
        for reader in self.readers:
            reader.join(GUARD_S)
        assert self.lines.get_nowait() is None, "a line after those read"
        self.stderr += list(iter(self.error_lines.get_nowait, None))
        return self.proc.returncode, "\n".join(self.stderr)

    def assert_nothing_left(self) -> None:
        """No process of the service's Ray runs: none of those it had while serving, none
        whose command line or environment names its Ray's directory."""
        ours = list(self.processes)
        for process in psutil.process_iter():
            try:
                if (self.ray_tmp in " ".join(process.cmdline())
                        or process.environ().get("RAY_TMPDIR") == self.ray_tmp):
                    ours.append(process)
            except psutil.Error:
                continue
        _, alive = psutil.wait_procs(ours, timeout=GUARD_S)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def read(stream, lines: "queue.Queue[Optional[str]]") -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)  # the command ended


def assert_stopped_cleanly(service: Service, sig: int, group: bool) -> None:
    """Stopped by `sig` (to its process group, or to it alone): its status and its one line
    on stderr, nothing else printed there (no Ray or Serve line, traceback, stack dump or
    word of a failed call) but the lines read, nor on stdout, and no process of its Ray
    left."""
    read_before = list(service.stderr)
    code, err = service.stop(sig, group)
    line, status = {signal.SIGINT: ("pbg_ray: interrupted", 130),
                    signal.SIGTERM: ("pbg_ray: terminated", 143)}[sig]
    assert (code, err.splitlines()) == (status, read_before + [line]), err[-3000:]
    service.assert_nothing_left()


def assert_port_closed(port: int) -> None:
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def assert_answers_quietly(started: dict, port: int, lhs: str, relation: str,
                           answering: str) -> None:
    """The service listens where it said (`answering`: the process that holds its port),
    answers /health and a top_rhs, also from `curl -d` without a content type (a form's,
    read as JSON)."""
    assert started["url"] == f"http://127.0.0.1:{port}" and started["version"] == 1
    assert answering in listener(port)  # the router replica itself, or Serve's proxy
    query = {"queries": [{"lhs": lhs, "relation": relation}], "k": 3}
    with httpx.Client(base_url=started["url"], timeout=60) as client:
        assert client.get("/health").json() == {"status": "ok", "version": 1}
        top = client.post("/top_rhs", json=query)
        assert top.status_code == 200 and len(top.json()["answers"][0]["hits"]) == 3
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-s", f"{started['url']}/top_rhs", "-d",
                              json.dumps(query)], capture_output=True, text=True,
                             timeout=60).stdout
        assert json.loads(out) == top.json()


@pytest.mark.slow
def test_serve_behind_its_proxy_answers_quietly_until_ctrl_c_leaves_nothing(tmp_path):
    """serve.ingress=proxy: Serve's HTTP proxy holds the port (direct ingress, the default,
    is test_the_readmes_serve_example_...)."""
    data = tiny_graph(tmp_path)
    random_checkpoint(ConfigSchema.from_dict(data))
    module = pbg_module(tmp_path / "config.py", data)
    port = free_port()
    service = Service([module, f"serve.port={port}", "serve.index=exact",
                       "serve.ingress=proxy", "ray.num_cpus=1"], tmp_path)
    try:
        assert_answers_quietly(service.started(), port, "user-0-1", "likes", "ProxyActor")
        assert_stopped_cleanly(service, signal.SIGINT, group=True)
    finally:
        service.end()
    assert_port_closed(port)


@pytest.mark.slow
def test_the_best_version_is_served_and_each_new_best_is_one_line_until_sigterm(tmp_path):
    """Where validation kept a best version, the service serves it, as eval, predict and
    export read it, though training dropped its files from the checkpoint (best/ alone
    holds them): it says so and answers from it. A newer version that is not the best is
    not taken up; the next best is, with one line on stdout; a best that cannot be taken
    up (its model file missing) is one line on stderr, however often it is tried, and
    serving goes on; complete, it is taken up. The checkpoint's model is another than the
    config file says (a Ray Tune trial's sampled dimension): the service takes it from the
    checkpoint, with a line naming the key."""
    data = tiny_graph(tmp_path)
    config = ConfigSchema.from_dict(dict(data, dimension=6))  # the trained model's
    commit_random_version(config, 1, best=True)
    commit_random_version(config, 2)
    module = pbg_module(tmp_path / "config.py", data)  # dimension=4
    port = free_port()
    service = Service([module, f"serve.port={port}", "serve.index=exact",
                       "serve.reload_interval=0.2", "ray.num_cpus=1"], tmp_path)
    try:
        started = service.started()
        assert started["version"] == 1
        assert service.line("stderr") == (
            f"pbg_ray: warning: version 1 of '{config.checkpoint_path}/best' was trained with "
            "dimension=6 (this config: 4): the model's keys are taken from its config.json.")
        assert service.printed[0].startswith(
            f"serving version 1 of {config.checkpoint_path}, the best on validation (kept in "
            f"best/; serve.follow=newest serves the newest), at {started['url']} ")
        edge = {"lhs": "user-0-1", "relation": "likes", "rhs": "item-1-2"}
        with httpx.Client(base_url=started["url"], timeout=60) as client:
            scored = client.post("/score", json={"queries": [edge]})
            assert scored.status_code == 200, scored.text
            assert scored.json()["version"] == 1
            assert scored.json()["answers"][0]["score"] == pytest.approx(
                Predictor.load(config.checkpoint_path).score(tuple(edge.values())),
                rel=1e-5, abs=1e-5)
        commit_random_version(config, 3)
        commit_random_version(config, 4, best=True)
        assert service.line() == (f"serving checkpoint version 4 of {config.checkpoint_path}, "
                                  "the new best on validation (was version 1)")
        with httpx.Client(base_url=started["url"], timeout=60) as client:
            assert client.get("/health").json() == {"status": "ok", "version": 4}
        best = Path(config.checkpoint_path) / "best"
        for embeddings in best.glob("embeddings_*.v4.h5"):
            shutil.copy(embeddings, best / embeddings.name.replace(".v4.", ".v5."))
        CheckpointStorage(best).save_version(5)  # without model.v5.h5
        assert re.fullmatch(r"pbg_ray: warning: checkpoint version 5 could not be taken up, "
                            r"still serving version 4 \(tried again every 0.2 s\): .*model"
                            r".*v5\.h5.*", service.line("stderr")), service.stderr
        with httpx.Client(base_url=started["url"], timeout=60) as client:
            assert client.get("/health").json() == {"status": "ok", "version": 4}
        random_checkpoint(config, version=5, seed=5)  # version 5 complete in the checkpoint
        assert service.line() == (f"serving checkpoint version 5 of {config.checkpoint_path}, "
                                  "the new best on validation (was version 4)")
        assert_stopped_cleanly(service, signal.SIGTERM, group=False)
    finally:
        service.end()
    assert_port_closed(port)


def examples(text: str) -> List[str]:
    """The examples section of a command's --help, one command line per example (a line
    ending in a backslash goes on in the next)."""
    section = text.split("\nexamples:\n")[1].split("\n\n")[0]
    return [line.strip() for line in section.replace("\\\n", " ").splitlines()]


def run_curl(line: str, port: int) -> dict:
    """A curl command line as printed, to `port` instead of 8000, run in a shell; without
    curl, the request it makes, made with httpx."""
    line = line.replace("localhost:8000", f"localhost:{port}")
    if shutil.which("curl"):
        proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    args = shlex.split(line)
    url = next(a for a in args if a.startswith("localhost:"))
    headers = dict(h.split(": ", 1) for h in args[1:] if ": " in h)
    body = args[args.index("-d") + 1] if "-d" in args else args[args.index("--json") + 1]
    return httpx.post(f"http://{url}", content=body, headers=headers, timeout=60).json()


def demo_checkpoint(cache: Path, monkeypatch) -> None:
    """The demo graph, and a random checkpoint of it where the demo trains, under the cache
    directory (PBG_RAY_CACHE)."""
    with monkeypatch.context() as patch:
        patch.setenv("PBG_RAY_CACHE", str(cache))
        with initialize_config_module("pbg_ray.conf", version_base=None):
            random_checkpoint(to_config(compose("config")))


@pytest.mark.slow
def test_the_help_examples_work_as_printed(tmp_path, monkeypatch):
    """Each `python -m pbg_ray.serve` example of --help, on a free port instead of the one
    it names, serves: the demo's checkpoint, then a config file's with HNSW indexes over two
    shard groups; the curl example, as printed, gets the demo's answer."""
    text = subprocess.run([sys.executable, "-m", "pbg_ray.serve", "--help"],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    demo, own, curl = examples(text)
    demo_checkpoint(tmp_path / "cache", monkeypatch)
    pbg_module(tmp_path / "config.py", tiny_graph(tmp_path))
    random_checkpoint(load_pbg_config_file(tmp_path / "config.py"))
    for example in (demo, own):
        args = shlex.split(example, comments=True)
        assert args[:3] == ["python", "-m", "pbg_ray.serve"], example
        port = free_port()
        args = [a for a in args[3:] if not a.startswith("serve.port=")] + [f"serve.port={port}"]
        service = Service(args, tmp_path, PBG_RAY_CACHE=str(tmp_path / "cache"))
        try:
            started = service.started()
            if example == demo:
                assert service.line("stderr").startswith(
                    "pbg_ray: no config file given: pbg_ray.serve uses the built-in demo graph")
                answer = run_curl(curl, port)
                assert answer["errors"] == 0 and len(answer["answers"][0]["hits"]) == 5, answer
            else:
                metadata = httpx.get(f"{started['url']}/metadata", timeout=60).json()
                assert (metadata["index"], metadata["shard_groups"]) == ("hnsw", 2)
            # As `timeout` or a shell's job control stops it: SIGTERM to every process of
            # its group, the local Ray's and Serve's included.
            assert_stopped_cleanly(service, signal.SIGTERM, group=True)
        finally:
            service.end()


def own_graph(root: Path, monkeypatch) -> None:
    """The README's config file (examples/own_graph/config.py) in root, entities of its
    graph (alice and others) and a random checkpoint of them."""
    shutil.copy(REPO / "examples" / "own_graph" / "config.py", root / "config.py")
    names = {("user", 0): ["alice", "bob"], ("user", 1): ["carol"],
             ("item", 0): ["book_17", "book_3", "book_9"]}
    for (entity, part), found in names.items():
        save_entity_count(root / "data" / "entities", entity, part, len(found))
        save_entity_names(root / "data" / "entities", entity, part, found)
    monkeypatch.chdir(root)  # the config's paths are relative, as a user's are
    random_checkpoint(load_pbg_config_file("config.py").with_absolute_paths())


@pytest.mark.slow
def test_the_readmes_serve_example_works_as_printed_and_stops_cleanly(tmp_path, monkeypatch):
    """The README's serve command (on a free port instead of 8000) and its curl lines, as
    printed, on the README's own graph, answered in the shape the README shows: the router
    replica answers HTTP itself (direct ingress, the default), quietly, until Ctrl-C leaves
    nothing running."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Serve your embeddings\n")[1].split("\n## ")[0]
    serve_line = re.search(r"`(python -m pbg_ray\.serve [^`]*)`", section).group(1)
    top, score = re.search(r"```bash\n(curl .*?)\n```", section, flags=re.S).group(1).splitlines()
    own_graph(tmp_path, monkeypatch)
    args = shlex.split(serve_line)
    assert args[:3] == ["python", "-m", "pbg_ray.serve"]
    port = free_port()
    service = Service(args[3:] + [f"serve.port={port}"], tmp_path)
    try:
        started = service.started()
        answer = run_curl(top, port)
        assert answer.keys() == {"version", "answers", "errors"} and answer["errors"] == 0
        (hits,) = answer["answers"]
        assert [list(h) for h in hits["hits"]] == [["name", "score"]] * 3, answer
        assert {hit["name"] for hit in hits["hits"]} == {"book_17", "book_3", "book_9"}
        scored = run_curl(score, port)
        assert scored["answers"] == [{"score": pytest.approx(next(
            h["score"] for h in hits["hits"] if h["name"] == "book_17"), rel=1e-5)}], scored
        assert_answers_quietly(started, port, "alice", "likes", "ServeReplica:pbg_ray:Router")
        assert_stopped_cleanly(service, signal.SIGINT, group=True)
    finally:
        service.end()
    assert_port_closed(port)
