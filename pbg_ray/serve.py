"""python -m pbg_ray.serve [PBG_CONFIG.py] [key=value ...]

Serves a checkpoint (the config's checkpoint_path: the version best on validation, kept in
best/, and each new best; the newest where no best is kept, or with serve.follow=newest;
serve.version pins one) over HTTP on Ray Serve until Ctrl-C or SIGTERM: link scores, top-k tails and
heads (known edges of edge paths optionally left out), nearest neighbours of an entity or a
vector, metadata and health, as JSON, a batch answered per query; the OpenAPI page is at
/docs. Top-k searches faiss indexes per entity type and partition (serve.index), built by Ray
tasks and saved under <checkpoint_path>/serve_index/. Prints the URL, the index build's
figures as one JSON line, and a line for each new version taken up.
Settings: pbg_ray.config.serve.ServeConfig.
"""

from __future__ import annotations

import json
import sys
import threading

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.cli import hydra_entry, stop_requests
from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.connect import connect_ray, local_ray, shutdown_ray
from pbg_ray.serving.launch import start_service, stop_service, version_changes

EXAMPLES = (
    "python -m pbg_ray.serve                                # the demo's checkpoint on :8000",
    "python -m pbg_ray.serve config.py serve.port=8080 serve.index=hnsw serve.shard_groups=2",
    "curl -s localhost:8000/top_rhs -H 'Content-Type: application/json' \\\n"
    "      -d '{\"queries\": [{\"lhs\": \"user_17\", \"relation\": \"likes\"}], \"k\": 5}'",
)


def run(config: ConfigSchema) -> None:
    connect_ray(config.ray)
    try:
        started = start_service(config)
        with stop_requests() as stop:
            try:
                print(f"serving version {started['version']} of {config.checkpoint_path}"
                      f"{kind(config, started['version'])} at {started['url']} (API: "
                      f"{started['url']}/docs); Ctrl-C stops", flush=True)
                print(json.dumps(started), flush=True)
                report_versions(config, started["version"], stop)
            finally:  # on a local Ray, Serve's controller and proxies end with it
                if not local_ray():
                    stop_service()
    except KeyboardInterrupt:
        raise  # a stop ends the local Ray at once (cli.CommandStop)
    except BaseException:
        shutdown_ray()
        raise


def report_versions(config: ConfigSchema, version: int, stop: threading.Event) -> None:
    """A line for each version taken up, and one for each failure to take one up, until
    `stop` is set."""
    failure = None
    for news in version_changes(version, stop):
        if news["version"] != version:
            print(f"serving checkpoint version {news['version']} of {config.checkpoint_path}"
                  f"{kind(config, news['version'], new=True)} (was version {version})", flush=True)
        if news["failure"] not in (None, failure):
            print(f"pbg_ray: warning: checkpoint version {news['failure']['version']} could "
                  f"not be taken up, still serving version {news['version']} (tried again "
                  f"every {config.serve.reload_interval:g} s): {news['failure']['error']}",
                  file=sys.stderr, flush=True)
        version, failure = news["version"], news["failure"]


def kind(config: ConfigSchema, version: int, new: bool = False) -> str:
    """What `version` is where it is the one best/ keeps: ", the best on validation ..."
    (a `new` one: taken up while serving); else ""."""
    if version != CheckpointManager(config.checkpoint_path).best_version():
        return ""
    if new:
        return ", the new best on validation"
    other = ("" if config.serve.version is not None or config.serve.follow == "newest"
             else "; serve.follow=newest serves the newest")
    return f", the best on validation (kept in best/{other}),"


KEYS = ("checkpoint_path", "serve.host", "serve.port", "serve.version", "serve.follow",
        "serve.index", "serve.shard_groups", "serve.router_replicas", "serve.shard_replicas",
        "serve.max_k")
main = hydra_entry(run, __doc__, KEYS, EXAMPLES)

if __name__ == "__main__":
    main()
