"""python -m pbg_ray.serve [PBG_CONFIG.py] [key=value ...]

Serves a checkpoint (the config's checkpoint_path; serve.version pins a version, null follows
each new one) over HTTP on Ray Serve until Ctrl-C: link scores, top-k tails and heads
(known edges of edge paths optionally left out), nearest neighbours of an entity or a vector,
metadata and health, as JSON; the OpenAPI page is at /docs. Top-k searches faiss indexes
per entity type and partition (serve.index), built by Ray tasks and saved under
<checkpoint_path>/serve_index/. Prints the URL and the index build's figures as one JSON line.
Settings: pbg_ray.config.serve.ServeConfig.
"""

from __future__ import annotations

import json
import time

from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.engine.serving import start_service, stop_service

EXAMPLES = (
    "python -m pbg_ray.serve                                # the demo's checkpoint on :8000",
    "python -m pbg_ray.serve config.py serve.port=8080 serve.index=hnsw serve.shard_groups=2",
    "curl -s localhost:8000/top_rhs -d '{\"queries\": [{\"lhs\": \"user_17\", "
    "\"relation\": \"likes\"}], \"k\": 5}'",
)


def run(config: ConfigSchema) -> None:
    started = start_service(config)
    print(f"serving version {started['version']} of {config.checkpoint_path} at "
          f"{started['url']} (API: {started['url']}/docs); Ctrl-C stops", flush=True)
    print(json.dumps(started), flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        stop_service()


KEYS = ("checkpoint_path", "serve.host", "serve.port", "serve.version", "serve.index",
        "serve.shard_groups", "serve.router_replicas", "serve.shard_replicas", "serve.max_k")
main = hydra_entry(run, __doc__, KEYS, EXAMPLES)

if __name__ == "__main__":
    main()
