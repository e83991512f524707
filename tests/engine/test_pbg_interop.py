"""A checkpoint the engine trains is one torchbiggraph 1.0.0 loads: every partition's
embeddings and optimizer state, and the model of every relation's operator."""

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.engine.trainer import Trainer
from tests.oracle import assert_torchbiggraph_loads
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph

pytestmark = pytest.mark.oracle


def test_torchbiggraph_loads_a_trained_checkpoint(ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, num_epochs=1, eval_fraction=0.0))
    write_random_graph(config, num_edges=100)
    result = Trainer(config).run()
    assert_valid_checkpoint(config, result.version)
    assert_torchbiggraph_loads(config, result.version)
