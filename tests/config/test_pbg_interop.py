"""The schema against torchbiggraph 1.0.0's (the original PyTorch-BigGraph): the keys both
have share PBG's defaults, and a PBG config dict is a valid config of both."""

import dataclasses

import attr
import pytest
from torchbiggraph.config import ConfigSchema as PbgConfigSchema
from torchbiggraph.config import EntitySchema as PbgEntitySchema
from torchbiggraph.config import RelationSchema as PbgRelationSchema

from pbg_ray.config import ConfigSchema, EntitySchema, RelationSchema
from tests.util import config_dict

pytestmark = pytest.mark.oracle

@pytest.mark.parametrize("ours, theirs", [
    (ConfigSchema, PbgConfigSchema), (EntitySchema, PbgEntitySchema),
    (RelationSchema, PbgRelationSchema)])
def test_defaults_match_torchbiggraph(ours, theirs):
    """Every key PBG 1.0.0 has that we keep has PBG's default, so configs mean the same."""
    our_fields = {f.name: f.default for f in dataclasses.fields(ours)}
    checked = 0
    for a in attr.fields(theirs):
        if a.name not in our_fields or a.default is attr.NOTHING:
            continue
        default = a.default.value if hasattr(a.default, "value") else a.default
        assert our_fields[a.name] == default, a.name
        checked += 1
    assert checked >= (20 if ours is ConfigSchema else 1)


def test_a_pbg_dict_with_pbg_only_keys_is_a_torchbiggraph_config(tmp_path):
    """The dict test_pbg_file loads means the same to torchbiggraph 1.0.0."""
    PbgConfigSchema.from_dict(config_dict(tmp_path, num_machines=4, background_io=True,
                                          bucket_order="affinity"))
