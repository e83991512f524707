"""Helpers of the oracle tests, the only tests that import torchbiggraph 1.0.0 (the
original PyTorch-BigGraph): the same run as it sees it."""

from __future__ import annotations

import io
import typing
import warnings

import numpy as np
import torch
import torchbiggraph.schema
from torchbiggraph.checkpoint_manager import CheckpointManager
from torchbiggraph.config import ConfigSchema as PbgConfigSchema
from torchbiggraph.converters.export_to_tsv import make_tsv
from torchbiggraph.graph_storages import FileEdgeStorage, FileEntityStorage
from torchbiggraph.model import make_model
from torchbiggraph.row_adagrad import RowAdagrad

from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import load_entity_counts, load_entity_names
from pbg_ray.types import Bucket

# Keys torchbiggraph 1.0.0 knows that the tests' configs set.
PBG_1_0_KEYS = {"entities", "relations", "dimension", "global_emb", "comparator", "loss_fn",
                "entity_path", "edge_paths", "checkpoint_path", "batch_size", "num_batch_negs",
                "num_uniform_negs", "dynamic_relations", "bias"}


def pbg_config(config: ConfigSchema, **overrides) -> PbgConfigSchema:
    """The same run as torchbiggraph 1.0.0 sees it (the keys it knows), with `overrides`."""
    data = {k: v for k, v in config.to_dict().items() if k in PBG_1_0_KEYS}
    data.update(overrides)
    for econf in data["entities"].values():
        del econf["dimension"]
    return PbgConfigSchema.from_dict(data)


def assert_torchbiggraph_loads(config: ConfigSchema, version: int):
    """torchbiggraph 1.0.0 reads version `version` of config.checkpoint_path as its own:
    every partition's embeddings with a RowAdagrad state its optimizer takes, and a model
    state dict its make_model loads."""
    manager = CheckpointManager(config.checkpoint_path)
    assert manager.checkpoint_version == version
    for entity, parts in load_entity_counts(config).items():
        for part, count in enumerate(parts):
            embs, optim_state = manager.read(entity, part)
            assert embs.shape == (count, config.dimension)
            assert torch.isfinite(embs).all()
            RowAdagrad([torch.nn.Parameter(embs)], lr=config.lr).load_state_dict(optim_state)
    state_dict, _ = manager.read_model()
    model = make_model(pbg_config(config))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith(("lhs_embs", "rhs_embs")) for k in missing), missing


def assert_torchbiggraph_reads_import(config: ConfigSchema):
    """torchbiggraph 1.0.0's file storages read the import at config's entity and first edge
    path as pbg_ray does: every partition's count and names, every bucket's edges."""
    entity_storage = FileEntityStorage(config.entity_path)
    for entity, parts in load_entity_counts(config).items():
        for part, count in enumerate(parts):
            assert entity_storage.load_count(entity, part) == count
            assert entity_storage.load_names(entity, part) == load_entity_names(
                config.entity_path, entity, part)
    edge_storage = FileEdgeStorage(config.edge_paths[0])
    nparts = max(e.num_partitions for e in config.entities.values())
    for lhs_p in range(nparts):
        for rhs_p in range(nparts):
            theirs = edge_storage.load_edges(lhs_p, rhs_p)
            ours = read_edges(config.edge_paths[0], Bucket(lhs_p, rhs_p))
            np.testing.assert_array_equal(theirs.lhs.to_tensor().numpy(), ours.lhs)
            np.testing.assert_array_equal(theirs.rhs.to_tensor().numpy(), ours.rhs)
            np.testing.assert_array_equal(theirs.rel.numpy(), ours.rel)


def torchbiggraph_tsv(config: ConfigSchema) -> list[str]:
    """What torchbiggraph_export_to_tsv writes for config's checkpoint: entities, relations."""
    entities, relations = io.StringIO(), io.StringIO()
    make_tsv(pbg_config(config), entities, relations)
    return [entities.getvalue(), relations.getvalue()]


def unpack_optional(type_):
    """torchbiggraph 1.0.0 recognizes Optional[X] by identity, which fails on Python 3.9+."""
    args = typing.get_args(type_)
    if typing.get_origin(type_) is typing.Union and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    raise TypeError("Not an optional type")


def torchbiggraph_eval_metrics(config: ConfigSchema, monkeypatch) -> dict:
    """torchbiggraph_eval's metrics of config's checkpoint on its eval edges (one worker)."""
    monkeypatch.setattr(torchbiggraph.schema, "unpack_optional", unpack_optional)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchbiggraph.eval import do_eval_and_report_stats
    pbg = pbg_config(config, edge_paths=config.eval_edge_paths, workers=1)
    *_, (_, _, stats) = do_eval_and_report_stats(pbg)
    return stats.metrics
