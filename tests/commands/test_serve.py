"""`python -m pbg_ray.serve` as a user runs it: a PBG config file and overrides in, the
service up on the port asked for (answered by the router replica itself, or by Serve's
proxy), Ctrl-C stopping it with one line; bad settings as one line."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import psutil
import pytest

from pbg_ray.config import ConfigSchema
from tests.commands.test_cli import assert_one_error_line, command, pbg_module, run, tiny_graph
from tests.util import random_checkpoint


def test_a_bad_serve_setting_is_one_line(tmp_path):
    module = pbg_module(tmp_path / "config.py", tiny_graph(tmp_path))
    code, _, err = run("serve", [module, "serve.index=hnws"], tmp_path)
    assert code == 2
    assert_one_error_line(err, "serve.index", "did you mean 'hnsw'?")


def listener(port: int) -> str:
    """The process title of what listens on a loopback TCP port."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return " ".join(psutil.Process(conn.pid).cmdline())
    return ""


@pytest.mark.slow
@pytest.mark.parametrize("ingress, answering", [("direct", "ServeReplica:pbg_ray:Router"),
                                                ("proxy", "ProxyActor")])
def test_serve_answers_over_http_until_ctrl_c(tmp_path, ingress, answering):
    data = tiny_graph(tmp_path)
    random_checkpoint(ConfigSchema.from_dict(data))
    module = pbg_module(tmp_path / "config.py", data)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="pbg-sv-", dir="/tmp"))
    proc = command("serve", [module, f"serve.port={port}", "serve.index=exact",
                             f"serve.ingress={ingress}", "ray.num_cpus=1"], tmp_path, env=env,
                   start_new_session=True)
    try:
        first = proc.stdout.readline()  # blocks until the service is up (or the command ended)
        assert first.startswith("serving version 1 of "), proc.communicate(timeout=60)[1][-3000:]
        started = json.loads(proc.stdout.readline())
        assert started["url"] == f"http://127.0.0.1:{port}" and started["version"] == 1
        assert answering in listener(port)  # the router replica itself, or Serve's proxy
        with httpx.Client(base_url=started["url"], timeout=60) as client:
            assert client.get("/health").json() == {"status": "ok", "version": 1}
            top = client.post("/top_rhs", json={"queries": [{"lhs": "user-0-1",
                                                             "relation": "likes"}], "k": 3})
            assert top.status_code == 200 and len(top.json()["results"][0]) == 3
        if shutil.which("curl"):  # the README's example, as a user sends it
            body = json.dumps({"queries": [{"lhs": "user-0-1", "relation": "likes"}], "k": 3})
            out = subprocess.run(["curl", "-s", "--json", body, f"{started['url']}/top_rhs"],
                                 capture_output=True, text=True, timeout=60).stdout
            assert json.loads(out)["results"] == top.json()["results"]
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "pbg_ray: interrupted", err[-3000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.5)
        except OSError:
            break  # nothing listens there any more
    else:
        pytest.fail("the port is still served after Ctrl-C")
