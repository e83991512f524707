"""The HTTP service under load: exact against approximate (faiss HNSW) top-k on a checkpoint
of at least 1M entities (by default 4M of dimension 128: a scan that an index beats by far).

The checkpoint is generated, not trained (training 1M entities takes far longer than this
benchmark may run): random embeddings around planted cluster centres, as trained ones
cluster (about 500 around each centre), written through the project's CheckpointManager.
The graph: `user` (the big type, --partitions partitions) and `item` (small), one relation
`likes` user -> item with a diagonal operator and the dot comparator; the queries are
top_lhs (the best users for an item), whose query vector is the item transformed by the
relation operator, searched in the users' index with inner product. The service runs with
serve.index=hnsw, or --index ivfpq (the partitions held as compressed codes, their vectors
read from the checkpoint for the hits), the router answering HTTP itself (serve.ingress=direct,
or --ingress proxy) on a local Ray and is driven on 127.0.0.1 by an async httpx load loop at
rising concurrency, each level bounded in requests and seconds. Prints per mode and concurrency QPS, p50 and p99, the
CPU time all of Ray's processes and the load generator spent per request, the
approximate/exact QPS ratio, recall@10 of the index against exact search, the index build
time, the shard replicas' resident memory (anonymous, and file pages such as IVF-PQ's
mapped vectors, which the kernel may drop) against the table's bytes, and at which
concurrency the targets are met; ends with one JSON line.

    python benchmarks/serve_bench.py --workdir /tmp/serve_bench     # 4M users, d=128
    (a rerun with the same --workdir reuses the checkpoint and its saved indexes)
    python benchmarks/serve_bench.py --users 1000000 --dimension 64 --partitions 2
    python benchmarks/serve_bench.py --users 200000 --levels 1 8   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np


def generate(root: Path, users: int, items: int, partitions: int, dimension: int,
             clusters: int, seed: int = 0) -> Dict[str, Any]:
    """Entity files, a few edges and version 1 of a random clustered checkpoint; returns
    the config dict."""
    from pbg_ray.checkpoints.manager import CheckpointManager
    from pbg_ray.config import ConfigSchema
    from pbg_ray.io.edges import write_edges
    from pbg_ray.io.entities import save_entity_count, save_entity_names, save_relation_names
    from pbg_ray.model.params import param_layout
    from pbg_ray.types import Bucket, EdgeList

    data = {
        "entities": {"user": {"num_partitions": partitions}, "item": {"num_partitions": 1}},
        "relations": [{"name": "likes", "lhs": "user", "rhs": "item", "operator": "diagonal"}],
        "dimension": dimension, "comparator": "dot",
        "entity_path": str(root / "entities"), "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(root / "checkpoints"),
    }
    config = ConfigSchema.from_dict(data)
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (clusters, dimension)).astype(np.float32)
    checkpoint = CheckpointManager(config.checkpoint_path)
    checkpoint.prepare()
    checkpoint.write_config(config)
    counts = {"user": [users // partitions + (p < users % partitions) for p in range(partitions)],
              "item": [items]}
    for entity, parts in counts.items():
        for part, count in enumerate(parts):
            save_entity_count(config.entity_path, entity, part, count)
            save_entity_names(config.entity_path, entity, part,
                              [f"{entity}{part}_{i}" for i in range(count)])
            rows = centres[rng.integers(clusters, size=count)]
            rows += rng.normal(0, 0.5, rows.shape).astype(np.float32)
            checkpoint.write_partition(1, entity, part, rows, None)
    save_relation_names(config.entity_path, ["likes"])
    for part in range(partitions):
        n = 1000
        write_edges(config.edge_paths[0], Bucket(part, 0), EdgeList(
            rng.integers(counts["user"][part], size=n), rng.integers(items, size=n),
            np.zeros(n, np.int64)))
    params = {k: v + rng.normal(0, 0.1, v.shape).astype(np.float32)
              for k, v in param_layout(config, 1)}
    checkpoint.write_model(1, params, None)
    checkpoint.switch_to(1)
    return data


def cpu_seconds() -> float:
    """CPU seconds spent so far by this process (the load generator) and its descendants
    (the local Ray it started: Serve's proxy, the router, the shards)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in [me] + me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


async def load(url: str, endpoint: str, queries: List[Dict[str, str]], exact: bool,
               concurrency: int, max_requests: int, max_seconds: float) -> Dict[str, float]:
    """`concurrency` clients each posting one of `queries` (drawn at random) to `endpoint`
    until max_requests are done or max_seconds have passed: QPS, p50 and p99 latency in ms,
    CPU ms per request (cpu_seconds), failures."""
    import httpx

    latencies: List[float] = []
    failures = 0
    issued = 0
    rng = np.random.default_rng(concurrency)
    deadline = time.perf_counter() + max_seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal issued, failures
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            body = {"queries": [queries[rng.integers(len(queries))]], "k": 10, "exact": exact}
            start = time.perf_counter()
            response = await http.post(endpoint, json=body)
            latencies.append(time.perf_counter() - start)
            failures += response.status_code != 200

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        cpu = cpu_seconds()
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds() - cpu
    ms = np.array(latencies) * 1000
    return {"requests": len(ms), "qps": len(ms) / elapsed, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "cpu_ms": cpu * 1000 / len(ms),
            "failures": failures}


async def recall_at_10(url: str, endpoint: str, queries: List[Dict[str, str]]) -> float:
    """Mean overlap of the index's top 10 with exact search's over `queries`."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        answers = {}
        for exact in (False, True):
            found = []
            for i in range(0, len(queries), 50):
                body = {"queries": queries[i:i + 50], "k": 10, "exact": exact}
                response = await http.post(endpoint, json=body)
                response.raise_for_status()
                found += [{hit["name"] for hit in a["hits"]} for a in response.json()["answers"]]
            answers[exact] = found
    return float(np.mean([len(a & e) / 10 for a, e in zip(answers[False], answers[True])]))


def in_process(config: Any, items: List[str], requests: int) -> Dict[str, Dict[str, float]]:
    """The same top_lhs queries answered by the service's own code (ServingModel over
    ShardTables) in this process, one at a time, without Ray Serve or HTTP: per mode the
    mean and p99 ms of the computation a request costs."""
    from pbg_ray.serving.names import ServingModel
    from pbg_ray.serving.shards import in_process_shards

    model = ServingModel(config, 1)
    rows, search = in_process_shards(config, 1)

    figures = {}
    rng = np.random.default_rng(0)
    for mode in ("exact", "approx"):
        ms = []
        for _ in range(requests):
            query = [(items[rng.integers(len(items))], "likes")]
            start = time.perf_counter()
            asyncio.run(model.top(rows, search, "lhs", query, 10, (), mode == "exact"))
            ms.append((time.perf_counter() - start) * 1000)
        figures[mode] = {"mean_ms": float(np.mean(ms)), "p99_ms": float(np.percentile(ms, 99))}
    return figures


def shard_memory() -> Dict[str, int]:
    """Resident bytes of the shard replicas' processes (Serve's Shard deployments), from
    /proc/<pid>/status: RssAnon (their own memory) and RssFile (file pages, a memory map's
    included, which the kernel may drop under pressure)."""
    import psutil

    found = {"anon": 0, "file": 0}
    for proc in psutil.process_iter(["cmdline"]):
        if "Shard" not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            continue
        for key, field in (("anon", "RssAnon:"), ("file", "RssFile:")):
            line = next(x for x in status.splitlines() if x.startswith(field))
            found[key] += int(line.split()[1]) * 1024
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=4_000_000)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=4, help="of users")
    parser.add_argument("--shard-groups", type=int, default=2, help="serve.shard_groups")
    parser.add_argument("--dimension", type=int, default=128)
    parser.add_argument("--clusters", type=int, default=None,
                        help="planted centres; default: one per 500 users")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32],
                        help="concurrency levels (clients in flight)")
    parser.add_argument("--requests", type=int, default=1000, help="most requests per level")
    parser.add_argument("--seconds", type=float, default=20.0, help="most seconds per level")
    parser.add_argument("--recall-samples", type=int, default=200)
    parser.add_argument("--hnsw-m", type=int, default=24)
    parser.add_argument("--ef-construction", type=int, default=48)
    parser.add_argument("--ef-search", type=int, default=128)
    parser.add_argument("--index", choices=["hnsw", "ivfpq"], default="hnsw", help="serve.index")
    parser.add_argument("--ingress", choices=["direct", "proxy"], default="direct",
                        help="serve.ingress: the router answers HTTP itself, or behind Serve's proxy")
    parser.add_argument("--in-process", type=int, default=50, help=(
        "requests per mode answered without Ray Serve and HTTP, after the load (0: none)"))
    parser.add_argument("--workdir", default=None, help=(
        "keep the checkpoint and its indexes here (a rerun with other search settings "
        "reuses both); default: a temporary directory, removed at the end"))
    args = parser.parse_args()
    args.clusters = args.clusters or max(1, args.users // 500)
    args.shard_groups = min(args.shard_groups, args.partitions)

    import ray

    from pbg_ray.config import ConfigSchema
    from pbg_ray.serving.launch import start_service, stop_service

    with contextlib.ExitStack() as stack:
        root = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory()))
        start = time.perf_counter()
        settings = root / "settings.json"
        wanted = [args.users, args.items, args.partitions, args.dimension, args.clusters]
        if settings.is_file() and json.loads(settings.read_text())[:5] == wanted:
            data = json.loads(settings.read_text())[5]
            print(f"reusing the generated checkpoint in {root}", flush=True)
        else:
            data = generate(root, *wanted)
            settings.write_text(json.dumps(wanted + [data]))
        print(f"a random clustered checkpoint (generated, not trained: training {args.users} "
              f"entities would outlast the benchmark): {args.users} users in "
              f"{args.partitions} partitions, {args.items} items, dimension {args.dimension}, "
              f"ready in {time.perf_counter() - start:.1f} s", flush=True)
        data["serve"] = {"port": free_port(), "index": args.index, "shard_groups": args.shard_groups,
                         "ingress": args.ingress,
                         "hnsw_m": args.hnsw_m, "hnsw_ef_construction": args.ef_construction,
                         "hnsw_ef_search": args.ef_search, "reload_interval": 0,
                         "shard_cpus": 0, "index_cpus": 1}
        config = ConfigSchema.from_dict(data)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
        try:
            start = time.perf_counter()
            started = start_service(config)
            startup = time.perf_counter() - start
            build = started["index"]
            task_seconds = sum(b["seconds"] for b in build["built"])
            print(f"index: {build['kinds']} built in {build['seconds']:.1f} s wall "
                  f"({task_seconds:.1f} s summed over {len(build['built'])} Ray tasks"
                  f"{'; all found saved by an earlier run' if not build['built'] else ''}); "
                  f"service up after {startup:.1f} s at {started['url']} "
                  f"(serve.ingress={args.ingress})", flush=True)
            items = [f"item0_{i}" for i in range(args.items)]
            queries = [{"relation": "likes", "rhs": item} for item in items]
            recall = asyncio.run(recall_at_10(started["url"], "/top_lhs",
                                              queries[:args.recall_samples]))
            print(f"recall@10 of the index against exact search: {recall:.4f} "
                  f"({args.recall_samples} queries)", flush=True)
            resident = shard_memory()
            table = args.users * args.dimension * 4
            print(f"shard replicas resident: {resident['anon'] / 2**20:,.0f} MiB anonymous, "
                  f"{resident['file'] / 2**20:,.0f} MiB file pages; the users' table is "
                  f"{table / 2**20:,.0f} MiB (anonymous {resident['anon'] / table:.2f}x of it)",
                  flush=True)
            levels: Dict[str, Dict[int, Dict[str, float]]] = {"exact": {}, "approx": {}}
            for concurrency in args.levels:
                for mode in ("exact", "approx"):
                    asyncio.run(load(started["url"], "/top_lhs", queries, mode == "exact",
                                     concurrency, concurrency * 2, 10))  # warm-up
                    figures = asyncio.run(load(started["url"], "/top_lhs", queries,
                                               mode == "exact", concurrency, args.requests,
                                               args.seconds))
                    levels[mode][concurrency] = figures
                    print(f"{mode:6s} concurrency {concurrency:3d}: {figures['qps']:8.1f} QPS  "
                          f"p50 {figures['p50_ms']:7.1f} ms  p99 {figures['p99_ms']:7.1f} ms  "
                          f"CPU {figures['cpu_ms']:6.1f} ms/request  "
                          f"({figures['requests']} requests, {figures['failures']} failed)",
                          flush=True)
                ratio = levels["approx"][concurrency]["qps"] / levels["exact"][concurrency]["qps"]
                levels.setdefault("ratio", {})[concurrency] = ratio
                print(f"approx/exact QPS at concurrency {concurrency}: {ratio:.1f}x", flush=True)
        finally:
            stop_service()
            ray.shutdown()
        own = in_process(config, items, args.in_process) if args.in_process else {}
        for mode, figures in own.items():
            print(f"{mode:6s} in process, without Serve and HTTP: {figures['mean_ms']:7.2f} ms "
                  f"mean, p99 {figures['p99_ms']:7.2f} ms per request", flush=True)
        if own:
            print(f"approx/exact computation per request: "
                  f"{own['exact']['mean_ms'] / own['approx']['mean_ms']:.1f}x", flush=True)
    met = {c: {"recall": recall >= 0.95, "ratio": levels["ratio"][c] >= 10,
               "p99": levels["approx"][c]["p99_ms"] < 50} for c in args.levels}
    meeting = [c for c in args.levels if all(met[c].values())]
    print(f"targets: recall@10 >= 0.95 {'met' if recall >= 0.95 else 'NOT met'} "
          f"({recall:.3f}); " + "; ".join(
              f"concurrency {c}: QPS {levels['ratio'][c]:.1f}x exact "
              f"({'met' if met[c]['ratio'] else 'not met'}), approx p99 "
              f"{levels['approx'][c]['p99_ms']:.0f} ms ({'met' if met[c]['p99'] else 'not met'})"
              for c in args.levels))
    print(f"all three targets (recall@10 >= 0.95, approx QPS >= 10x exact, p99 < 50 ms) met at "
          f"concurrency: {meeting or 'none'}")
    print(json.dumps({
        "users": args.users, "items": args.items, "partitions": args.partitions,
        "shard_groups": args.shard_groups, "ingress": args.ingress, "dimension": args.dimension, "clusters": args.clusters, "generated": True, "index": args.index,
        "shard_resident_anon_bytes": resident["anon"], "shard_resident_file_bytes": resident["file"],
        "hnsw_m": args.hnsw_m, "ef_construction": args.ef_construction,
        "ef_search": args.ef_search, "index_build_s": round(build["seconds"], 2),
        "index_task_s": round(task_seconds, 2), "recall_at_10": round(recall, 4),
        "levels": {mode: {str(c): {k: round(v, 2) for k, v in f.items()}
                          for c, f in by.items()} if mode != "ratio" else
                   {str(c): round(v, 2) for c, v in by.items()} for mode, by in levels.items()},
        "targets_met_at": meeting, "in_process": {m: {k: round(v, 3) for k, v in f.items()}
                                                  for m, f in own.items()},
    }))


if __name__ == "__main__":
    main()
