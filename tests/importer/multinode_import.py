"""Run by test_importer.py in its own process: a two-node Ray cluster on this machine
(ray.cluster_utils.Cluster), one import of the config given, joined to the cluster by
ray.address (so importer.engine=auto sees its nodes), and a JSON summary on stdout: the
engine auto chose, the stats, the nodes alive and those that ran tasks."""

import dataclasses
import json
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_tasks

from pbg_ray.config import ConfigSchema
from pbg_ray.importer.ray_engine import choose_engine, import_graph

STAGES = ("_read_shard", "DictionaryShard.add", "_dictionary", "DictionaryShard.scatter_names",
          "_write_names", "_route_block", "_write_buckets")
config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": True})
cluster.add_node(num_cpus=2)
try:
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray,
                                                                 address=cluster.address))
    engine = choose_engine(config)
    stats = import_graph(config)
    # Workers report their task events about once a second: wait (at most a minute) until
    # those of every stage of the import are in.
    for _ in range(120):
        tasks = list_tasks(filters=[("state", "=", "FINISHED")], limit=10000,
                           raise_on_missing_output=False)
        if all(any(t.name.endswith(stage) for t in tasks) for stage in STAGES):
            break
        time.sleep(0.5)
    print(json.dumps({"engine": engine, "stats": stats,
                      "nodes": len([n for n in ray.nodes() if n["Alive"]]),
                      "task_nodes": sorted({t.node_id for t in tasks if t.node_id})}))
finally:
    ray.shutdown()
    cluster.shutdown()
