"""Fixtures shared by the tests (helpers live in tests/util.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import psutil
import pytest

import pbg_ray.cli  # noqa: F401  conf/'s ${demo_graph:} resolvers, registered as every command has them
from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.connect import LOCAL_SYSTEM_CONFIG, stop_unused_processes
from tests.util import V1_ROOT, config_dict, write_random_graph

# Fake credentials for the S3 server the storage tests start (moto), set before the shared
# Ray starts so that its workers inherit them, as a local Ray inherits a user's; no test
# can reach a real cloud account.
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_EC2_METADATA_DISABLED="true")


def pytest_configure(config):
    """pytest-xdist's loadfile hands files out in the order of collection (as
    pytest_collection_modifyitems leaves it) instead of by their numbers of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """Every test that reaches the S3 test server is marked s3, by its fixtures. The files
    holding slow tests come first (in their order), so that the workers of `-n 2 --dist
    loadfile` take the long files first and end together."""
    for item in items:
        if "s3_endpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture
def memory_cgroup():
    """A new cgroup v1 memory cgroup (its processes killed and the cgroup removed
    afterwards): its directory; skipped, saying why, where this machine lets no test make
    one (tests.util.run_in runs a command inside it)."""
    if os.geteuid() != 0 or not os.access(V1_ROOT, os.W_OK):
        pytest.skip("making a memory cgroup needs root and cgroup v1's memory hierarchy "
                    f"writable at {V1_ROOT}")
    group = V1_ROOT / f"pbg_ray_test_{uuid.uuid4().hex[:8]}"
    group.mkdir()
    yield group
    for _ in range(50):
        pids = (group / "cgroup.procs").read_text().split()
        if not pids:
            break
        for pid in pids:
            try:
                psutil.Process(int(pid)).kill()
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    group.rmdir()


@pytest.fixture
def make_config(tmp_path):
    def make(**overrides: Any) -> ConfigSchema:
        return ConfigSchema.from_dict(config_dict(tmp_path, **overrides))
    return make


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (2 CPUs) shared by every test that needs it, shut down at the end; a new
    one, never a cluster another run started on this machine (`ray start`, test_multinode).
    Its processes are those of the local Ray a command starts (no plain workers ahead of
    need, no autoscaler monitor nor dashboard API server), less the log monitor: its workers' output reaches no
    driver."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG)
    stop_unused_processes()
    ray._private.worker._global_node.kill_log_monitor(check_alive=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def trained_config(tmp_path_factory, ray_session) -> ConfigSchema:
    """The config of a small run the engine trained once for the session (2 epochs, held-out
    stats), for the tests that read a real checkpoint and its training_stats.json (they add
    files beside them at most, never a version)."""
    from pbg_ray.training.trainer import Trainer

    root = tmp_path_factory.mktemp("trained")
    config = ConfigSchema.from_dict(config_dict(root, num_epochs=2, eval_fraction=0.2,
                                                eval_num_batch_negs=10, eval_num_uniform_negs=10))
    write_random_graph(config, num_edges=200)
    Trainer(config).run()
    return config


@pytest.fixture(scope="session")
def s3_endpoint():
    """host:port of a real S3-compatible server (moto in server mode) for the session."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto server did not start on port {port}")
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture
def s3_root(s3_endpoint) -> str:
    """The URI of an empty bucket of its own on the test S3 server, with the endpoint
    settings in its query as a user would give them."""
    import pyarrow.fs as pafs

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http",
                      allow_bucket_creation=True).create_dir(bucket)
    return f"s3://{bucket}?endpoint_override={s3_endpoint}&scheme=http"
