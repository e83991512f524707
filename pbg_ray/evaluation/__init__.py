"""Evaluation of a checkpoint: PBG's sampled metrics and filtered full ranking.

metrics.py   the tie rule, ranks -> metrics, sampled metrics per relation, the report
filtered.py  filtered full ranking of one bucket's edges against one candidate partition
scoring.py   query and candidate vectors of one side, for ranking against a whole type
predictor.py Predictor: scores, top-k heads and tails, nearest neighbours by name
distributed.py  the Ray driver that spreads ranking over buckets, and its eval task
"""
