"""Helpers of the oracle tests, the only tests that import torchbiggraph 1.0.0 (the
original PyTorch-BigGraph): the same run as it sees it."""

from __future__ import annotations

import torch
from torchbiggraph.checkpoint_manager import CheckpointManager
from torchbiggraph.config import ConfigSchema as PbgConfigSchema
from torchbiggraph.model import make_model
from torchbiggraph.row_adagrad import RowAdagrad

from pbg_ray.config import ConfigSchema
from pbg_ray.io.entities import load_entity_counts

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
