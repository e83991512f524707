"""The `serve` section: its defaults and its checks, each naming the key and the fix."""

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from tests.util import config_dict


def test_defaults_listen_on_loopback_and_follow_new_versions(tmp_path):
    serve = ConfigSchema.from_dict(config_dict(tmp_path)).serve
    assert serve.host == "127.0.0.1" and serve.version is None and serve.index == "auto"


@pytest.mark.parametrize("serve, message", [
    ({"index": "hnws"}, r"serve.index: unknown value 'hnws' \(did you mean 'hnsw'\?\)"),
    ({"port": 70000}, r"serve.port: must be a TCP port .* Set serve.port=8000"),
    ({"shard_groups": 0}, r"serve.shard_groups: must be positive, got 0"),
    ({"reload_interval": -1}, r"serve.reload_interval: must not be negative"),
    ({"max_k": 0}, r"serve.max_k: must be positive"),
    ({"version": 0}, r"serve.version: must be positive"),
])
def test_bad_values_name_the_key_and_the_fix(tmp_path, serve, message):
    with pytest.raises(PbgRayError, match=message):
        ConfigSchema.from_dict(config_dict(tmp_path, serve=serve))
