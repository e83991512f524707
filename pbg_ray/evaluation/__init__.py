"""Evaluation of a checkpoint: PBG's sampled metrics and filtered full ranking.

metrics.py   the tie rule, ranks -> metrics, sampled metrics per relation, the report
filtered.py  filtered full ranking of one bucket's edges against one candidate partition
scoring.py   query and candidate vectors of one side, for ranking against a whole type
predictor.py Predictor: scores, top-k heads and tails, nearest neighbours by name
training_stats.py  training_stats.json lines turned into figures per bucket and epoch
serving.py   the HTTP service's math: faiss indexes of candidate sets, a shard's top-k,
             answers by names (pbg_ray.serving.service puts it on Ray Serve)
The Ray driver that spreads this over buckets is pbg_ray.evaluation.distributed.
"""
