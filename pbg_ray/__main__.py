"""python -m pbg_ray: the commands, one line each (each has its own --help)."""

from __future__ import annotations

import pbg_ray

# The commands in the order a run meets them: python -m pbg_ray.<name>.
COMMANDS = {
    "import_edges": "raw edge files (TSV, CSV, Parquet) into PBG's layout of entities and buckets",
    "train": "train embeddings bucket by bucket on Ray (no arguments: the built-in demo graph)",
    "eval": "sampled and filtered metrics of a checkpoint on held-out edges",
    "predict": "score edges, top-k heads or tails, nearest neighbours, by names",
    "export": "embeddings as TSV or Parquet, or a model bundle",
    "serve": "scores, top-k and neighbours over HTTP on Ray Serve",
    "tune": "a Ray Tune search over config keys",
    "plot": "a run's training stats as a PNG",
    "migrate": "a pre-1.0 PyTorch-BigGraph run into a v1 checkpoint",
}


def main() -> None:
    print(f"pbg_ray {pbg_ray.__version__}: multi-relation graph embeddings in the model of "
          "PyTorch-BigGraph, on Ray.\n\ncommands (python -m pbg_ray.<command> --help for "
          "its keys and examples):")
    width = max(map(len, COMMANDS))
    for name, what in COMMANDS.items():
        print(f"  {name:<{width}}  {what}")


if __name__ == "__main__":
    main()
