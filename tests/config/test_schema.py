import dataclasses
import textwrap

import attr
import pytest
from hydra import compose, initialize_config_module
from torchbiggraph.config import ConfigSchema as PbgConfigSchema
from torchbiggraph.config import EntitySchema as PbgEntitySchema
from torchbiggraph.config import RelationSchema as PbgRelationSchema

from pbg_ray.config import ConfigSchema, EntitySchema, RelationSchema, load_pbg_config_file
from pbg_ray.config.hydra import check_overrides, split_overrides, to_config
from pbg_ray.errors import PbgRayError
from pbg_ray.importer import demo  # noqa: F401  registers the ${demo_graph:} resolver
from tests.util import config_dict


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


def test_pbg_dict_loads_with_pbg_only_keys_ignored(tmp_path):
    data = config_dict(tmp_path, num_machines=4, background_io=True, bucket_order="affinity")
    config = ConfigSchema.from_dict(data)
    assert config.bucket_order == "affinity"
    assert config.entities["user"] == EntitySchema(num_partitions=2)
    assert config.relations[1].operator == "diagonal"
    assert config.num_partitions() == 2
    assert "num_machines" not in config.to_dict()
    # The same dict is a valid torchbiggraph 1.0.0 config: keys mean the same there.
    PbgConfigSchema.from_dict(data)


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


BAD_CONFIGS = [
    # (overrides, substring of the message)
    (dict(relations=[{"name": "r", "lhs": "usr", "rhs": "item"}]), "unknown entity type 'usr' (did you mean 'user'?)"),
    (dict(entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 3},
                    "tag": {"num_partitions": 1}}), "don't broadcast"),
    (dict(batch_size=1001, num_batch_negs=50), "not a multiple of num_batch_negs"),
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
    (dict(lrr=0.1), "unknown key 'lrr' (did you mean 'lr'?)"),
    (dict(entities={"user": {"num_partitons": 2}}), "unknown key 'entities.user.num_partitons' (did you mean 'entities.user.num_partitions'?)"),
    (dict(relations=[{"name": "r", "lhs": "user", "rhs": "item", "opertor": "none"}]), "did you mean 'relations[0].operator'"),
    (dict(dimension="big"), "dimension: expected an integer, got 'big'"),
    (dict(global_emb="yes"), "global_emb: expected true or false"),
    (dict(dimension=0), "dimension: must be positive"),
    (dict(eval_fraction=1.5), "eval_fraction: must be in [0, 1)"),
    (dict(lr=-1.0), "lr: must not be negative"),
    (dict(ray={"placement": "cloud"}), "ray.placement: unknown value 'cloud'"),
    (dict(ray={"cpus_per_trainer": 0}), "ray.cpus_per_trainer: must be positive"),
    (dict(relations=[{"name": "r", "lhs": "user"}]), "missing required key 'relations[0].rhs'"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS)
def test_bad_config_is_refused_naming_the_key(tmp_path, overrides, message):
    data = config_dict(tmp_path, **overrides)
    with pytest.raises(PbgRayError) as info:
        ConfigSchema.from_dict(data)
    assert message in str(info.value)


def test_missing_required_path(tmp_path):
    data = config_dict(tmp_path)
    del data["checkpoint_path"]
    with pytest.raises(PbgRayError, match="missing required key 'checkpoint_path'"):
        ConfigSchema.from_dict(data)


def test_pbg_config_module_loads(tmp_path):
    path = tmp_path / "pbg_config.py"
    path.write_text(textwrap.dedent(f"""
        def get_torchbiggraph_config():
            return dict(
                entity_path={str(tmp_path / 'e')!r}, edge_paths=[{str(tmp_path / 'x')!r}],
                checkpoint_path={str(tmp_path / 'c')!r},
                entities={{"all": {{"num_partitions": 1}}}},
                relations=[{{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "translation"}}],
                dynamic_relations=True, dimension=400, global_emb=False, comparator="dot",
                num_epochs=50, num_uniform_negs=1000, loss_fn="softmax", lr=0.1,
                distributed_init_method=None,
            )
    """))
    config = load_pbg_config_file(path)
    assert (config.dimension, config.num_uniform_negs, config.dynamic_relations) == (400, 1000, True)


@pytest.mark.parametrize("body, message", [
    ("x = 1", "defines no get_torchbiggraph_config()"),
    ("def get_torchbiggraph_config():\n    return [1]", "must return a dict"),
    ("raise RuntimeError('boom')", "failed to import"),
])
def test_bad_pbg_config_module(tmp_path, body, message):
    path = tmp_path / "c.py"
    path.write_text(body)
    with pytest.raises(PbgRayError, match=message):
        load_pbg_config_file(path)


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
                     "tune=asha", "tune.num_samples=4", "+tune.search_space.margin={choice:[0.1,0.2]}",
                     "~tune.search_space.lr", "tensorboard_dir=/tb"])


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
