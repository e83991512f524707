"""python -m pbg_ray.tune [PBG_CONFIG.py] [key=value ...]

A Ray Tune search over config keys: the `tune` section (conf/tune/asha.yaml by
default) declares the search space, the metric (held-out MRR, reported after every
epoch) and the scheduler (ASHA stops poor trials early). Each trial trains the sampled
config with the engine under <checkpoint_path>/<trial id>; the best trial's config and
checkpoint path are printed at the end, then one JSON line. Settings:
pbg_ray.config.tune.TuneConfig.
"""

from __future__ import annotations

import json

from pbg_ray.cli import hydra_entry, setup_logging
from pbg_ray.config import ConfigSchema
from pbg_ray.engine.cluster import connect_ray
from pbg_ray.engine.tuner import run_tune


def run(config: ConfigSchema) -> None:
    setup_logging(config)
    connect_ray(config.ray)
    best = run_tune(config)
    print(f"best trial {best['trial_id']} after epoch {best['metrics'].get('epoch')}: "
          + "  ".join(f"{k}={v:.4g}" for k, v in best["metrics"].items()
                      if k not in ("epoch", "version")))
    print("best config: " + " ".join(f"{k}={v}" for k, v in best["config"].items()))
    print(f"best checkpoint: {best['checkpoint_path']} (version {best['version']})")
    print(json.dumps(best))


main = hydra_entry(run, __doc__, ("tune.", "ray."))

if __name__ == "__main__":
    main()
