"""python -m pbg_ray.train [PBG_CONFIG.py] [key=value ...]

Trains embeddings bucket by bucket on Ray. With no arguments: the built-in demo graph on a
local Ray. `ray=cluster` (or ray.address=auto) joins the cluster that `ray up cluster.yaml`
started. A checkpoint version is written after every epoch (every edge chunk), and the same
command run again resumes from the newest complete one; Ctrl-C stops a run at once. With
validation.edge_paths, the validation edges are ranked every validation.every epochs, the
best version is kept in <checkpoint_path>/best/ (what eval, predict and export read by
default) and validation.patience stops a run that no longer improves.

From Python: `api.train(config)` (pbg_ray.api) trains a ConfigSchema.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from pbg_ray.cli import hydra_entry, per_job_paths, stop_note
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.metrics import SampledNegatives
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.training.stats import HELD_OUT, TRAIN, epoch_means
from pbg_ray.training.trainer import Trainer

EXAMPLES = (
    "python -m pbg_ray.train                                   # the built-in demo graph",
    "python -m pbg_ray.train config.py lr=0.05 num_epochs=20   # a PBG config file, two keys set",
    "python -m pbg_ray.train config.py -m lr=0.01,0.1          # a sweep: a run per value",
    "python -m pbg_ray.train config.py ray=cluster ray.num_trainers=8   # on a Ray cluster",
)
KEYS = ("dimension", "num_epochs", "lr", "batch_size", "num_batch_negs", "num_uniform_negs",
        "loss_fn", "comparator", "relations.<index>.operator", "entities.<name>.num_partitions",
        "checkpoint_path", "init_path", "eval_edge_paths", "validation.edge_paths",
        "validation.patience", "ray.address", "ray.num_trainers", "ray.placement")


def run(config: ConfigSchema) -> None:
    config = per_job_paths(config)
    trainer = Trainer(config)  # before Ray starts: bad input stops the command at once
    connect_ray(config.ray)  # once: the jobs of a multirun share it
    if trainer.version >= trainer.num_passes:
        print(f"{config.checkpoint_path} holds all {trainer.num_passes} versions: nothing to "
              "train", file=sys.stderr)
    elif trainer.version:
        print(f"resuming from version {trainer.version} of {trainer.num_passes} in "
              f"{config.checkpoint_path}", file=sys.stderr)

    def complete() -> str:
        done = f"version {trainer.version}" if trainer.version else "no version yet"
        return f"{done} of {config.checkpoint_path} is complete"

    with stop_note(complete):
        result = trainer.run()
    summary = {"checkpoint_path": result.checkpoint_path, "version": result.version}
    if result.bucket_stats:  # lines of training_stats.json: per-edge means with their counts
        last_epoch = result.bucket_stats[-1]["epoch_idx"]
        for name, key in (("train", TRAIN), ("held_out", HELD_OUT)):
            means = epoch_means(result.bucket_stats, key).get(last_epoch)
            if means:
                summary[name] = means
    negatives = SampledNegatives.of_held_out(config).describe()
    for path in config.eval_edge_paths:
        metrics = trainer.evaluate(path)
        summary.setdefault("eval", {})[path] = metrics
        print(f"eval {path} ({negatives}): "
              + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    print(f"checkpoint: {result.checkpoint_path} (version {result.version})")
    if result.best is not None:
        summary["best"] = dataclasses.asdict(result.best)
        print(f"best on validation: {result.best.describe()}, kept in "
              f"{result.checkpoint_path}/best (what eval, predict and export read by default)")
    print(json.dumps(summary), file=sys.stdout)


main = hydra_entry(run, __doc__, KEYS, EXAMPLES)


if __name__ == "__main__":
    main()
