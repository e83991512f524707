"""A checkpoint the engine trains is one torchbiggraph 1.0.0 loads: every partition's
embeddings and optimizer state, and the model of every relation's operator."""

import pytest

from tests.oracle import assert_torchbiggraph_loads
from tests.util import assert_valid_checkpoint

pytestmark = pytest.mark.oracle


def test_torchbiggraph_loads_a_trained_checkpoint(trained_config):
    assert_valid_checkpoint(trained_config, 2)  # one version per epoch
    assert_torchbiggraph_loads(trained_config, 2)
