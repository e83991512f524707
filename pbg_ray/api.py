"""The Python API, what the README's "Python API" shows: a graph imported, trained,
evaluated, exported and queried from Python, with the same config as the commands.

    from pbg_ray import api

    config = api.load_pbg_config_file("config.py")   # or api.ConfigSchema.from_dict({...})
    api.import_graph(config)         # raw edge files (config.importer.inputs) -> PBG layout
    api.train(config)                # bucket by bucket on Ray; a local one unless ray.address
    api.evaluate(config)             # sampled and filtered metrics of a checkpoint
    api.export_checkpoint(config)    # TSV, Parquet or a model bundle
    model = api.Predictor.load("model")
    model.top_rhs("alice", "likes", k=10)  # [Hit(name, score), ...], best first

Every function checks its config first (a config changed after it was built included) and
raises PbgRayError, naming the key and the fix, before anything starts.
"""

from __future__ import annotations

from pbg_ray.checkpoints.exporter import export_checkpoint
from pbg_ray.checkpoints.legacy import migrate_run
from pbg_ray.config import ConfigSchema, load_pbg_config_file
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import evaluate_checkpoint as evaluate
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.evaluation.questions import Hit, answer_json
from pbg_ray.importer.ray_engine import import_graph
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.training.trainer import Trainer, TrainResult

__all__ = ["ConfigSchema", "Hit", "PbgRayError", "Predictor", "TrainResult", "answer_json",
           "evaluate", "export_checkpoint", "import_graph", "load_pbg_config_file", "migrate_run",
           "train"]


def train(config: ConfigSchema) -> TrainResult:
    """Train config's graph from its newest checkpoint version (a local Ray unless
    ray.address names a cluster); the result names the version written last."""
    trainer = Trainer(config)  # checks the config before Ray starts
    connect_ray(trainer.config.ray)
    return trainer.run()
