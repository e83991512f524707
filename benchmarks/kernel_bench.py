"""pbg_ray's bucket kernel against torchbiggraph 1.0.0's trainer on the same generated bucket.

Two settings (issue 4):
  A  PBG's CPU defaults: d=100, complex_diagonal, dot, softmax, 50 batch + 100 uniform negs;
  B  large batch negatives: d=100, translation, l2, ranking, chunks of 1000 edges with
     1000 batch + 1000 uniform negatives.
Both trainers run Hogwild with `--workers` workers on identical initial embeddings and edges:
torchbiggraph as its train loop does (a spawn pool of processes, each running
process_in_batches with its Trainer and RowAdagrad), pbg_ray through `train_bucket` (the CPU
kernel). With --device cuda (or --device-step on the CPU) pbg_ray's side is the device step
(`train_bucket_on_device`), and a bucket of --profile-batches more batches is counted: on a
GPU torch's profiler counts kernel launches and host synchronisations per batch, on the CPU
a dispatch counter counts aten operations per batch and host reads.

Also measures the machine's float32 matmul GFLOP/s (with --workers threads, or on the GPU
with --device cuda) right before
and after each of pbg_ray's runs and prints the matmul FLOPs per edge pbg_ray needs, so that
each run is given as a fraction of the compute bound of the machine as it was during that
run; the setting's fraction is the median over runs. A shared machine's rate drifts
within seconds: a rate measured once, apart from the runs, made the fraction swing with
it. Each trainer's edges/s is the best of --repeats runs. The last line is
one JSON object with all the figures.

Run: python benchmarks/kernel_bench.py [--edges-a 300000] [--edges-b 60000] [--device cuda]
     [--device-step] [--profile-batches 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from functools import partial
from typing import Any, Dict, Optional, Tuple

from pbg_ray.model.native import KERNEL_ENV

# The kernel's malloc settings act only from process start: re-exec once with them.
_MALLOC_ENV = dict(KERNEL_ENV, PYTHONWARNINGS="ignore")  # (quiet torchbiggraph's workers too)
if any(os.environ.get(k) != v for k, v in _MALLOC_ENV.items()):
    os.environ.update(_MALLOC_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pbg_ray.config import ConfigSchema  # noqa: E402
from pbg_ray.model.device_step import train_bucket_on_device  # noqa: E402
from pbg_ray.model.dispatch import DispatchCount  # noqa: E402
from pbg_ray.model.kernel import train_bucket  # noqa: E402
from pbg_ray.model.params import init_params  # noqa: E402
from pbg_ray.types import Bucket, EdgeList  # noqa: E402

# torch's profiler's names of the CUDA runtime calls that launch a kernel (a captured
# graph's replay counts once) and that wait for the device (a copy to the host waits too).
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "cudaStreamWaitEvent")

SETTINGS: Dict[str, Dict[str, Any]] = {
    "A": dict(operator="complex_diagonal", comparator="dot", loss_fn="softmax",
              num_batch_negs=50, num_uniform_negs=100, batch_size=1000),
    "B": dict(operator="translation", comparator="l2", loss_fn="ranking",
              num_batch_negs=1000, num_uniform_negs=1000, batch_size=1000),
}
DIM = 100


def matmul_gflops(threads: int, seconds: float = 2.0, device: str = "cpu") -> float:
    """Sustained float32 matmul GFLOP/s with `threads` torch threads, or on the GPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048, device=device), torch.randn(2048, 2048, device=device)
    out = torch.empty(2048, 2048, device=device)
    torch.mm(a, b, out=out)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b, out=out)
        count += 1
        if device != "cpu" and count % 50 == 0:
            torch.cuda.synchronize()
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.set_num_threads(old)
    return 2 * 2048 ** 3 * count / elapsed / 1e9


def flops_per_edge(setting: Dict[str, Any]) -> int:
    """Matmul FLOPs per positive edge of pbg_ray's kernel: the C x C batch block is computed
    once and shared by both sides (2 C d forward + 4 C d backward), each side's C x U uniform
    block costs 2 U d forward + 4 U d backward: 6 (C + 2U) d."""
    return 6 * (setting["num_batch_negs"] + 2 * setting["num_uniform_negs"]) * DIM


def make_bucket(num_entities: int, num_edges: int, seed: int
                ) -> Tuple[np.ndarray, EdgeList]:
    rng = np.random.default_rng(seed)
    embs = rng.standard_normal((num_entities, DIM), dtype=np.float32) * np.float32(1e-3)
    edges = EdgeList(rng.integers(0, num_entities, num_edges),
                     rng.integers(0, num_entities, num_edges), np.zeros(num_edges, np.int64))
    return embs, edges


