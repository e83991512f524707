"""Plain data into the schema's dataclasses (pbg_ray.config.convert): unknown keys, values
of the wrong type and missing required keys are refused with the key and the fix."""

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.config.convert import convert
from pbg_ray.errors import PbgRayError
from tests.util import config_dict

BAD_DATA = [
    # (overrides, substring of the message)
    (dict(lrr=0.1), "unknown key 'lrr' (did you mean 'lr'?)"),
    (dict(entities={"user": {"num_partitons": 2}}),
     "unknown key 'entities.user.num_partitons' (did you mean 'entities.user.num_partitions'?)"),
    (dict(relations=[{"name": "r", "lhs": "user", "rhs": "item", "opertor": "none"}]),
     "did you mean 'relations[0].operator'"),
    (dict(dimension="big"), "dimension: expected an integer, got 'big'"),
    (dict(global_emb="yes"), "global_emb: expected true or false"),
    (dict(relations=[{"name": "r", "lhs": "user"}]), "missing required key 'relations[0].rhs'"),
]


@pytest.mark.parametrize("overrides, message", BAD_DATA)
def test_bad_data_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(PbgRayError) as info:
        convert(config_dict(tmp_path, **overrides), ConfigSchema, "", "config")
    assert message in str(info.value)


def test_missing_required_path(tmp_path):
    data = config_dict(tmp_path)
    del data["checkpoint_path"]
    with pytest.raises(PbgRayError, match="missing required key 'checkpoint_path'"):
        convert(data, ConfigSchema, "", "config")
