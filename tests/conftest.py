"""Shared fixtures: small configs and graphs written in PBG's layout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
from torchbiggraph.checkpoint_manager import CheckpointManager
from torchbiggraph.config import ConfigSchema as PbgConfigSchema
from torchbiggraph.row_adagrad import RowAdagrad

from pbg_ray.config import ConfigSchema
from pbg_ray.io.checkpoint import CheckpointStorage
from pbg_ray.io.edges import EdgeList, write_edges
from pbg_ray.io.entities import (
    load_entity_count, load_entity_counts, num_relation_ids, save_entity_count,
    save_entity_names, save_relation_names)
from pbg_ray.model.params import param_layout
from pbg_ray.types import Bucket

# Fake credentials for the S3 server the storage tests start (moto), set before the shared
# Ray starts so that its workers inherit them, as a local Ray inherits a user's; no test
# can reach a real cloud account.
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_EC2_METADATA_DISABLED="true")


def config_dict(root: Path, **overrides: Any) -> Dict[str, Any]:
    """A PBG-style config dict for a two-type, three-relation graph under `root`."""
    data = dict(
        entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 2},
                  "tag": {"num_partitions": 1}},
        relations=[
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"},
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "diagonal"},
            {"name": "tagged", "lhs": "item", "rhs": "tag", "operator": "none"},
        ],
        dimension=8,
        entity_path=str(root / "entities"),
        edge_paths=[str(root / "edges")],
        checkpoint_path=str(root / "checkpoints"),
        batch_size=20,
        num_batch_negs=5,
        num_uniform_negs=5,
    )
    data.update(overrides)
    return data


@pytest.fixture
def make_config(tmp_path):
    def make(**overrides: Any) -> ConfigSchema:
        return ConfigSchema.from_dict(config_dict(tmp_path, **overrides))
    return make


def write_random_graph(config: ConfigSchema, num_edges: int = 200, seed: int = 0,
                       counts: Dict[str, int] = None) -> Dict[Bucket, EdgeList]:
    """Entity files and one bucket file per (lhs, rhs) partition pair; returns the edges."""
    rng = np.random.default_rng(seed)
    counts = counts or {"user": 30, "item": 20, "tag": 7}
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            n = counts[entity] + part
            save_entity_count(config.entity_path, entity, part, n)
            save_entity_names(config.entity_path, entity, part,
                              [f"{entity}-{part}-{i}" for i in range(n)])
    # torchbiggraph's export_to_tsv reads relation names in every mode.
    save_relation_names(config.entity_path, [r.name for r in config.relations])
    nparts = config.num_partitions()
    written = {}
    for lhs_p in range(nparts):
        for rhs_p in range(nparts):
            rel = rng.integers(len(config.relations), size=num_edges)
            sides = []
            for side, part in (("lhs", lhs_p), ("rhs", rhs_p)):
                types = [getattr(config.relations[r], side) for r in rel]
                sides.append(np.array([
                    rng.integers(counts[t] + (part if config.entities[t].num_partitions > 1 else 0))
                    for t in types], dtype=np.int64))
            edges = EdgeList(sides[0], sides[1], rel.astype(np.int64))
            write_edges(config.edge_paths[0], Bucket(lhs_p, rhs_p), edges)
            written[Bucket(lhs_p, rhs_p)] = edges
    return written


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (2 CPUs) shared by every test that needs it, shut down at the end."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


def assert_valid_checkpoint(config: ConfigSchema, version: int, clean: bool = True):
    """Version `version` is current, complete, finite, and torchbiggraph 1.0.0 loads it;
    `clean`: alone as well, no older version or temporary file beside it (a killed run
    leaves those for the next run to remove)."""
    storage = CheckpointStorage(config.checkpoint_path)
    assert storage.load_version() == version
    storage.check_version(version, config)
    if clean:
        assert not list(storage.path.glob(f"*.v{version - 1}.h5")), "old version not dropped"
        assert not list(storage.path.glob(".*tmp*")), "temporary files left behind"
    counts = load_entity_counts(config)
    manager = CheckpointManager(config.checkpoint_path)  # torchbiggraph reads it
    for entity, parts in counts.items():
        for part, count in enumerate(parts):
            embs, optim_state = manager.read(entity, part)
            assert embs.shape == (count, config.dimension)
            assert torch.isfinite(embs).all()
            RowAdagrad([torch.nn.Parameter(embs)], lr=config.lr).load_state_dict(optim_state)
    state_dict, _ = manager.read_model()
    assert "rhs_operators.0.translation" in state_dict


# Keys torchbiggraph 1.0.0 knows that the tests' configs set.
PBG_1_0_KEYS = {"entities", "relations", "dimension", "global_emb", "comparator", "loss_fn",
                "entity_path", "edge_paths", "checkpoint_path", "batch_size", "num_batch_negs",
                "num_uniform_negs", "dynamic_relations"}


def pbg_config(config: ConfigSchema) -> PbgConfigSchema:
    """The same run as torchbiggraph 1.0.0 sees it (the keys it knows)."""
    data = {k: v for k, v in config.to_dict().items() if k in PBG_1_0_KEYS}
    for econf in data["entities"].values():
        del econf["dimension"]
    return PbgConfigSchema.from_dict(data)


def random_checkpoint(config: ConfigSchema, version: int = 1, seed: int = 0,
                      integer: bool = False) -> None:
    """A complete checkpoint version of random embeddings and parameters for the graph
    in config.entity_path (integer-valued ones make exact score ties)."""
    rng = np.random.default_rng(seed)
    draw = (lambda shape: rng.integers(-1, 2, shape).astype(np.float32)) if integer else \
        (lambda shape: rng.normal(0, 1, shape).astype(np.float32))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    storage.save_config(config)
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            count = load_entity_count(config.entity_path, entity, part)
            storage.save_entity_partition(
                version, entity, part, draw((count, config.entity_dimension(entity))), None)
    layout = param_layout(config, num_relation_ids(config))
    storage.save_model(version, {k: (v if integer else v + draw(v.shape)) for k, v in layout}, None)
    storage.save_version(version)


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
