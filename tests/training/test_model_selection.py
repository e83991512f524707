"""Validation while training: the validation edges ranked after every `validation.every`
epochs, the best version kept in best/ (and read by default), early stopping with patience,
in memory and disk placement and across a resumed run."""

import dataclasses
import json

import h5py
import pytest

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.position import Position
from pbg_ray.config import ConfigSchema
from pbg_ray.config.model_selection import ValidationConfig
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import evaluate_checkpoint
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.training.model_selection import ModelSelection, Validation
from pbg_ray.training.trainer import Trainer
from tests.util import config_dict, write_random_graph


def validation(epoch: int, value: float) -> Validation:
    return Validation(epoch, epoch, "filtered", "mrr", value, {"mrr": value})


def test_the_best_is_the_highest_value_and_the_earliest_among_equals():
    selection = ModelSelection(ValidationConfig(patience=2))
    for epoch, value in ((1, 0.2), (2, 0.5), (3, 0.5), (4, 0.4)):
        selection = selection.after(validation(epoch, value))
    assert selection.best.epoch == 2
    assert selection.stopped()  # epochs 3 and 4 did not beat epoch 2
    assert not selection.after(validation(5, 0.6)).stopped()
    assert not dataclasses.replace(selection, settings=ValidationConfig()).stopped()


def test_validation_is_due_every_k_epochs_and_after_the_last():
    selection = ModelSelection(ValidationConfig(edge_paths=["valid"], every=2))
    due = [epoch + 1 for epoch in range(5)
           if selection.due(Position(epoch, 0, 0, 5, 1, 1))]
    assert due == [2, 4, 5]
    assert not selection.due(Position(1, 0, 0, 5, 1, 2))  # not the epoch's last chunk
    assert not ModelSelection(ValidationConfig()).due(Position(0, 0, 0, 1, 1, 1))


def graph_with_validation(tmp_path, **overrides) -> ConfigSchema:
    data = config_dict(tmp_path, **overrides)
    valid = str(tmp_path / "valid")
    write_random_graph(ConfigSchema.from_dict(dict(data, edge_paths=[valid])), 40, seed=1)
    config = ConfigSchema.from_dict(dict(data, validation={"edge_paths": [valid], "patience": 2}))
    write_random_graph(config, 200)
    return config


@pytest.mark.parametrize("placement", ["memory", "disk"])
def test_a_run_that_stops_improving_stops_early_and_keeps_its_best_version(
        ray_session, tmp_path, placement):
    """lr=0: every validation ranks alike, so the first one stays the best, and training
    stops after `patience` more; best/ keeps version 1, which readers take by default and
    a resumed run does not train past."""
    config = graph_with_validation(tmp_path, num_epochs=6, lr=0.0, ray={"placement": placement})
    result = Trainer(config).run()
    assert result.version == 3
    assert (result.best.version, result.best.epoch, result.best.ranking) == (1, 1, "filtered")
    checkpoints = CheckpointManager(config.checkpoint_path)
    assert checkpoints.version() == 3
    best = CheckpointManager(checkpoints.path / "best")
    assert best.version() == 1
    best.storage.check_version(1, config)
    with h5py.File(str(best.model_file(1)), "r") as hf:
        assert (hf.attrs["validation/metric"], hf.attrs["validation/value"]) == (
            "mrr", pytest.approx(result.best.value))
    lines = [line["validation"] for line in checkpoints.read_stats() if "validation" in line]
    assert [(v["epoch"], v["version"]) for v in lines] == [(1, 1), (2, 2), (3, 3)]
    assert len({v["value"] for v in lines}) == 1 and 0 < lines[0]["value"] <= 1

    assert evaluate_checkpoint(config)["version"] == 1
    assert evaluate_checkpoint(dataclasses.replace(
        config, eval=dataclasses.replace(config.eval, version=3)))["version"] == 3
    assert Predictor.load(config.checkpoint_path).source.startswith("version 1 of ")

    resumed = Trainer(dataclasses.replace(config, num_epochs=10)).run()
    assert (resumed.version, resumed.bucket_stats, resumed.best) == (3, [], result.best)


def test_a_better_version_replaces_the_one_in_best(ray_session, tmp_path):
    config = graph_with_validation(tmp_path, num_epochs=3, lr=0.1)
    result = Trainer(config).run()
    lines = [line["validation"] for line in
             CheckpointManager(config.checkpoint_path).read_stats() if "validation" in line]
    best = max(lines, key=lambda v: v["value"])
    assert result.best.version == best["version"]
    assert CheckpointManager(f"{config.checkpoint_path}/best").version() == best["version"]
    kept = {path.name for path in (tmp_path / "checkpoints" / "best").glob("*.h5")}
    assert kept and all(f".v{best['version']}.h5" in name for name in kept), kept


def test_validation_on_a_metric_sampled_ranking_lacks_is_refused_before_training(tmp_path):
    config = graph_with_validation(tmp_path)
    config = dataclasses.replace(config, validation=dataclasses.replace(
        config.validation, filtered=False, metric="hits@3"))
    with pytest.raises(PbgRayError, match=r"validation\.metric=hits@3 .* Set validation\.metric"):
        Trainer(config)
    assert not (tmp_path / "checkpoints").exists()


def test_the_train_commands_lines_name_the_best_and_predict_says_it_reads_it(
        ray_session, tmp_path, capsys):
    from pbg_ray.predict import main as predict
    from pbg_ray.train import run as train

    config = graph_with_validation(tmp_path, num_epochs=2, lr=0.0)
    train(config)
    out, err = capsys.readouterr()
    assert "validation after epoch 1: filtered mrr " in err
    assert "best on validation: filtered mrr " in out
    assert json.loads(out.splitlines()[-1])["best"]["version"] == 1

    question = ["score", "user-0-1", "follows", "user-0-2"]
    predict([config.checkpoint_path, *question])
    out, err = capsys.readouterr()
    assert err == (f"pbg_ray: reading version 1, the best on validation, kept in "
                   f"{config.checkpoint_path}/best (--version N reads another)\n")
    assert "score" in json.loads(out)
    predict([config.checkpoint_path, "--version", "2", *question])
    assert capsys.readouterr().err == ""


def test_filtered_validation_of_featurized_types_is_refused_and_null_picks_sampled(tmp_path):
    config = graph_with_validation(tmp_path)
    entities = dict(config.entities, tag=dataclasses.replace(config.entities["tag"],
                                                             featurized=True))
    featurized = dataclasses.replace(config, entities=entities)
    with pytest.raises(PbgRayError, match=r"\['tag'\] are featurized.*validation\.filtered=null"):
        Trainer(dataclasses.replace(featurized, validation=dataclasses.replace(
            config.validation, filtered=True)))
    assert Trainer(featurized).ranking == "sampled"


def test_a_rerun_reads_back_the_validations_of_its_metric_and_committed_versions():
    lines = [{"epoch_idx": 0, "index": 0, "stats": {}},
             {"validation": dataclasses.asdict(validation(1, 0.3))},
             {"validation": dataclasses.asdict(dataclasses.replace(validation(2, 0.9),
                                                                   metric="hits@10"))},
             {"validation": dataclasses.asdict(validation(3, 0.4))},
             {"validation": dataclasses.asdict(validation(4, 0.8))}]  # version 4: not committed
    selection = ModelSelection.of_stats(ValidationConfig(), lines, version=3)
    assert [v.epoch for v in selection.history] == [1, 3]
    assert selection.best == validation(3, 0.4)
