"""ConfigSchema itself (pbg_ray.config.schema): its dict round trip, per-type dimensions and
absolute paths."""

from pbg_ray.config import ConfigSchema


def test_to_dict_round_trips(make_config):
    config = make_config(init_path="/x", max_norm=2.0)
    assert ConfigSchema.from_dict(config.to_dict()) == config


def test_entity_dimension_overrides_global(make_config):
    config = make_config(entities={"user": {"num_partitions": 1, "dimension": 4},
                                   "item": {"num_partitions": 1}, "tag": {"num_partitions": 1}},
                         relations=[{"name": "r", "lhs": "user", "rhs": "item"}])
    assert config.entity_dimension("user") == 4
    assert config.entity_dimension("item") == 8


def test_with_absolute_paths_keeps_uris(make_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = make_config(entity_path="rel/ents", edge_paths=["s3://bucket/edges", "e"],
                         init_path=None).with_absolute_paths()
    assert config.entity_path == str(tmp_path / "rel" / "ents")
    assert config.edge_paths == ["s3://bucket/edges", str(tmp_path / "e")]
    assert config.init_path is None
