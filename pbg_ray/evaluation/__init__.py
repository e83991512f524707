"""Evaluation of a checkpoint: PBG's sampled metrics and filtered full ranking.

settings.py  the `eval` config section (no imports of the rest of pbg_ray: config.py uses it)
metrics.py   the tie rule, ranks -> metrics, sampled metrics per relation, the report
filtered.py  filtered full ranking of one bucket's edges against one candidate partition
The Ray driver that spreads this over buckets is pbg_ray.engine.evaluator.
"""
