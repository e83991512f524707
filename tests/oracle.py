"""Helpers of the oracle tests, the only tests that import torchbiggraph 1.0.0 (the
original PyTorch-BigGraph): the same run as it sees it."""

from __future__ import annotations

from torchbiggraph.config import ConfigSchema as PbgConfigSchema

from pbg_ray.config import ConfigSchema

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
