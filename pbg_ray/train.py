"""python -m pbg_ray.train [PBG_CONFIG.py] [key=value ...]

Trains embeddings bucket by bucket on Ray. With no arguments: the built-in
demo graph on a local Ray. `ray=cluster` (or ray.address=auto) joins the
cluster that `ray up cluster.yaml` started.

From Python the module is callable: `pbg_ray.train(config)` trains a ConfigSchema and
returns the engine's TrainResult.
"""

from __future__ import annotations

import json
import sys
import types

from pbg_ray.cli import hydra_entry, per_job_paths, setup_logging
from pbg_ray.config import ConfigSchema
from pbg_ray.engine.cluster import connect_ray
from pbg_ray.engine.trainer import Trainer, TrainResult
from pbg_ray.evaluation.training_stats import HELD_OUT, TRAIN, epoch_means


def run(config: ConfigSchema) -> None:
    setup_logging(config)
    config = per_job_paths(config)
    connect_ray(config.ray)  # once: the jobs of a multirun share it
    trainer = Trainer(config)
    result = trainer.run()
    summary = {"checkpoint_path": result.checkpoint_path, "version": result.version}
    if result.bucket_stats:  # lines of training_stats.json: per-edge means with their counts
        last_epoch = result.bucket_stats[-1]["epoch_idx"]
        for name, key in (("train", TRAIN), ("held_out", HELD_OUT)):
            means = epoch_means(result.bucket_stats, key).get(last_epoch)
            if means:
                summary[name] = means
    for path in config.eval_edge_paths:
        metrics = trainer.evaluate(path)
        summary.setdefault("eval", {})[path] = metrics
        print(f"eval {path}: " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    print(f"checkpoint: {result.checkpoint_path} (version {result.version})")
    print(json.dumps(summary), file=sys.stdout)


main = hydra_entry(run, __doc__,
                   ("", "entities.<name>.", "relations.<index>.", "ray.", "incremental."))


class _TrainModule(types.ModuleType):
    """`pbg_ray.train(config)`: the command's module doubles as the API's train()."""

    def __call__(self, config: ConfigSchema) -> TrainResult:
        connect_ray(config.ray)
        return Trainer(config).run()


sys.modules[__name__].__class__ = _TrainModule

if __name__ == "__main__":
    main()
