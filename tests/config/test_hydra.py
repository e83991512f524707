"""The config's side of Hydra (pbg_ray.config.hydra): command-line overrides checked against
the schema before Hydra runs, and a composed config turned into a validated ConfigSchema."""

import pytest
from hydra import compose, initialize_config_module

from pbg_ray.config.hydra import check_overrides, split_overrides, to_config
from pbg_ray.errors import PbgRayError


def test_split_overrides_skips_hydra_flags():
    argv = ["-m", "--config-dir", "/x", "lr=0.1", "--cfg", "job", "model=complex", "-cn", "c"]
    assert split_overrides(argv) == ["lr=0.1", "model=complex"]


@pytest.mark.parametrize("override, message", [
    ("lrr=0.1", "unknown key 'lrr' (did you mean 'lr'?)"),
    ("ray.adress=auto", "did you mean 'ray.address'"),
    ("dimension=abc", "dimension: expected an integer, got 'abc'"),
    ("lr=0.1,abc", "lr: expected a number, got 'abc'"),
    ("relations.x.operator=none", "address its items by index"),
    ("lr.x=1", "plain value"),
    ("lr=(", "command line"),
    ("tune.search_space.lr={uniform:[0.1,0.2]}", "a sampling spec is replaced, not overridden"),
    ("tune.num_sample=4", "did you mean 'tune.num_samples'"),
])
def test_bad_command_line_override(override, message):
    with pytest.raises(PbgRayError) as info:
        check_overrides([override])
    assert message in str(info.value)


def test_good_command_line_overrides_pass():
    check_overrides(["lr=0.1,0.2", "entities.user.num_partitions=4", "relations.0.operator=linear",
                     "ray.address=auto", "model=complex", "+foo=1", "hydra.run.dir=/x",
                     "edge_paths=[a,b]", "init_path=null", "hydra/launcher=basic",
                     "tune=asha", "tune.num_samples=4",
                     "+tune.search_space.margin={choice:[0.1,0.2]}", "~tune.search_space.lr",
                     "tensorboard_dir=/tb"])


def test_hydra_composition_gives_validated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("PBG_RAY_CACHE", str(tmp_path / "cache"))
    with initialize_config_module("pbg_ray.conf", version_base=None):
        cfg = compose("config", overrides=[
            "lr=0.5", "ray.num_trainers=2", f"checkpoint_path={tmp_path / 'ckpt'}",
            "entities.user.num_partitions=2", "entities.item.num_partitions=2"])
    config = to_config(cfg)
    assert config.lr == 0.5 and config.ray.num_trainers == 2
    assert config.dimension == 100 and config.loss_fn == "softmax"  # model=complex
    assert config.relations[1].name == "likes"
    assert config.entity_path == str(tmp_path / "cache" / "demo-v1" / "entities")
    assert (tmp_path / "cache" / "demo-v1" / "edges" / "train" / "edges_3_3.h5").is_file()


def test_the_quality_recipe_is_a_training_option_over_the_model(tmp_path, monkeypatch):
    """training=quality (docs/quality.md) sets the recipe's keys over model=complex's and
    validates early stopping; the graph's keys stay the graph's."""
    monkeypatch.setenv("PBG_RAY_CACHE", str(tmp_path / "cache"))
    with initialize_config_module("pbg_ray.conf", version_base=None):
        cfg = compose("config", overrides=["training=quality",
                                           f"checkpoint_path={tmp_path / 'ckpt'}"])
    config = to_config(cfg)
    assert (config.dimension, config.comparator, config.loss_fn, config.batch_size,
            config.eval_fraction) == (200, "dot", "softmax", 100, 0.0)
    assert (config.validation.every, config.validation.patience) == (1, 3)
    assert config.relations[1].name == "likes" and config.num_batch_negs == 50
