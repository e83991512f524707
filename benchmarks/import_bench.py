"""pbg_ray's importer vs torchbiggraph 1.0.0's on one generated edge list.

Generates 10 million edges over 1 million entities (10 relation types, names of
10-14 bytes, a skewed degree distribution) as TSV and as Parquet, imports both
with pbg_ray and the first `--pbg-edges` lines with torchbiggraph's
convert_input_data (what torchbiggraph_import_from_tsv runs), each in its own
process. Prints edges/s and peak RSS of each and the ratio, then one JSON line.

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
    paths = {"tsv": root / "edges.tsv", "parquet": root / "edges.parquet"}
    pacsv.write_csv(table, paths["tsv"], pacsv.WriteOptions(include_header=False, delimiter="\t",
                                                             quoting_style="none"))
    pq.write_table(table, paths["parquet"], row_group_size=1 << 20)
    return paths


def config_dict(root: Path) -> dict:
    return dict(entities={"node": {"num_partitions": NUM_PARTITIONS}},
                relations=[{"name": r, "lhs": "node", "rhs": "node"} for r in RELATIONS],
                dimension=100, entity_path=str(root / "entities"), edge_paths=[str(root / "edges")],
                checkpoint_path=str(root / "checkpoints"))


RUN_PBG_RAY = """
import json, resource, sys, time
from pbg_ray.config import ConfigSchema
from pbg_ray.importer.graph_import import import_graph
data = json.loads(sys.argv[1])
t = time.perf_counter()
stats = import_graph(ConfigSchema.from_dict(data))
seconds = time.perf_counter() - t
print("RESULT", json.dumps({"seconds": seconds, "edges": stats["inputs"][0]["edges"],
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

# torchbiggraph 1.0.0 imports pkg_resources (setuptools<81); convert_input_data is the
# body of torchbiggraph_import_from_tsv.
RUN_PBG = """
import json, resource, sys, time
from pathlib import Path
from torchbiggraph.config import ConfigSchema
from torchbiggraph.converters.import_from_tsv import convert_input_data
config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
t = time.perf_counter()
convert_input_data(config.entities, config.relations, config.entity_path, config.edge_paths,
                   [Path(sys.argv[2])], lhs_col=0, rhs_col=2, rel_col=1)
seconds = time.perf_counter() - t
print("RESULT", json.dumps({"seconds": seconds,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
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
        print(f"generated {num_edges:,} edges over {num_entities:,} entities in "
              f"{time.perf_counter() - t:.1f} s (TSV {paths['tsv'].stat().st_size / 2**20:.0f} MiB)")
        for fmt, path in paths.items():
            data = config_dict(root / f"pbg_ray_{fmt}")
            data["importer"] = {"inputs": [str(path)], "lhs_col": 0, "rel_col": 1, "rhs_col": 2}
            out = run(RUN_PBG_RAY, json.dumps(data))
            rate = out["edges"] / out["seconds"]
            results[f"pbg_ray_{fmt}"] = {"edges_per_s": round(rate), "seconds": round(out["seconds"], 2),
                                         "peak_rss_mb": round(out["peak_rss_mb"])}
            print(f"pbg_ray {fmt:8s} {rate / 1e6:6.2f} M edges/s  {out['seconds']:7.2f} s  "
                  f"peak RSS {out['peak_rss_mb']:6.0f} MB")
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
    ratio = results["pbg_ray_tsv"]["edges_per_s"] / results["torchbiggraph_tsv"]["edges_per_s"]
    results["ratio_tsv"] = round(ratio, 1)
    print(f"pbg_ray / torchbiggraph (TSV): {ratio:.0f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
