"""The `serve` section of the config: how `python -m pbg_ray.serve` answers queries over HTTP
(address, replicas, shard groups, the approximate index and its settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pbg_ray.config.options import not_negative, one_of, option, positive, tcp_port

# exact: every candidate scored (the reference); hnsw and ivf: faiss indexes over the vectors;
# ivfpq: faiss's IVF over product-quantized codes, the vectors left on disk; auto: by size,
# and ivfpq where the rest does not fit the memory budget.
INDEX_KINDS = ("exact", "hnsw", "ivf", "ivfpq", "auto")
INGRESS_KINDS = ("direct", "proxy")
FOLLOWED = ("best", "newest")


@dataclass
class ServeConfig:
    """`python -m pbg_ray.serve`: link scores, top-k and nearest neighbours over HTTP on
    Ray Serve."""

    host: str = option("127.0.0.1", help=
        "The address the HTTP server listens on; 0.0.0.0 opens it to other machines.")
    port: int = option(8000, check=tcp_port, help="The HTTP port.")
    ingress: str = option("direct", check=one_of(INGRESS_KINDS), help=
        "direct: the router replica answers HTTP on port itself, on the node of the "
        "command (Ray Serve's direct ingress: one hop less per request; with several router "
        "replicas, each takes the next port); proxy: Serve's HTTP proxy on port (on every "
        "node) forwards each request to one of the router replicas.")
    version: Optional[int] = option(None, check=positive, help=
        "The checkpoint version served (from the checkpoint, an epoch_{k}/ snapshot or "
        "best/); null: the one `follow` names, and each newer one as training commits it "
        "(checked every reload_interval seconds).")
    follow: str = option("best", check=one_of(FOLLOWED), help=
        "With version null: best: the version best on validation, which training keeps in "
        "<checkpoint_path>/best/ (validation.edge_paths), and each new best, as eval, "
        "predict and export read it; the newest where no best/ is kept (yet); newest: the "
        "newest version and each newer one.")
    reload_interval: float = option(5.0, check=not_negative, help=
        "Seconds between checks for a new version to take up; 0: never.")
    router_replicas: int = option(1, check=positive, help=
        "Replicas of the HTTP ingress (names, queries, merging the shards' top-k).")
    shard_groups: int = option(1, check=positive, help=
        "Deployments the partitions are split over (partition p in group p mod shard_groups); "
        "more groups: tables larger than one replica's memory.")
    shard_replicas: int = option(1, check=positive, help=
        "Replicas of each shard group's deployment.")
    shard_threads: int = option(1, check=positive, help=
        "Threads of each shard replica's search (torch and faiss); more: exact search of a "
        "lone request sooner, at more CPU per request.")
    shard_cpus: float = option(0.0, check=not_negative, help=
        "CPUs Ray reserves for each shard replica; 0 (like the training's actors) never keeps "
        "index builds or train tasks from being placed.")
    index: str = option("auto", check=one_of(INDEX_KINDS), help=
        "Top-k search: exact (every candidate scored: the reference), hnsw or ivf (faiss "
        "indexes per entity type and partition, the vectors in memory), ivfpq (IVF over "
        "product-quantized codes of pq_bytes per row; the vectors stay in the checkpoint's "
        "files, read for the hits only: tables larger than memory), auto (exact below "
        "index_min_rows rows, hnsw below ivf_min_rows, ivf above; ivfpq for every indexed "
        "partition where that does not fit the memory budget). Approximate hits are "
        "rescored exactly.")
    index_min_rows: int = option(20000, check=not_negative, help=
        "index=auto: partitions below this many rows are searched exactly.")
    ivf_min_rows: int = option(2000000, check=not_negative, help=
        "index=auto: partitions of at least this many rows get ivf, smaller ones hnsw.")
    hnsw_m: int = option(32, check=positive, help="HNSW: neighbours per node of the graph.")
    hnsw_ef_construction: int = option(64, check=positive, help=
        "HNSW: candidate list size while building.")
    hnsw_ef_search: int = option(128, check=positive, help=
        "HNSW: candidate list size while searching (raised to k).")
    ivf_lists: int = option(0, check=not_negative, help="IVF: number of clusters; 0: 4 sqrt(rows).")
    ivf_probes: int = option(16, check=positive, help="IVF: clusters searched per query.")
    pq_bytes: int = option(0, check=not_negative, help=
        "IVF-PQ: bytes of each row's code (sub-quantizers of 8 bits; must divide the "
        "dimension); 0: the largest divisor of the dimension up to a quarter of it, or up "
        "to 16 (at most half of it) where that is more.")
    pq_rerank: int = option(10, check=positive, help=
        "IVF-PQ: hits fetched and rescored from the stored vectors per answer wanted (k x "
        "this): more, better recall at more reads.")
    index_cpus: float = option(1.0, check=positive, help=
        "CPUs of each Ray task that builds an index.")
    max_k: int = option(1000, check=positive, help="The largest k a request may ask for.")
    max_batch: int = option(1024, check=positive, help=
        "The most queries or edges one request may carry.")
