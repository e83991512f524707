"""python -m pbg_ray.tune [PBG_CONFIG.py] [key=value ...]

A Ray Tune search over config keys: the `tune` option (tune=asha, the default, for the demo
and a PBG config file alike: conf/tune/asha.yaml) declares the search space (lr loguniform
in [0.01, 0.5], dimension in {50, 100, 200}, margin uniform in [0.05, 0.5] where
loss_fn=ranking: a key that changes nothing for the config is left out, with a line saying
why), the metric (reported after every epoch: with validation.edge_paths the best validation
so far, else PBG's sampled MRR on eval_edge_paths), the number
of trials and the scheduler (ASHA stops poor trials early). The first trial trains the
config's own values of the sampled keys (tune.config_first). Each trial trains the sampled
config under <checkpoint_path>-<trial id> and prints a line per epoch. The best trial, by
the metric of each trial's last epoch (the one its checkpoint holds), is printed at the
end with its config and checkpoint, then one JSON line.
"""

from __future__ import annotations

import json

from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.tuning.tuner import run_tune

EXAMPLES = (
    "python -m pbg_ray.tune config.py 'validation.edge_paths=[data/valid]'   # the default search",
    "python -m pbg_ray.tune config.py +training=quality tune=quality \\\n"
    "      'validation.edge_paths=[data/valid]'          # around the quality recipe",
    "python -m pbg_ray.tune config.py 'eval_edge_paths=[data/valid]' tune.num_samples=16 \\\n"
    "      '+tune.search_space.batch_size={choice:[500,1000]}' '~tune.search_space.margin'",
    "python -m pbg_ray.tune --config-dir my_conf tune=my_space    # my_conf/tune/my_space.yaml",
)


def run(config: ConfigSchema) -> None:
    connect_ray(config.ray)
    best = run_tune(config)
    print(f"best trial {best['trial_id']} after epoch {best['metrics'].get('epoch')}: "
          + "  ".join(f"{k}={v:.4g}" for k, v in best["metrics"].items()
                      if k not in ("epoch", "version", "best_version")))
    print("best config: " + " ".join(f"{k}={v}" for k, v in best["config"].items()))
    best_version = best["metrics"].get("best_version")
    kept = (f"; its best on validation, version {best_version}, is in "
            f"{best['checkpoint_path']}/best" if best_version else "")
    print(f"best checkpoint: {best['checkpoint_path']} (version {best['version']}{kept})")
    print(json.dumps(best))


KEYS = ("tune.search_space", "tune.metric", "tune.mode", "tune.num_samples", "tune.max_concurrent",
        "tune.scheduler", "tune.grace_period", "tune.storage_path", "num_epochs", "eval_edge_paths",
        "checkpoint_path", "ray.address", "ray.num_trainers")
main = hydra_entry(run, __doc__, KEYS, EXAMPLES)

if __name__ == "__main__":
    main()
