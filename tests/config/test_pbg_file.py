"""PBG config files and dicts (pbg_ray.config.pbg_file): a get_torchbiggraph_config() module
loads as torchbiggraph_train loads it, and the keys of PBG's own distribution, and those
accepted but not acted on, are ignored with a warning."""

import logging
import textwrap

import pytest

from pbg_ray.config import ConfigSchema, EntitySchema, load_pbg_config_file, pbg_file
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


def test_keys_accepted_but_not_acted_on_warn_once_naming_what_replaces_them(
        tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(pbg_file, "_warned", set())
    data = config_dict(tmp_path, num_machines=4, background_io=True, workers=2,
                       half_precision=True)
    with caplog.at_level(logging.WARNING, logger="pbg_ray"):
        ConfigSchema.from_dict(data, source="my_config.py")
        ConfigSchema.from_dict(data, source="my_config.py")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 4, lines
    for key, instead in (("num_machines", "ray.address"), ("background_io", "object store"),
                         ("workers", "ray.cpus_per_trainer"), ("half_precision", "float32")):
        assert any(f"my_config.py: PBG key {key!r} is ignored" in l and instead in l
                   for l in lines), key


def test_honoured_and_default_keys_do_not_warn(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(pbg_file, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="pbg_ray"):
        config = ConfigSchema.from_dict(config_dict(tmp_path, hogwild_delay=0.5, seed=7,
                                                    workers=None, half_precision=False))
    assert (config.hogwild_delay, config.seed) == (0.5, 7)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("key", ["hogwild_delay", "seed"])
def test_negative_warm_up_or_seed_is_refused(tmp_path, key):
    with pytest.raises(PbgRayError, match=f"{key}: must not be negative"):
        ConfigSchema.from_dict(config_dict(tmp_path, **{key: -1}))
