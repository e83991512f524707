"""The importer section's rules: its fields' checks and ImportConfig.validate, each naming
the key."""

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from tests.util import config_dict


@pytest.mark.parametrize("settings, message", [
    ({"entity_min_count": -1}, "importer.entity_min_count: must not be negative, got -1"),
    ({"relation_type_min_count": -2},
     "importer.relation_type_min_count: must not be negative, got -2"),
    ({"previous_edge_paths": ["old/train"]}, "importer.previous_edge_paths: needs "
     "importer.previous_entity_path: the entity dictionary those edges were imported with"),
])
def test_bad_settings_are_refused_naming_the_key(tmp_path, settings, message):
    with pytest.raises(PbgRayError) as err:
        ConfigSchema.from_dict(config_dict(tmp_path, importer=settings))
    assert message in str(err.value)


def test_good_settings_pass(tmp_path):
    ConfigSchema.from_dict(config_dict(tmp_path))
    ConfigSchema.from_dict(config_dict(tmp_path, importer=dict(
        entity_min_count=0, previous_entity_path="old/entities",
        previous_edge_paths=["old/train"])))
