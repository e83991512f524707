"""Helpers shared by the tests (importable: `from tests.util import ...`): small PBG-style
configs, random graphs and checkpoints written in PBG's layout, and checkpoint checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from pbg_ray.checkpoints.storage import CheckpointStorage, row_adagrad_sums
from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import write_edges
from pbg_ray.io.entities import (
    load_entity_count, load_entity_counts, num_relation_ids, save_entity_count, save_entity_names,
    save_relation_names)
from pbg_ray.model.params import param_layout, params_from_checkpoint
from pbg_ray.types import Bucket, EdgeList


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


def assert_valid_checkpoint(config: ConfigSchema, version: int, clean: bool = True):
    """Version `version` is current and complete, and pbg_ray's own readers find every
    partition's embeddings (its count of rows, finite) with a RowAdagrad state that decodes,
    and every parameter of the config's model; `clean`: alone as well, no older version or
    temporary file beside it (a killed run leaves those for the next run to remove).
    The oracle tests add the original PBG's own load check (tests/oracle.py)."""
    storage = CheckpointStorage(config.checkpoint_path)
    assert storage.load_version() == version
    storage.check_version(version, config)
    if clean:
        assert not list(storage.path.glob(f"*.v{version - 1}.h5")), "old version not dropped"
        assert not list(storage.path.glob(".*tmp*")), "temporary files left behind"
    for entity, parts in load_entity_counts(config).items():
        for part, count in enumerate(parts):
            embs, optim_state = storage.load_entity_partition(version, entity, part)
            assert embs.shape == (count, config.dimension)
            assert np.isfinite(embs).all()
            sums = row_adagrad_sums(optim_state, count, f"{entity} partition {part}")
            assert sums is not None and np.isfinite(sums).all()
    arrays, optim_state = storage.load_model(version)
    num_relations = num_relation_ids(config)
    assert set(arrays) == {name for name, _ in param_layout(config, num_relations)}
    assert all(np.isfinite(value).all() for value in arrays.values())
    params_from_checkpoint(config, num_relations, arrays, optim_state, where=f"version {version}")


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


def as_torch(value: Any) -> Any:
    """`value` with its numpy arrays as torch tensors (what torch.load gives back)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy(order="C"))
    if isinstance(value, dict):
        return {k: as_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_torch(v) for v in value)
    return value
