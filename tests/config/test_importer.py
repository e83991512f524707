"""The importer section's own rules (ImportConfig.validate)."""

import pytest

from pbg_ray.config.importer import ImportConfig
from pbg_ray.errors import PbgRayError


def fail(key, problem, fix):
    raise PbgRayError(f"{key}: {problem}. {fix}")


@pytest.mark.parametrize("settings, message", [
    ({"entity_min_count": -1}, "importer.entity_min_count: must not be negative, got -1"),
    ({"relation_type_min_count": -2},
     "importer.relation_type_min_count: must not be negative, got -2"),
    ({"previous_edge_paths": ["old/train"]}, "importer.previous_edge_paths: needs "
     "importer.previous_entity_path: the entity dictionary those edges were imported with"),
])
def test_bad_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(PbgRayError) as err:
        ImportConfig(**settings).validate(fail)
    assert message in str(err.value)


def test_good_settings_pass():
    ImportConfig().validate(fail)
    ImportConfig(entity_min_count=0, previous_entity_path="old/entities",
                 previous_edge_paths=["old/train"]).validate(fail)
