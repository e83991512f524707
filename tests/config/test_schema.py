"""ConfigSchema itself (pbg_ray.config.schema): its dict round trip, per-type dimensions and
absolute paths."""

import dataclasses
import os
import re
import typing

from pbg_ray.config import ConfigSchema
from pbg_ray.config.schema import LOCATIONS, location


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


def test_every_storage_location_is_made_absolute(make_config, tmp_path, monkeypatch):
    # Ray workers run in their raylet's directory: a relative export.output or importer
    # input would be written or read there.
    monkeypatch.chdir(tmp_path)
    config = make_config(
        tensorboard_dir="tb", importer={"inputs": ["raw/*.tsv", "s3://b/raw"],
                                        "previous_entity_path": "old"},
        eval={"filter_paths": ["f"]}, export={"output": "out"},
        tune={"storage_path": "~/tune"}).with_absolute_paths()
    assert config.tensorboard_dir == str(tmp_path / "tb")
    assert config.importer.inputs == [str(tmp_path / "raw" / "*.tsv"), "s3://b/raw"]
    assert config.importer.previous_entity_path == str(tmp_path / "old")
    assert config.eval.filter_paths == [str(tmp_path / "f")]
    assert config.export.output == str(tmp_path / "out")
    assert config.tune.storage_path == os.path.expanduser("~/tune")
    for key in LOCATIONS:
        value = location(config, key)
        for path in value if isinstance(value, list) else [value]:
            assert path is None or os.path.isabs(path) or "://" in path, key


def test_the_storage_locations_are_the_keys_declared_as_locations():
    assert set(LOCATIONS) == {
        "entity_path", "edge_paths", "eval_edge_paths", "checkpoint_path", "init_path",
        "tensorboard_dir", "importer.inputs", "importer.previous_entity_path",
        "importer.previous_edge_paths", "eval.edge_paths", "eval.filter_paths",
        "export.output", "tune.storage_path", "validation.edge_paths"}


def test_every_path_like_key_is_a_storage_location():
    def keys(schema, prefix=""):
        types = typing.get_type_hints(schema)
        for field in dataclasses.fields(schema):
            if dataclasses.is_dataclass(types[field.name]):
                yield from keys(types[field.name], f"{field.name}.")
            else:
                yield prefix + field.name

    path_like = {key for key in keys(ConfigSchema)
                 if re.search(r"(path|paths|_dir|output|inputs)$", key)}
    assert path_like == set(LOCATIONS)
