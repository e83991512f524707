"""Checkpoints in PBG's v1 layout and what is made from them.

manager.py  CheckpointManager: the one way to a checkpoint directory (resume, lock, commit a
            version, preserve, drop, locate, stats)
storage.py  CheckpointStorage: the files of a checkpoint directory (local or URI), written
            atomically, version by version
legacy.py   runs of PyTorch-BigGraph before 1.0, read and migrated to v1
bundle.py   model bundles: tagged checkpoint versions and reduced-precision variants in a zip
export.py   a checkpoint's embeddings as TSV, Parquet or a bundle (python -m pbg_ray.export)
"""
