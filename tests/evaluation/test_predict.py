"""pbg_ray.predict: scores and rankings by name agree with the model's scores and with
filtered ranking; unknown names get one clear error."""

import dataclasses
import json
import re

import numpy as np
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.io.edges import read_edges
from pbg_ray.predict import main
from pbg_ray.types import Bucket
from tests.util import (
    assert_streams_partitions, config_dict, peak_growth, random_checkpoint, write_random_graph)


@pytest.fixture
def model(tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, comparator="dot"))
    write_random_graph(config, num_edges=50)
    random_checkpoint(config)
    return Predictor.load(config.checkpoint_path)


def test_top_rhs_ranks_by_score_and_excludes_known_edges(model):
    names = model.names("item")
    every = [n for part in names for n in part]
    scores = model.score([("user-1-3", "likes", n) for n in every])
    top = model.top_rhs("user-1-3", "likes", k=5)
    assert [n for n, _ in top] == [every[i] for i in np.argsort(-scores, kind="stable")[:5]]
    np.testing.assert_allclose([s for _, s in top], np.sort(scores)[::-1][:5], rtol=1e-5)
    # The known (user-1-3, likes, x) edges disappear from the answer.
    path = model.config.edge_paths[0]
    known = {names[r][e.rhs[i]] for r in range(2) for e in [read_edges(path, Bucket(1, r))]
             for i in range(len(e)) if e.lhs[i] == 3 and e.rel[i] == 1}
    assert known
    kept = model.top_rhs("user-1-3", "likes", k=len(every), exclude=[path])
    assert {n for n, _ in kept} == set(every) - known


def test_top_lhs_and_neighbors(model):
    users = [n for part in model.names("user") for n in part]
    scores = model.score([(n, "follows", "user-0-2") for n in users])
    assert model.top_lhs("follows", "user-0-2", k=3)[0][0] == users[int(np.argmax(scores))]
    near = model.neighbors("item-0-4", k=3)
    assert len(near) == 3 and "item-0-4" not in [n for n, _ in near]
    assert near[0][1] >= near[1][1] >= near[2][1]


def test_unknown_names_suggest_the_nearest(model):
    with pytest.raises(PbgRayError, match=r"unknown user entity 'user-1-300' \(did you mean"):
        model.top_rhs("user-1-300", "likes")
    with pytest.raises(PbgRayError, match=r"unknown relation 'like' \(did you mean 'likes'\?\)"):
        model.score([("user-0-1", "like", "item-0-1")])
    with pytest.raises(PbgRayError, match="unknown"):
        model.neighbors("nobody")


def test_cli_prints_one_json_line(model, capsys):
    main([model.config.checkpoint_path, "top-rhs", "user-0-1", "likes", "-k", "2"])
    answer = json.loads(capsys.readouterr().out)
    assert answer == {"lhs": "user-0-1", "relation": "likes", "hits": [
        {"name": hit.name, "score": hit.score} for hit in model.top_rhs("user-0-1", "likes", k=2)]}
    with pytest.raises(SystemExit) as exit_info:
        main([model.config.checkpoint_path, "--version", "3", "score", "a", "b", "c"])
    assert exit_info.value.code == 2
    assert "version 3 is not in" in capsys.readouterr().err


def test_one_triple_and_one_exclude_path_as_a_user_writes_them(model):
    path = model.config.edge_paths[0]
    one = model.score(("user-1-3", "likes", "item-0-2"))
    assert isinstance(one, float)
    assert one == model.score([("user-1-3", "likes", "item-0-2")])[0]
    assert model.top_rhs("user-1-3", "likes", k=40, exclude=path) == \
        model.top_rhs("user-1-3", "likes", k=40, exclude=[path])


def test_cli_takes_a_config_file_and_refuses_any_other_file(model, tmp_path, capsys):
    config_file = tmp_path / "config.py"
    config_file.write_text(f"def get_torchbiggraph_config():\n    return "
                           f"{model.config.to_dict()!r}\n")
    main([str(config_file), "top-rhs", "user-0-1", "likes", "-k", "2"])
    answer = json.loads(capsys.readouterr().out)
    assert answer["hits"] == [hit._asdict() for hit in model.top_rhs("user-0-1", "likes", k=2)]
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "checkpoints" / "config.json"), "top-rhs", "user-0-1", "likes"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, neither a checkpoint directory nor a model bundle" in err[0]


def test_the_demo_fallback_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PBG_RAY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit):  # no demo run there
        main(["top-rhs", "user_1", "likes"])
    err = capsys.readouterr().err
    assert "no CHECKPOINT_PATH given: predict reads the built-in demo graph's checkpoint (" \
        f"{tmp_path / 'cache' / 'demo-v1-checkpoints'})" in err


def test_a_model_file_of_another_config_is_named_in_the_error(tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, comparator="dot"))
    write_random_graph(config, num_edges=50)
    random_checkpoint(config)
    # config.json now says 'follows' is diagonal; model.v1.h5 holds its translation.
    relations = [dataclasses.replace(config.relations[0], operator="diagonal"), *config.relations[1:]]
    CheckpointStorage(config.checkpoint_path).save_config(dataclasses.replace(config, relations=relations))
    with pytest.raises(PbgRayError, match=rf"^version 1 of '{re.escape(config.checkpoint_path)}': "
                                          r"checkpoint parameter 'relations/0/operator/rhs/translation' "
                                          r"does not belong to this config's model"):
        Predictor.load(config.checkpoint_path)


def predict_in_process(checkpoint_path):
    """Run by peak_memory: top-k with known edges left out, and neighbours."""
    model = Predictor.load(checkpoint_path)
    assert len(model.top_rhs("node-0-1", "to", k=10, exclude=model.config.edge_paths)) == 10
    assert len(model.neighbors("node-0-2", k=10)) == 10


@pytest.mark.slow
def test_memory_follows_the_partition_not_the_table(tmp_path):
    assert_streams_partitions(*peak_growth(
        tmp_path, "tests.evaluation.test_predict:predict_in_process",
        lambda config, name: [config.checkpoint_path]))
