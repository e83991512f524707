"""pbg_ray's importers (local and Ray) vs torchbiggraph 1.0.0's on generated edges.

Generates 10 million edges over 1 million entities (10 relation types, names of
10-14 bytes, a skewed degree distribution) as TSV and as a directory of 4 Parquet
shards, imports them with pbg_ray's local engine, the Parquet shards with its Ray
engine on a local Ray and on a simulated two-node cluster (ray.cluster_utils.Cluster),
both engines once more over 4x the entities (the Ray engine's driver's memory must not grow
with them), and the first `--pbg-edges` lines with torchbiggraph's convert_input_data
(what torchbiggraph_import_from_tsv runs), each in its own process. Prints edges/s, the
CPU seconds of its whole process tree (Ray's processes included), the driver's peak RSS
and the peak PSS of the tree (the object store's shared pages counted once) of each, the
ratios, then one JSON line. Each pbg_ray import runs twice: timed (edges/s, CPU seconds),
then again with the tree's PSS sampled every 0.2 s (the memory figures): reading every
process's memory map costs a Ray run's dozen processes seconds of CPU, the local
engine's single process next to nothing.

    python benchmarks/import_bench.py                 # 10M edges, 1M entities
    python benchmarks/import_bench.py --scale 0.05    # a quick run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

NUM_PARTITIONS = 4
RELATIONS = [f"rel_{i}" for i in range(10)]


def generate(root: Path, num_entities: int, num_edges: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    names = pa.array([f"entity_{i}" for i in range(num_entities)])
    # Skewed degrees: a few hubs, a long tail (as in real graphs).
    popularity = rng.permutation(num_entities)
    pick = lambda: popularity[np.minimum(rng.pareto(1.2, num_edges) * num_entities / 50,
                                         num_entities - 1).astype(np.int64)]
    table = pa.table({"lhs": names.take(pa.array(pick())),
                      "rel": pa.array(RELATIONS).take(pa.array(rng.integers(len(RELATIONS), size=num_edges))),
                      "rhs": names.take(pa.array(pick()))})
    root.mkdir(exist_ok=True)
    paths = {"tsv": root / "edges.tsv", "parquet": root / "shards"}
    pacsv.write_csv(table, paths["tsv"], pacsv.WriteOptions(include_header=False, delimiter="\t",
                                                             quoting_style="none"))
    paths["parquet"].mkdir()
    shard = -(-num_edges // 4)
    for i in range(4):
        pq.write_table(table.slice(i * shard, shard), paths["parquet"] / f"part-{i}.parquet",
                       row_group_size=1 << 20)
    return paths


def config_dict(root: Path) -> dict:
    return dict(entities={"node": {"num_partitions": NUM_PARTITIONS}},
                relations=[{"name": r, "lhs": "node", "rhs": "node"} for r in RELATIONS],
                dimension=100, entity_path=str(root / "entities"), edge_paths=[str(root / "edges")],
                checkpoint_path=str(root / "checkpoints"))


# The driver's peak RSS: VmHWM, this process's own high-water mark (getrusage's ru_maxrss
# would also count what the benchmark's process held when it forked this one).
DRIVER_PEAK = """
def driver_peak_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
"""

RUN_PBG_RAY = DRIVER_PEAK + """
import json, sys, threading, time
import psutil
from pbg_ray.config import ConfigSchema
from pbg_ray.importer.ray_engine import import_graph
data, nodes, sampled = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[4] == "1"
peak = [0]
def sample():  # the whole tree: this driver and, under it, Ray and its workers
    me = psutil.Process()
    while True:
        total = 0
        for p in [me] + me.children(recursive=True):
            try:  # PSS: pages shared by processes (the object store's) counted once
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.2)
if sampled:
    threading.Thread(target=sample, daemon=True).start()
def tree_cpu():  # CPU seconds of the driver and every process under it so far
    total = 0.0
    for p in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    return total
if data["importer"]["engine"] == "ray":
    import ray
    if nodes > 1:
        from ray.cluster_utils import Cluster
        # 2 CPUs a node, as the one-node run has.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    warm = dict(data, entity_path=data["entity_path"] + "-warm",
                edge_paths=[data["edge_paths"][0] + "-warm"],
                importer=dict(data["importer"], inputs=[sys.argv[3]]))
    import_graph(ConfigSchema.from_dict(warm))
t, cpu = time.perf_counter(), tree_cpu()
stats = import_graph(ConfigSchema.from_dict(data))
seconds, cpu = time.perf_counter() - t, tree_cpu() - cpu
print("RESULT", json.dumps({"seconds": seconds, "edges": stats["inputs"][0]["edges"],
      "cpu_s": cpu, "peak_rss_mb": driver_peak_mb(), "tree_peak_pss_mb": peak[0] / 2**20}),
      flush=True)
if data["importer"]["engine"] == "ray":
    ray.shutdown()
    if nodes > 1:
        cluster.shutdown()
"""

# torchbiggraph 1.0.0 imports pkg_resources (setuptools<81); convert_input_data is the
# body of torchbiggraph_import_from_tsv.
RUN_PBG = DRIVER_PEAK + """
import json, sys, time
from pathlib import Path
from torchbiggraph.config import ConfigSchema
from torchbiggraph.converters.import_from_tsv import convert_input_data
config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
t = time.perf_counter()
convert_input_data(config.entities, config.relations, config.entity_path, config.edge_paths,
                   [Path(sys.argv[2])], lhs_col=0, rhs_col=2, rel_col=1)
