"""Storage in PBG's I/O format v1: entity files, edge buckets, checkpoints."""
