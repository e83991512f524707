"""The rules of a whole config (each field's check, pbg_ray.config.validation, and each
section's validate): building a ConfigSchema that breaks one, from a dict, directly or by
dataclasses.replace, is refused naming the key."""

import dataclasses
import re
import typing

import pytest

from pbg_ray.config import ConfigSchema, RelationSchema, ServeConfig
from pbg_ray.config.convert import field_types
from pbg_ray.config.options import CHECK
from pbg_ray.errors import PbgRayError
from tests.util import config_dict

BAD_CONFIGS = [
    # (overrides, substring of the message)
    (dict(relations=[{"name": "r", "lhs": "usr", "rhs": "item"}]),
     "unknown entity type 'usr' (did you mean 'user'?)"),
    (dict(entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 3},
                    "tag": {"num_partitions": 1}}), "don't broadcast"),
    (dict(batch_size=1001, num_batch_negs=50), "not a multiple of num_batch_negs"),
    (dict(beyond_batch_negs=64), "beyond_batch_negs: 64 is more than the beyond_bucket_negs=0"),
    (dict(dimension=7, relations=[{"name": "r", "lhs": "user", "rhs": "item",
                                   "operator": "complex_diagonal"}]), "even dimension"),
    (dict(disable_lhs_negs=True, disable_rhs_negs=True), "both sides"),
    (dict(dynamic_relations=True, global_emb=False), "exactly one relation type"),
    (dict(dynamic_relations=True, relations=[{"name": "r", "lhs": "user", "rhs": "item"}]),
     "global_emb"),
    (dict(relations=[{"name": "r", "lhs": "user", "rhs": "item", "operator": "lineer"}]),
     "relations[0].operator: unknown value 'lineer' (did you mean 'linear'?)"),
    (dict(comparator="dott"), "comparator: unknown value 'dott' (did you mean 'dot'?)"),
    (dict(loss_fn="hinge"), "loss_fn: unknown value 'hinge'"),
    (dict(bucket_order="afinity"), "did you mean 'affinity'"),
    (dict(entity_path=""), "entity_path: this path is required"),
    (dict(edge_paths=[]), "edge_paths: this path is required"),
    (dict(dimension=0), "dimension: must be positive"),
    (dict(eval_fraction=1.5), "eval_fraction: must be in [0, 1)"),
    (dict(lr=-1.0), "lr: must not be negative"),
    (dict(ray={"placement": "cloud"}), "ray.placement: unknown value 'cloud'"),
    (dict(ray={"cpus_per_trainer": 0}), "ray.cpus_per_trainer: must be positive"),
    (dict(export={"format": "csv"}), "export.format: unknown value 'csv'"),
    (dict(export={"format": "bundle", "variants": ["int4"]}),
     "export.variants: unknown value 'int4' (did you mean 'int8'?)"),
    (dict(export={"versions": [1, 2]}), "export.versions: export.versions and export.variants "
     "apply to export.format=bundle, not to format=tsv"),
    (dict(ray={"partition_buffer": 1}), "ray.partition_buffer: must be at least 2, got 1"),
    (dict(bucket_order="bata"), "bucket_order: unknown value 'bata'"),
    (dict(importer={"seed": -1}), "importer.seed: must not be negative, got -1"),
    (dict(eval={"seed": -2}), "eval.seed: must not be negative, got -2"),
]

SECRET_LOCATIONS = [
    dict(checkpoint_path="s3://b/model?secret_key=hush"),
    dict(edge_paths=["s3://b/edges", "s3://user:hush@b/more"]),
    dict(export={"output": "s3://b/export?access_key=AK&secret_key=hush"}),
    dict(importer={"inputs": ["gs://b/raw?session_token=hush"]}),
    dict(eval={"filter_paths": ["s3://b/x?secret_key=hush"]}),
]


@pytest.mark.parametrize("overrides", SECRET_LOCATIONS)
def test_a_location_carrying_credentials_is_refused_without_echoing_them(tmp_path, overrides):
    with pytest.raises(PbgRayError, match="carries credentials") as info:
        ConfigSchema.from_dict(config_dict(tmp_path, **overrides))
    key = next(iter(overrides))
    assert key in str(info.value) and "hush" not in str(info.value)
    assert "AWS_SECRET_ACCESS_KEY" in str(info.value)


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS)
def test_bad_config_is_refused_naming_the_key(tmp_path, overrides, message):
    data = config_dict(tmp_path, **overrides)
    with pytest.raises(PbgRayError) as info:
        ConfigSchema.from_dict(data)
    assert message in str(info.value)


@pytest.mark.parametrize("changes, message", [
    (dict(num_epochs=-1), "num_epochs: must not be negative, got -1"),
    (dict(num_epochs="three"), "num_epochs: expected an integer, got 'three'"),
    (dict(comparator="cosine"), "comparator: unknown value 'cosine'"),
    (dict(checkpoint_path="s3://b/model?secret_key=hush"),
     "checkpoint_path: the URI carries credentials"),
    (dict(serve=ServeConfig(port=0)), "serve.port: must be a TCP port (1 to 65535), got 0"),
    (dict(relations=[RelationSchema(name="r", lhs="user", rhs="item", weight=0)]),
     "relations[0].weight: must be positive, got 0"),
    (dict(batch_size=1001), "batch_size: 1001 is not a multiple of num_batch_negs=5"),
])
def test_a_config_changed_by_replace_is_refused_naming_the_key(make_config, changes, message):
    with pytest.raises(PbgRayError, match=f"^config: {re.escape(message)}"):
        dataclasses.replace(make_config(), **changes)


def test_a_config_built_from_a_dict_names_its_source(tmp_path):
    with pytest.raises(PbgRayError, match=r"^run\.py: num_epochs: must not be negative"):
        ConfigSchema.from_dict(config_dict(tmp_path, num_epochs=-1), source="run.py")


def test_a_config_built_directly_is_converted_as_from_dict_converts_it(tmp_path):
    data = config_dict(tmp_path, edge_paths=str(tmp_path / "edges"), num_epochs=2.0)
    config = ConfigSchema(**data)
    assert config == ConfigSchema.from_dict(data)
    assert config.edge_paths == [str(tmp_path / "edges")] and config.num_epochs == 2
    assert dataclasses.replace(config, serve={"port": 9000}).serve == ServeConfig(port=9000)


# Numeric keys that take every value of their type: no check is declared for them.
UNCHECKED_NUMBERS = {
    "margin",  # any margin, negative ones too, as in PBG
    "ray.object_store_memory",  # handed to ray.init as it is
    # A version the checkpoint does not hold is refused naming the key when it is read.
    "export.version", "export.versions",
}


def numeric_fields(cls, prefix=""):
    """(key, field) of every int or float key of `cls` and its sections (entities.<name>.*,
    relations.<index>.*), optional ones and lists of numbers included."""
    for field in dataclasses.fields(cls):
        hint = field_types(cls)[field.name]
        while typing.get_origin(hint) in (typing.Union, list, dict):
            hint = [a for a in typing.get_args(hint) if a is not type(None)][-1]
        if dataclasses.is_dataclass(hint):
            inner = {"entities": "entities.<name>.", "relations": "relations.<index>."}
            yield from numeric_fields(hint, inner.get(field.name, f"{prefix}{field.name}."))
        elif hint in (int, float):
            yield prefix + field.name, field


def test_every_numeric_key_declares_its_check_or_is_known_to_take_every_value():
    unchecked = {key for key, field in numeric_fields(ConfigSchema) if not field.metadata[CHECK]}
    assert unchecked == UNCHECKED_NUMBERS