seconds = time.perf_counter() - t
print("RESULT", json.dumps({"seconds": seconds, "peak_rss_mb": driver_peak_mb()}))
"""


def run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode:
        raise SystemExit(f"benchmark subprocess failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of 10M edges / 1M entities")
    parser.add_argument("--pbg-edges", type=int, default=100_000,
                        help="lines imported by torchbiggraph (its importer is far slower)")
    args = parser.parse_args()
    num_edges, num_entities = int(10_000_000 * args.scale), int(1_000_000 * args.scale)
    results = {"edges": num_edges, "entities": num_entities, "partitions": NUM_PARTITIONS}
    with tempfile.TemporaryDirectory(prefix="import_bench_") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        paths = generate(root, num_entities, num_edges)
        more = generate(root / "more", num_entities * 4, num_edges, seed=1)
        warm = generate(root / "warm", 1000, 10_000, seed=2)  # starts Ray's workers
        print(f"generated {num_edges:,} edges over {num_entities:,} entities in "
              f"{time.perf_counter() - t:.1f} s (TSV {paths['tsv'].stat().st_size / 2**20:.0f} MiB)")
        runs = [("local_tsv", "local", paths["tsv"], 1),
                ("local_parquet", "local", paths["parquet"], 1),
                ("ray_parquet", "ray", paths["parquet"], 1),
                ("ray_parquet_2_nodes", "ray", paths["parquet"], 2),
                ("local_parquet_4x_entities", "local", more["parquet"], 1),
                ("ray_parquet_4x_entities", "ray", more["parquet"], 1)]
        for name, engine, path, nodes in runs:
            out, memory = (run(RUN_PBG_RAY, json.dumps(dict(
                config_dict(root / f"{name}_{sampled}"), importer={
                    "inputs": [str(path)], "lhs_col": 0, "rel_col": 1, "rhs_col": 2,
                    "engine": engine})), str(nodes), str(warm["parquet"]), sampled)
                for sampled in ("0", "1"))
            rate = out["edges"] / out["seconds"]
            results[name] = {"edges_per_s": round(rate), "seconds": round(out["seconds"], 2),
                             "cpu_s": round(out["cpu_s"], 1),
                             "driver_peak_rss_mb": round(memory["peak_rss_mb"]),
                             "tree_peak_pss_mb": round(memory["tree_peak_pss_mb"])}
            print(f"pbg_ray {name:24s} {rate / 1e6:6.2f} M edges/s  {out['seconds']:7.2f} s  "
                  f"CPU {out['cpu_s']:6.1f} s  "
                  f"driver peak RSS {memory['peak_rss_mb']:6.0f} MB  "
                  f"tree peak PSS {memory['tree_peak_pss_mb']:6.0f} MB")
        pbg_slice = root / "slice.tsv"
        with open(paths["tsv"]) as src, open(pbg_slice, "w") as dst:
            for _, line in zip(range(args.pbg_edges), src):
                dst.write(line)
        out = run(RUN_PBG, json.dumps(config_dict(root / "torchbiggraph")), str(pbg_slice))
        rate = args.pbg_edges / out["seconds"]
        results["torchbiggraph_tsv"] = {"edges": args.pbg_edges, "edges_per_s": round(rate),
                                        "seconds": round(out["seconds"], 2),
                                        "peak_rss_mb": round(out["peak_rss_mb"])}
        print(f"torchbiggraph tsv {rate / 1e6:6.3f} M edges/s  {out['seconds']:7.2f} s  "
              f"peak RSS {out['peak_rss_mb']:6.0f} MB  (first {args.pbg_edges:,} edges)")
    ratio = results["local_tsv"]["edges_per_s"] / results["torchbiggraph_tsv"]["edges_per_s"]
    results["ratio_tsv"] = round(ratio, 1)
    print(f"pbg_ray local / torchbiggraph (TSV): {ratio:.0f}x")
    for name in ("ray_parquet", "ray_parquet_2_nodes"):
        rate = results[name]["edges_per_s"]
        results[f"ratio_{name}_vs_local"] = round(rate / results["local_parquet"]["edges_per_s"], 2)
        results[f"ratio_{name}_vs_torchbiggraph"] = round(
            rate / results["torchbiggraph_tsv"]["edges_per_s"], 1)
        print(f"pbg_ray {name} / local (Parquet): {results[f'ratio_{name}_vs_local']:.2f}x, "
              f"/ torchbiggraph: {results[f'ratio_{name}_vs_torchbiggraph']:.1f}x")
    # What the machine's load takes out: the CPU seconds each engine spent (its whole tree).
    cpu = results["ray_parquet"]["cpu_s"] / results["local_parquet"]["cpu_s"]
    results["ratio_ray_parquet_cpu_vs_local"] = round(cpu, 2)
    print(f"pbg_ray ray_parquet / local (Parquet), CPU seconds: {cpu:.2f}x")
    ratio = results["ratio_ray_parquet_vs_local"]
    print(f"target: the Ray engine on one node within 30% of the local engine (>= 0.70x): {ratio:.2f}x, "
          f"{'met' if ratio >= 0.7 else 'missed'}")
    for engine in ("local", "ray"):
        print(f"pbg_ray {engine} driver peak RSS at {num_entities:,} / {4 * num_entities:,} "
              f"entities: {results[f'{engine}_parquet']['driver_peak_rss_mb']} / "
              f"{results[f'{engine}_parquet_4x_entities']['driver_peak_rss_mb']} MB")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
