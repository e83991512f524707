"""PBG config files and dicts (pbg_ray.config.pbg_file): a get_torchbiggraph_config() module
loads as torchbiggraph_train loads it, and the keys of PBG's own distribution are ignored."""

import textwrap

import pytest

from pbg_ray.config import ConfigSchema, EntitySchema, load_pbg_config_file
from pbg_ray.errors import PbgRayError
from tests.util import config_dict


def test_pbg_dict_loads_with_pbg_only_keys_ignored(tmp_path):
    data = config_dict(tmp_path, num_machines=4, background_io=True, bucket_order="affinity")
    config = ConfigSchema.from_dict(data)
    assert config.bucket_order == "affinity"
    assert config.entities["user"] == EntitySchema(num_partitions=2)
    assert config.relations[1].operator == "diagonal"
    assert config.num_partitions() == 2
    assert "num_machines" not in config.to_dict()


def test_pbg_config_module_loads(tmp_path):
    path = tmp_path / "pbg_config.py"
    path.write_text(textwrap.dedent(f"""
        def get_torchbiggraph_config():
            return dict(
                entity_path={str(tmp_path / 'e')!r}, edge_paths=[{str(tmp_path / 'x')!r}],
                checkpoint_path={str(tmp_path / 'c')!r},
                entities={{"all": {{"num_partitions": 1}}}},
                relations=[{{"name": "all_edges", "lhs": "all", "rhs": "all",
                             "operator": "translation"}}],
                dynamic_relations=True, dimension=400, global_emb=False, comparator="dot",
                num_epochs=50, num_uniform_negs=1000, loss_fn="softmax", lr=0.1,
                distributed_init_method=None,
            )
    """))
    config = load_pbg_config_file(path)
    assert (config.dimension, config.num_uniform_negs, config.dynamic_relations) == (
        400, 1000, True)


@pytest.mark.parametrize("body, message", [
    ("x = 1", "defines no get_torchbiggraph_config()"),
    ("def get_torchbiggraph_config():\n    return [1]", "must return a dict"),
    ("raise RuntimeError('boom')", "failed to import"),
])
def test_bad_pbg_config_module(tmp_path, body, message):
    path = tmp_path / "c.py"
    path.write_text(body)
    with pytest.raises(PbgRayError, match=message):
        load_pbg_config_file(path)
