"""Filtered MRR of pbg_ray against torchbiggraph 1.0.0 on generated knowledge graphs, over seeds.

For each partition count (1 and 4 by default) and each seed: a graph generated with that
seed (train_bench's planted communities, of 20 nodes so that a full ranking can find
the true target, and relations that each lead from a community to another), trained by
both programs with the same config (train_bench's setting A, 2 Hogwild workers, PBG's
hogwild_delay; pbg_ray with `seed` set, torchbiggraph has no seed), both checkpoints
ranked by the same filtered evaluator (every entity a candidate, train and test edges
filtered) on the same held-out 1% of the edges. With --without-warmup pbg_ray also
trains with hogwild_delay=0, to show what its warm-up does. Prints a line per run, per
partition count the mean difference, and ends with one JSON line.

    python benchmarks/quality_bench.py                 # 100k entities, 1M edges, 3 seeds
    python benchmarks/quality_bench.py --entities 20000 --edges 200000 --seeds 1  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
# The script's folder is on sys.path: its sibling's pieces are shared, not copied.
from train_bench import (
    RUN_PBG, RUN_PBG_RAY, as_pbg_ray, bench_env, config_dict, generate, local_ray, train)


def filtered_mrr(config: dict, test_path: str) -> float:
    """Filtered MRR of the newest version of config's checkpoint on test_path's edges."""
    from pbg_ray.config import ConfigSchema
    from pbg_ray.evaluation.distributed import evaluate_checkpoint
    from pbg_ray.evaluation.metrics import ALL

    config = ConfigSchema.from_dict(dict(
        config, eval={"edge_paths": [test_path], "sampled": False, "per_relation": False}))
    with local_ray():
        return evaluate_checkpoint(config)["metrics"][ALL]["filtered"]["mrr"]


def train_and_rank(script: str, config: dict, env: dict, test_path: str) -> dict:
    """Train `config` from scratch in a new process: its training seconds and filtered MRR."""
    out, _ = train(script, config, env, memory=False)
    seconds = float(re.search(r"TRAIN_SECONDS (\S+)", out).group(1))
    return {"seconds": seconds, "mrr": filtered_mrr(config, test_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--relations", type=int, default=3)
    parser.add_argument("--community", type=int, default=20, help="nodes per community")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--without-warmup", action="store_true",
                        help="also train pbg_ray with hogwild_delay=0")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="quality_bench_"))
    env = bench_env()
    print(f"graph: {args.entities:,} entities in communities of {args.community}, "
          f"{args.edges:,} edges, {args.relations} relations, {args.epochs} epoch(s), seeds "
          f"0-{args.seeds - 1}; d=100, complex_diagonal/dot/softmax, 50 batch + 100 uniform "
          f"negatives, 2 Hogwild workers; machine: {os.cpu_count()} CPUs", flush=True)
    programs = {"pbg_ray": RUN_PBG_RAY, "torchbiggraph": RUN_PBG}
    if args.without_warmup:
        programs["pbg_ray_no_warmup"] = RUN_PBG_RAY
    figures: dict = {}
    for nparts in args.partitions:
        runs: dict = {name: [] for name in programs}
        for seed in range(args.seeds):
            root = work / f"graph_{nparts}p_seed{seed}"
            if not (root / "entities").is_dir():
                generate(root, args.entities, args.edges, nparts, seed, args.relations,
                         args.community)
            for name, script in programs.items():
                config = config_dict(root, nparts, work / f"ckpt_{name}", args.epochs,
                                     args.relations)
                if name != "torchbiggraph":
                    config = dict(as_pbg_ray(config), seed=seed)
                if name == "pbg_ray_no_warmup":
                    config["hogwild_delay"] = 0
                run = train_and_rank(script, config, env, str(root / "test"))
                runs[name].append(run)
                print(f"[{nparts}p seed {seed}] {name}: filtered MRR {run['mrr']:.4f}, "
                      f"trained in {run['seconds']:.1f} s", flush=True)
        mean = {name: float(np.mean([r["mrr"] for r in rs])) for name, rs in runs.items()}
        diffs = {name: mean[name] - mean["torchbiggraph"]
                 for name in runs if name != "torchbiggraph"}
        figures[f"{nparts}p"] = {"runs": runs, "mean_mrr": mean, "mean_difference": diffs}
        print(f"[{nparts}p] mean filtered MRR: "
              + ", ".join(f"{n} {m:.4f}" for n, m in mean.items())
              + "; mean difference to torchbiggraph: "
              + ", ".join(f"{n} {d:+.4f}" for n, d in diffs.items()), flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
