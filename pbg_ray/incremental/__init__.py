"""Incremental training: a grown graph trained from a previous checkpoint.

growth.py    what init_path already trained (known rows and parameters), grown partitions
             with their new rows initialised, and the fast update's edge filter
The importer's half (importer.previous_entity_path) lives in pbg_ray.importer.dictionaries.
"""