def config_dict(setting: Dict[str, Any]) -> Dict[str, Any]:
    """The setting's config, pbg_ray's and (with PBG's `workers` added) torchbiggraph's."""
    return dict(
        entities={"node": {"num_partitions": 1}},
        relations=[{"name": "link", "lhs": "node", "rhs": "node",
                    "operator": setting["operator"]}],
        dimension=DIM, comparator=setting["comparator"], loss_fn=setting["loss_fn"],
        num_batch_negs=setting["num_batch_negs"], num_uniform_negs=setting["num_uniform_negs"],
        batch_size=setting["batch_size"], global_emb=False, lr=0.1,
        entity_path="/unused", edge_paths=["/unused"], checkpoint_path="/unused")


def run_pbg_ray(setting: Dict[str, Any], embs: np.ndarray, edges: EdgeList, workers: int,
                device: Optional[str], cuda_graphs: bool = False) -> float:
    """pbg_ray's edges/s on the bucket: the CPU kernel on `workers` threads, or (device
    set) the device step there, after a warm-up of 10 batches."""
    config = ConfigSchema.from_dict(config_dict(setting))
    partitions = {("node", 0): (embs.copy(), np.zeros(len(embs), np.float32))}
    params = init_params(config, 1)
    warm = edges[slice(0, min(len(edges), 10 * setting["batch_size"]))]
    train = (partial(train_bucket, num_threads=workers) if device is None
             else partial(train_bucket_on_device, device=device, cuda_graphs=cuda_graphs))
    train(config, Bucket(0, 0), warm, partitions, params)
    stats = train(config, Bucket(0, 0), edges, partitions, params, seed=1)
    return stats["edges_per_s"]


