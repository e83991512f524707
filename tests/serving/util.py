"""Helpers of the serving tests: a served config with a random checkpoint, its indexes built,
its shards in this process."""


from pbg_ray.config import ConfigSchema
from pbg_ray.serving.index import build_set_index, index_keys
from pbg_ray.serving.shards import in_process_shards
from tests.util import config_dict, random_checkpoint, write_random_graph


def served_config(tmp_path, **serve):
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, comparator=serve.pop("comparator", "cos"),
        serve={"index": "hnsw", "shard_groups": 2, **serve}))
    write_random_graph(config, num_edges=80)
    random_checkpoint(config)
    return config


def build_all(config, version=1):
    return [build_set_index(config, version, key) for key in index_keys(config)]


def local_shards(config, version=1):
    """The shards as the router reaches them, called in this process."""
    return in_process_shards(config, version)
