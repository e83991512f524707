"""pbg_ray's engine with train tasks on a GPU against the same runs on CPU threads (issue 47).

train_bench's graph and config (d=100, complex_diagonal, dot, softmax, 50 batch + 100
uniform negatives, batches of 1000 edges), trained per setting once with
`ray.gpus_per_trainer=1` and once on --cpu-threads CPU threads (one train task of that many
Hogwild threads), same seed: 1 partition in memory placement and 8 partitions in disk
placement, where every bucket copies its partitions to the GPU and back. Per run it prints
edges/s, the share of bucket time outside the kernel, the seconds of host-to-device copies
(to the GPU and back, within the kernel's time) and their share of it, and the sampled MRR
of the checkpoint on the held-out edges (the same evaluator on CPU for both). Ends with one
JSON line. The kernel alone is kernel_bench.py --device cuda.

    python benchmarks/gpu_bench.py                 # 1M entities, 10M edges
    python benchmarks/gpu_bench.py --scale 0.1     # a quick run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

from train_bench import (RUN_PBG_RAY, as_pbg_ray, bench_env, config_dict, generate, mrr,
                         outside_kernel_share, train)

SETTINGS = {"1p_memory": (1, "memory"), "8p_disk": (8, "disk")}


def train_once(config: dict, env: dict) -> dict:
    """Seconds, edges/s basis and bucket timing of one run of `config` in a new process."""
    out, _ = train(RUN_PBG_RAY, config, env, memory=False)
    buckets = json.loads(re.search(r"TIMING (.*)", out).group(1))
    kernel_s = sum(t["kernel_s"] for t in buckets)
    copy_s = sum(t["device_copy_s"] for t in buckets)
    return {"seconds": float(re.search(r"TRAIN_SECONDS (\S+)", out).group(1)),
            "outside_kernel_share": outside_kernel_share(buckets),
            "device_copy_s": copy_s, "device_copy_share_of_kernel": copy_s / kernel_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of 1M entities / 10M edges")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--cpu-threads", type=int, default=2,
                        help="Hogwild threads of the CPU run beside each GPU run")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench: torch sees no CUDA device; run it on a machine with a GPU")
    num_entities, num_edges = int(1_000_000 * args.scale), int(10_000_000 * args.scale)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_bench_"))
    env = bench_env()
    print(f"graph: {num_entities:,} entities, {num_edges:,} edges, d=100, "
          f"complex_diagonal/dot/softmax, 50 batch + 100 uniform negatives, {args.epochs} "
          f"epoch(s); GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"CPU runs: {args.cpu_threads} threads", flush=True)
    figures: dict = {"device_name": torch.cuda.get_device_name(), "scale": args.scale}
    for name in args.settings:
        nparts, placement = SETTINGS[name]
        root = work / f"graph_{nparts}"
        if not (root / "entities").is_dir():
            generate(root, num_entities, num_edges, nparts)
        figures[name] = {}
        for device, gpus in (("gpu", 1.0), ("cpu", 0.0)):
            base = dict(config_dict(root, nparts, work / f"ckpt_{name}_{device}", args.epochs),
                        workers=args.cpu_threads)
            cfg = as_pbg_ray(base)
            cfg["ray"].update(placement=placement, gpus_per_trainer=gpus)
            run = train_once(cfg, env)
            run["edges_per_s"] = num_edges * 0.99 * args.epochs / run["seconds"]
            run["mrr"] = mrr(cfg, args.epochs, str(root / "test"))
            figures[name][device] = run
            print(f"[{name}] {device}: {run['edges_per_s']:,.0f} edges/s, "
                  f"{100 * run['outside_kernel_share']:.1f}% of bucket time outside the kernel, "
                  f"copies to and from the device {run['device_copy_s']:.2f} s "
                  f"({100 * run['device_copy_share_of_kernel']:.1f}% of kernel time), "
                  f"MRR {run['mrr']:.4f}", flush=True)
        gpu, cpu = figures[name]["gpu"], figures[name]["cpu"]
        figures[name]["speedup"] = gpu["edges_per_s"] / cpu["edges_per_s"]
        print(f"[{name}] GPU / CPU: {figures[name]['speedup']:.2f}x edges/s, "
              f"MRR difference {gpu['mrr'] - cpu['mrr']:+.4f}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
