"""Checkpoints in PBG's v1 layout and what is made from them.

manager.py        CheckpointManager: the one way to a checkpoint directory (resume, lock,
                  commit a version, preserve, drop, locate, stats)
directory.py      CheckpointStorage: the files of a checkpoint directory (local or URI),
                  written atomically, version by version
position.py       Position: where a pass sits in a run (epoch, edge path, edge chunk)
sources.py        typed partition sources, read by the task that needs them
torch_format.py   torch.save's file format, without torch
legacy.py         runs of PyTorch-BigGraph before 1.0, read and migrated to v1
bundle.py         model bundles: tagged checkpoint versions and reduced-precision variants
exporter.py       a checkpoint's embeddings as TSV, Parquet or a bundle (python -m pbg_ray.export)
per_partition.py  per-partition jobs of the commands that read a whole table
"""
