"""pbg_ray: PyTorch-BigGraph-style multi-relation graph embeddings, trained on Ray.

The Python API (each name is imported on first use, so `import pbg_ray` stays light):

    import pbg_ray
    config = pbg_ray.load_pbg_config_file("config.py")   # or pbg_ray.ConfigSchema.from_dict
    pbg_ray.import_graph(config)          # raw edge files -> entity_path and edge_paths
    pbg_ray.train(config)                 # bucket by bucket on Ray; a local Ray if none
    pbg_ray.evaluate(config)              # sampled and filtered metrics of a checkpoint
    pbg_ray.export_checkpoint(config)     # TSV, Parquet or a model bundle
    model = pbg_ray.Predictor.load(config.checkpoint_path)
    model.top_rhs("alice", "follows", k=10)

The package, room by room, each by its domain (each imports only the rooms below it;
tests/test_layers.py enforces it, docs/architecture.md draws it):

    commands      train, import_edges, eval, predict, export, migrate, plot, tune, serve
                  (python -m) and cli (their shared entry)
    tuning/ training/ serving/ evaluation/ importer/ incremental/
                  each domain whole, its Ray part included
    runtime/      the Ray plumbing the domains share
    checkpoints/  the checkpoint directory and what is made of it
    model/ io/    one bucket's math; file formats and storage
    config/       every config section's schema
    types, errors
"""

import importlib
from typing import Any

from pbg_ray.errors import PbgRayError
from pbg_ray.types import Bucket, EdgeList, Side

__version__ = "0.1.0"

# name -> (module, attribute), imported when first asked for.
_LAZY = {
    "ConfigSchema": ("pbg_ray.config", "ConfigSchema"),
    "load_pbg_config_file": ("pbg_ray.config", "load_pbg_config_file"),
    "import_graph": ("pbg_ray.importer.ray_data", "import_graph"),
    # The command module itself: calling it trains (pbg_ray/train.py).
    "train": ("pbg_ray", "train"),
    "evaluate": ("pbg_ray.evaluation.distributed", "evaluate_checkpoint"),
    "export_checkpoint": ("pbg_ray.checkpoints.exporter", "export_checkpoint"),
    "migrate_run": ("pbg_ray.checkpoints.legacy", "migrate_run"),
    "Predictor": ("pbg_ray.evaluation.predictor", "Predictor"),
}

__all__ = ["Bucket", "EdgeList", "PbgRayError", "Side", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pbg_ray' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    if module == "pbg_ray":  # a submodule
        return importlib.import_module(f"pbg_ray.{attribute}")
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
