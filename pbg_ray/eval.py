"""python -m pbg_ray.eval [PBG_CONFIG.py] [key=value ...]

Evaluates a checkpoint (the config's checkpoint_path; eval.version picks an older
version) on eval.edge_paths (default: eval_edge_paths, else edge_paths): PBG's sampled
metrics and filtered full ranking, overall and per relation, spread over buckets as Ray
tasks. Prints a table and one JSON line, and appends the JSON line to
<checkpoint_path>/eval_stats.json. Settings: pbg_ray.config.eval.EvalConfig.
"""

from __future__ import annotations

from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.distributed import evaluate_checkpoint, print_report

EXAMPLES = (
    "python -m pbg_ray.eval                                # the demo's checkpoint",
    "python -m pbg_ray.eval config.py 'eval.edge_paths=[data/test]'",
    "python -m pbg_ray.eval config.py eval.version=5 eval.filtered=false   # sampled metrics only",
)


def run(config: ConfigSchema) -> None:
    print_report(evaluate_checkpoint(config))


main = hydra_entry(run, __doc__, ("checkpoint_path", "eval.", "ray.address"), EXAMPLES)

if __name__ == "__main__":
    main()
