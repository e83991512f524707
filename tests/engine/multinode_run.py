"""Run by test_multinode.py in its own process: a two-node Ray cluster on this
machine (ray.cluster_utils.Cluster), one training run, a JSON summary on stdout."""

import json
import sys

import ray
from ray.cluster_utils import Cluster

from pbg_ray.config import ConfigSchema
from pbg_ray.engine.trainer import Trainer

config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
cluster.add_node(num_cpus=1)
try:
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    result = Trainer(config).run()
    print(json.dumps({"version": result.version, "stats": result.bucket_stats,
                      "nodes": len([n for n in ray.nodes() if n["Alive"]])}))
finally:
    ray.shutdown()
    cluster.shutdown()
