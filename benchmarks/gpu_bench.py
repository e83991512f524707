"""pbg_ray's engine with train tasks on a GPU (the device step) against the same runs on CPU
threads (issue 60), and CPU trainers against cores.

train_bench's graph and config (d=100, complex_diagonal, dot, softmax, 50 batch + 100
uniform negatives, batches of 1000 edges), trained per setting once with
`ray.gpus_per_trainer=1` and once on --cpu-threads CPU threads (one train task of that many
Hogwild threads), same seed: 1 partition in memory placement and 8 partitions in disk
placement. Per run it prints edges/s over the run (Ray's actors and workers starting
included) and per epoch (from its first task's start to its last task's end: task launches,
partition copies and reads included, the commit between epochs not), the share of bucket time outside
the kernel, the partitions' copies and bytes to the device and back per epoch
(training_stats' device_io: a table that fits crosses to the GPU once), and the sampled MRR
of the checkpoint on the held-out edges (the same evaluator for both). Then the targets of
issue 60 on the last epoch's rate.

With --cpu-trainers N..., the 8-partition graph is trained again on CPUs only, by N train
tasks of 2 Hogwild threads each (memory placement), for edges/s against cores.
Ends with one JSON line. The kernel alone is kernel_bench.py --device cuda.

    python benchmarks/gpu_bench.py                     # 1M entities, 10M edges
    python benchmarks/gpu_bench.py --scale 0.1         # a quick run
    python benchmarks/gpu_bench.py --settings --cpu-trainers 1 2 4 8
    python benchmarks/gpu_bench.py --scale 0.02 --device-step-on-cpu   # the script, no GPU
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

from train_bench import (RUN_PBG_RAY, as_pbg_ray, bench_env, config_dict, generate, mrr,
                         outside_kernel_share, train)

SETTINGS = {"1p_memory": (1, "memory"), "8p_disk": (8, "disk")}
# Issue 60's targets for one H100 or H200: the engine's edges/s per setting.
TARGETS = {"1p_memory": 5e6, "8p_disk": 2.5e6}
IO = ("copies_to_device", "bytes_to_device", "copies_from_device", "bytes_from_device")


def train_once(config: dict, env: dict, num_edges: int) -> dict:
    """One run of `config` in a new process: seconds, edges/s over the run and per epoch,
    bucket timing and the device copies per epoch."""
    out, _ = train(RUN_PBG_RAY, config, env, memory=False)
    buckets = json.loads(re.search(r"TIMING (.*)", out).group(1))
    seconds = float(re.search(r"TRAIN_SECONDS (\S+)", out).group(1))
    epochs = sorted({b["epoch_idx"] for b in buckets})
    by_epoch: List[Dict] = []
    for epoch in epochs:
        mine = [b for b in buckets if b["epoch_idx"] == epoch]
        wall = max(b["end"] for b in mine) - min(b["start"] for b in mine)
        by_epoch.append({"edges_per_s": num_edges / wall,
                         **{name: sum(b.get(name, 0) for b in mine) for name in IO}})
    return {"seconds": seconds, "edges_per_s": num_edges * len(epochs) / seconds,
            "per_epoch": by_epoch, "outside_kernel_share": outside_kernel_share(buckets)}


def describe(run: dict) -> str:
    epochs = "; ".join(
        f"epoch {i + 1}: {e['edges_per_s']:,.0f} edges/s, to the device {e['copies_to_device']} "
        f"copies {e['bytes_to_device'] / 2**20:,.1f} MiB, back {e['copies_from_device']} "
        f"copies {e['bytes_from_device'] / 2**20:,.1f} MiB" for i, e in enumerate(run["per_epoch"]))
    return (f"{run['edges_per_s']:,.0f} edges/s over the run ({run['seconds']:.1f} s); {epochs}; "
            f"{100 * run['outside_kernel_share']:.1f}% of bucket time outside the kernel; "
            f"MRR {run['mrr']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of 1M entities / 10M edges")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cpu-threads", type=int, default=2,
                        help="Hogwild threads of the CPU run beside each GPU run")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--cpu-trainers", nargs="*", type=int, default=[],
                        help="train the 8-partition graph on this many CPU trainers of 2 "
                             "threads each, one run per count")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also train each setting on the GPU with ray.cuda_graphs=true")
    parser.add_argument("--device-step-on-cpu", action="store_true",
                        help="the GPU runs' side trains by the device step on the CPU "
                             "(ray.device_step): the script checked where no GPU is; its "
                             "figures are no GPU's and no target is judged")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    if args.settings and not (torch.cuda.is_available() or args.device_step_on_cpu):
        sys.exit("gpu_bench: torch sees no CUDA device; run it on a machine with a GPU "
                 "(or only --settings with nothing after it, for --cpu-trainers)")
    num_entities, num_edges = int(1_000_000 * args.scale), int(10_000_000 * args.scale)
    train_edges = int(num_edges * 0.99)  # 1% held out in test/
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_bench_"))
    env = bench_env()
    device = ("the device step on the CPU (a dry run)" if args.device_step_on_cpu
              else torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    print(f"graph: {num_entities:,} entities, {num_edges:,} edges, d=100, "
          f"complex_diagonal/dot/softmax, 50 batch + 100 uniform negatives, {args.epochs} "
          f"epoch(s); GPU: {device}, torch {torch.__version__}; CPU runs: "
          f"{args.cpu_threads} threads", flush=True)
    figures: dict = {"device_name": device, "scale": args.scale, "epochs": args.epochs}

    def graph(nparts: int) -> Path:
        root = work / f"graph_{nparts}"
        if not (root / "entities").is_dir():
            generate(root, num_entities, num_edges, nparts)
        return root

    for name in args.settings:
        nparts, placement = SETTINGS[name]
        root = graph(nparts)
        figures[name] = {}
        kinds = [("gpu", 1.0)] + ([("gpu_graphs", 1.0)] if args.cuda_graphs else []) + [("cpu", 0.0)]
        for kind, gpus in kinds:
            base = dict(config_dict(root, nparts, work / f"ckpt_{name}_{kind}", args.epochs),
                        workers=args.cpu_threads)
            cfg = as_pbg_ray(base)
            cfg["ray"].update(placement=placement, gpus_per_trainer=gpus,
                              cuda_graphs=kind == "gpu_graphs")
            if gpus and args.device_step_on_cpu:
                cfg["ray"].update(gpus_per_trainer=0.0, device_step=True, num_trainers=1,
                                  cuda_graphs=False)
            run = train_once(cfg, env, train_edges)
            run["mrr"] = mrr(cfg, args.epochs, str(root / "test"))
            figures[name][kind] = run
            print(f"[{name}] {kind}: {describe(run)}", flush=True)
        cpu = figures[name]["cpu"]
        for kind, _ in kinds[:-1]:
            gpu = figures[name][kind]
            speedup = gpu["per_epoch"][-1]["edges_per_s"] / cpu["per_epoch"][-1]["edges_per_s"]
            figures[name][f"{kind}_speedup"] = speedup
            print(f"[{name}] {kind} / cpu: {speedup:.2f}x edges/s in the last epoch, MRR "
                  f"difference {gpu['mrr'] - cpu['mrr']:+.4f}", flush=True)
    for name in args.settings if not args.device_step_on_cpu else ():
        rate = max(figures[name][kind]["per_epoch"][-1]["edges_per_s"]
                   for kind in ("gpu", "gpu_graphs") if kind in figures[name])
        met = "met" if rate >= TARGETS[name] else "not met"
        print(f"target {name} on the GPU >= {TARGETS[name] / 1e6:g}M edges/s (last epoch, "
              f"the faster GPU run): {rate / 1e6:.2f}M, {met}")
    if args.cpu_trainers:
        root = graph(8)
        figures["cpu_trainers"] = {}
        for trainers in args.cpu_trainers:
            base = dict(config_dict(root, 8, work / f"ckpt_cpu_{trainers}", 1), workers=2)
            cfg = as_pbg_ray(base)
            cfg["ray"].update(num_trainers=trainers, num_cpus=2 * trainers)
            run = train_once(cfg, env, train_edges)
            figures["cpu_trainers"][trainers] = run
            print(f"[cpu_trainers] {trainers} trainer(s) x 2 threads ({2 * trainers} cores): "
                  f"{run['per_epoch'][0]['edges_per_s']:,.0f} edges/s in the epoch, "
                  f"{run['edges_per_s']:,.0f} over the run ({run['seconds']:.1f} s)", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
