"""pbg_ray: PyTorch-BigGraph-style multi-relation graph embeddings, trained on Ray."""

from pbg_ray.errors import PbgRayError

__version__ = "0.1.0"
__all__ = ["PbgRayError", "__version__"]