def count_device_step(setting: Dict[str, Any], embs: np.ndarray, edges: EdgeList,
                      device: str, cuda_graphs: bool = False) -> Dict[str, float]:
    """What a bucket of the device step asks of `device` per batch: on a GPU kernel
    launches and host synchronisations (torch's profiler), on the CPU aten operations and
    host reads (DispatchCount)."""
    config = ConfigSchema.from_dict(config_dict(setting))
    partitions = {("node", 0): (embs.copy(), np.zeros(len(embs), np.float32))}
    params = init_params(config, 1)
    batches = -(-len(edges) // setting["batch_size"])
    train = partial(train_bucket_on_device, device=device, cuda_graphs=cuda_graphs)
    train(config, Bucket(0, 0), edges, partitions, params)
    if device == "cpu":
        count = DispatchCount()
        with count.watching_reads():
            train_bucket_on_device(config, Bucket(0, 0), edges, partitions, params,
                                   device=device, seed=2)
        return {"batches": batches, "ops_per_batch": count.num_ops / batches,
                "host_reads_per_bucket": count.num_host_reads}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(config, Bucket(0, 0), edges, partitions, params, seed=2)
    calls: Dict[str, int] = {}
    for event in prof.events():
        calls[event.name] = calls.get(event.name, 0) + 1
    return {"batches": batches,
            "launches_per_batch": sum(calls.get(n, 0) for n in LAUNCHES) / batches,
            "host_syncs_per_batch": sum(calls.get(n, 0) for n in SYNCS) / batches,
            "device_to_host_copies": calls.get("cudaMemcpyAsync", 0)}


def run_torchbiggraph(setting: Dict[str, Any], embs: np.ndarray, edges: EdgeList,
                      workers: int) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchbiggraph.batching import call, process_in_batches
        from torchbiggraph.config import ConfigSchema as TbgConfig
        from torchbiggraph.edgelist import EdgeList as TbgEdgeList
        from torchbiggraph.entitylist import EntityList
        from torchbiggraph.model import make_model
        from torchbiggraph.row_adagrad import RowAdagrad
        from torchbiggraph.train import Trainer
        from torchbiggraph.types import Side
        from torchbiggraph.util import create_pool, get_async_result, split_almost_equally
    data = dict(config_dict(setting), workers=workers)
    data["entities"] = {"node": {"num_partitions": 1}}
    config = TbgConfig.from_dict(data)
    model = make_model(config)
    weights = torch.nn.Parameter(torch.from_numpy(embs.copy()))
    model.set_embeddings("node", weights, Side.LHS)
    model.set_embeddings("node", weights, Side.RHS)
    model.share_memory()
    trainer = Trainer(global_optimizer=torch.optim.Adagrad(model.parameters(), lr=config.lr),
                      loss_fn=config.loss_fn, margin=config.margin, relations=config.relations)
    entity_optimizer = RowAdagrad([weights], lr=config.lr)
    entity_optimizer.share_memory()
    trainer.entity_optimizers[("node", 0)] = entity_optimizer
    tbg_edges = TbgEdgeList(EntityList.from_tensor(torch.from_numpy(edges.lhs)),
                            EntityList.from_tensor(torch.from_numpy(edges.rhs)),
                            torch.from_numpy(edges.rel))
    pool = create_pool(workers, subprocess_name="TbgWorker")
    try:
        def one_pass(perm: torch.Tensor) -> float:
            # As torchbiggraph.train does for a bucket: split the shuffled edges over the
            # Hogwild pool, time the compute.
            tic = time.perf_counter()
            future = pool.map_async(call, [
                partial(process_in_batches, batch_size=config.batch_size, model=model,
                        batch_processor=trainer, edges=tbg_edges, indices=perm[s])
                for s in split_almost_equally(perm.size(0), num_parts=workers)])
            get_async_result(future, pool)
            return time.perf_counter() - tic

        one_pass(torch.randperm(len(edges))[:10 * config.batch_size])  # warm the workers
        return len(edges) / one_pass(torch.randperm(len(edges)))
    finally:
        pool.close()
        pool.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges-a", type=int, default=300_000)
    parser.add_argument("--edges-b", type=int, default=60_000)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu",
                        help="pbg_ray's device (cpu or cuda: the device step)")
    parser.add_argument("--device-step", action="store_true",
                        help="on the CPU too, pbg_ray's side is the device step (one thread)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the device step on the GPU replays each group of 64 batches as "
                             "a captured CUDA graph")
    parser.add_argument("--profile-batches", type=int, default=128,
                        help="batches of the device step's counted bucket (0: none)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per trainer (best edges/s; median fraction of the bound)")
    parser.add_argument("--skip-torchbiggraph", action="store_true")
    args = parser.parse_args()

    step_device = args.device if args.device != "cpu" or args.device_step else None
    result: Dict[str, Any] = {"workers": args.workers, "device": args.device,
                              "repeats": args.repeats, "device_step": step_device is not None,
                              "cuda_graphs": args.cuda_graphs}
    if args.device == "cpu":
        matmul_unit = f"{1 if step_device else args.workers} threads"
    else:
        matmul_unit = torch.cuda.get_device_name()
        result["device_name"] = matmul_unit
    threads = 1 if step_device == "cpu" else args.workers
    for name, num_edges in (("A", args.edges_a), ("B", args.edges_b)):
        setting = SETTINGS[name]
        embs, edges = make_bucket(args.entities, num_edges, seed=0)
        flops = flops_per_edge(setting)
        runs, rates, fractions = [], [], []
        for repeat in range(args.repeats):
            before = matmul_gflops(threads, seconds=1.0, device=args.device)
            runs.append(run_pbg_ray(setting, embs, edges, args.workers, step_device,
                                    args.cuda_graphs))
            rates.append((before + matmul_gflops(threads, 1.0, args.device)) / 2)
            fractions.append(runs[-1] * flops / (rates[-1] * 1e9))
            print(f"setting {name} run {repeat + 1}: pbg_ray {runs[-1]:,.0f} edges/s; float32 "
                  f"matmul around it, {matmul_unit}: {rates[-1]:.1f} GFLOP/s; "
                  f"{fractions[-1]:.0%} of the compute bound")
        ours, gflops = max(runs), statistics.median(rates)
        fraction = statistics.median(fractions)
        theirs = None if args.skip_torchbiggraph else \
            max(run_torchbiggraph(setting, embs, edges, args.workers)
                for _ in range(args.repeats))
        bound = gflops * 1e9 / flops
        entry = {"edges": num_edges, "matmul_gflops": round(gflops, 1),
                 "pbg_ray_edges_per_s": round(ours),
                 "flops_per_edge": flops, "compute_bound_edges_per_s": round(bound),
                 "fraction_of_bound": round(fraction, 3),
                 "fractions_per_run": [round(f, 3) for f in fractions]}
        line = (f"setting {name} ({setting['operator']}, {setting['comparator']}, "
                f"{setting['loss_fn']}, C={setting['num_batch_negs']}, "
                f"U={setting['num_uniform_negs']}): pbg_ray {ours:,.0f} edges/s")
        if theirs is not None:
            entry.update(torchbiggraph_edges_per_s=round(theirs), ratio=round(ours / theirs, 2))
            line += f", torchbiggraph {theirs:,.0f} edges/s, ratio {ours / theirs:.2f}x"
        print(line)
        print(f"  matmul FLOPs per edge {flops:,} (batch block shared between sides); "
              f"compute bound {bound:,.0f} edges/s at the median {gflops:.1f} GFLOP/s; "
              f"pbg_ray at {fraction:.0%} of it (median of the runs' fractions)")
        if step_device is not None and args.profile_batches:
            counted = count_device_step(
                setting, embs, edges[slice(0, args.profile_batches * setting["batch_size"])],
                step_device, args.cuda_graphs)
            entry["device_step_counts"] = counted
            if step_device == "cpu":
                print(f"  device step per batch ({counted['batches']} batches): "
                      f"{counted['ops_per_batch']:.1f} aten operations; "
                      f"{counted['host_reads_per_bucket']} host read(s) in the bucket")
            else:
                print(f"  device step per batch ({counted['batches']} batches, torch's "
                      f"profiler): {counted['launches_per_batch']:.1f} kernel launches, "
                      f"{counted['host_syncs_per_batch']:.2f} host synchronisations")
        result[name] = entry
    print(json.dumps(result))


if __name__ == "__main__":
    main()
