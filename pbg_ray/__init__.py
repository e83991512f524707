"""pbg_ray: PyTorch-BigGraph-style multi-relation graph embeddings, trained on Ray.

The Python API is pbg_ray.api (`from pbg_ray import api`; its docstring shows a run), the
commands are `python -m pbg_ray.<command>` (`python -m pbg_ray` lists them).

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

from pbg_ray.errors import PbgRayError
from pbg_ray.types import Bucket, EdgeList, Side

__version__ = "0.1.0"

__all__ = ["Bucket", "EdgeList", "PbgRayError", "Side", "__version__"]
