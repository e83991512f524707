"""Ray Tune over the engine, for real, in the shared 2-CPU Ray."""

import json
import re

import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.config.tune import grace_period, idle_keys
from pbg_ray.errors import PbgRayError
from pbg_ray.tuning.tuner import (
    ResultLines, run_tune, search_space, starting_point, trial_config, trial_resources)
from tests.fault_injection import armed, edges_lost_or_doubled
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph


def tune_config(tmp_path, **tune) -> ConfigSchema:
    data = config_dict(tmp_path, num_epochs=2, dimension=8, eval_fraction=0.0,
                       eval_edge_paths=[str(tmp_path / "valid")], eval_num_batch_negs=10,
                       eval_num_uniform_negs=10, comparator="dot", loss_fn="softmax")
    data["tune"] = dict({"search_space": {"lr": {"grid_search": [0.02, 0.3]}}, "num_samples": 1,
                         "grace_period": 1}, **tune)
    return ConfigSchema.from_dict(data)


def test_search_space_and_resources_come_from_the_config(tmp_path, monkeypatch):
    config = tune_config(tmp_path, search_space={
        "lr": {"loguniform": [0.01, 0.5]}, "batch_size": 30,
        "relations": {"1": {"operator": {"choice": ["diagonal", "none"]}}}}, driver_cpus=0.5)
    space = search_space(config)
    assert set(space) == {"lr", "relations.1.operator", "batch_size"}
    assert 0.01 <= space["lr"].sample() <= 0.5 and space["batch_size"] == 30
    assert space["relations.1.operator"].categories == ["diagonal", "none"]
    trial = trial_config(config.to_dict(), {"lr": 0.2, "relations.1.operator": "none"}, "t1")
    assert trial.lr == 0.2 and trial.relations[1].operator == "none"
    assert trial.checkpoint_path == str(tmp_path / "checkpoints-t1")  # beside, not inside
    # Ray Tune refuses a relative storage_path: made absolute like the other paths.
    monkeypatch.chdir(tmp_path)
    relative = tune_config(tmp_path, storage_path="tune-runs").with_absolute_paths()
    assert relative.tune.storage_path == str(tmp_path / "tune-runs")
    config = ConfigSchema.from_dict(dict(config.to_dict(), ray={"num_trainers": 3,
                                                                "cpus_per_trainer": 2}))
    assert trial_resources(config).bundles == [{"CPU": 0.5}] + [{"CPU": 2.0}] * 3


@pytest.mark.parametrize("num_epochs, set_to, runs", [(9, None, 3), (2, None, 1), (3, 5, 3),
                                                     (9, 1, 1)])
def test_asha_lets_every_trial_learn_a_third_of_its_epochs_unless_told(tmp_path, num_epochs,
                                                                       set_to, runs):
    config = ConfigSchema.from_dict(dict(tune_config(tmp_path, grace_period=set_to).to_dict(),
                                         num_epochs=num_epochs))
    assert grace_period(config) == runs


def test_a_search_with_no_edges_to_measure_its_metric_on_is_refused_naming_the_keys(tmp_path):
    plain = dict(tune_config(tmp_path).to_dict(), eval_edge_paths=[])
    with pytest.raises(PbgRayError, match=r"tune\.metric=mrr is measured on eval_edge_paths, "
                                          r"which is empty\. Set validation\.edge_paths="):
        run_tune(ConfigSchema.from_dict(plain))
    plain["tune"]["metric"] = "best_validation"
    with pytest.raises(PbgRayError, match=r"measured on validation\.edge_paths, which is empty"):
        run_tune(ConfigSchema.from_dict(plain))


NONE_OPERATORS = [{"name": "likes", "lhs": "user", "rhs": "item", "operator": "none"}]


@pytest.mark.parametrize("overrides, space, idle", [
    # softmax: margin changes nothing, unless loss_fn is searched too
    ({}, {"margin": {"uniform": [0.05, 0.5]}}, {"margin": "loss_fn=softmax"}),
    ({}, {"margin": {"uniform": [0.05, 0.5]}, "loss_fn": {"choice": ["softmax", "ranking"]}},
     {}),
    ({"loss_fn": "ranking"}, {"margin": {"uniform": [0.05, 0.5]}}, {}),
    ({}, {"regularizer": "N3", "relation_lr": {"choice": [0.01, 0.1]}},
     {"regularizer": "regularization_coef above 0"}),
    # relation_lr reaches operator parameters and global embeddings only
    ({"relations": NONE_OPERATORS, "global_emb": False}, {"relation_lr": {"choice": [0.01, 0.1]}},
     {"relation_lr": "no relation operator has parameters"}),
    ({"relations": NONE_OPERATORS, "global_emb": False},
     {"relation_lr": {"choice": [0.01, 0.1]},
      "relations.0.operator": {"choice": ["none", "linear"]}},
     {}),
    ({"relations": [dict(NONE_OPERATORS[0], all_negs=True)]},
     {"num_batch_negs": {"choice": [5, 10]}}, {"num_batch_negs": "all_negs=true"}),
    ({"num_edge_chunks": 2}, {"max_edges_per_chunk": {"choice": [10, 20]}},
     {"max_edges_per_chunk": "num_edge_chunks=2"}),
    ({}, {"hogwild_delay": {"uniform": [0, 2]}}, {"hogwild_delay": "ray.cpus_per_trainer=1"}),
    ({"ray": {"cpus_per_trainer": 2}}, {"hogwild_delay": {"uniform": [0, 2]}}, {}),
    ({}, {"workers": {"choice": [1, 2]}}, {"workers": "pbg_ray ignores it"}),
])
def test_keys_that_change_nothing_for_the_config_are_left_out_of_the_search(
        tmp_path, overrides, space, idle):
    """One rule (config.tune.IDLE_KEYS) for the config at hand; a key stays searched where
    a key that decides it is searched too."""
    config = tune_config(tmp_path, search_space=dict(space, lr={"loguniform": [0.01, 0.5]}))
    config = ConfigSchema.from_dict(dict(config.to_dict(), **overrides))
    found = idle_keys(config)
    assert set(found) == set(idle)
    assert all(part in found[key] for key, part in idle.items()), found
    assert set(search_space(config)) == {"lr", *space} - set(idle)


def test_the_first_sample_is_the_config_itself_unless_told(tmp_path):
    """tune.config_first: the config's own values of the sampled keys, dotted ones
    included; fixed values and grids are not samples."""
    config = tune_config(tmp_path, search_space={
        "lr": {"loguniform": [0.01, 0.5]}, "batch_size": 30, "dimension": {"grid_search": [4, 8]},
        "relations": {"0": {"operator": {"choice": ["diagonal", "none"]}}}})
    config = ConfigSchema.from_dict(dict(config.to_dict(), lr=0.123))
    assert starting_point(config) == {"lr": 0.123,
                                      "relations.0.operator": config.relations[0].operator}
    off = dict(config.to_dict())
    off["tune"]["config_first"] = False
    assert starting_point(ConfigSchema.from_dict(off)) == {}
    grid_only = tune_config(tmp_path)  # lr: grid_search
    assert starting_point(grid_only) == {}


def test_a_first_trial_outside_the_space_is_said_before_the_search(tmp_path, capsys):
    """The config's own value of a sampled key that its space cannot draw (the quality
    recipe's batch_size 100 in {choice: [500, 1000]}): the first trial alone trains it,
    which the search says in a line of its own, naming the space that searches around it."""
    config = tune_config(tmp_path, num_samples=3, search_space={
        "lr": {"loguniform": [0.01, 0.5]}, "batch_size": {"choice": [500, 1000]}})
    config = ConfigSchema.from_dict(dict(config.to_dict(), batch_size=100))
    ResultLines(config).setup(total_num_samples=3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"the first trial trains the config's own values: lr={config.lr} "
                        "batch_size=100 (tune.config_first)")
    assert lines[2:] == [
        "batch_size=100 is outside its search space {choice: [500, 1000]}: the first trial "
        "alone trains it, the others nothing near it; a space around it searches what the "
        "config sets (conf/tune/quality.yaml: around the quality recipe)"]


@pytest.mark.parametrize("tune, message", [
    ({"search_space": {"lrr": {"uniform": [0.1, 0.2]}}}, "unknown key 'lrr' (did you mean 'lr'?)"),
    ({"search_space": {"lr": {"uniform": [0.2, 0.1]}}}, "low bound 0.2 is not below"),
    ({"search_space": {"ray": {"num_trainers": {"choice": [1, 2]}}}}, "can't be searched"),
    ({"metric": "mmr"}, "unknown value 'mmr' (did you mean 'mrr'?)"),
    ({"reduction_factor": 1}, "tune.reduction_factor: must be above 1"),
])
def test_bad_tune_settings_are_refused_naming_the_key(tmp_path, tune, message):
    with pytest.raises(PbgRayError, match=re.escape(message)):
        tune_config(tmp_path, **tune)


def test_tune_without_held_out_edges_is_refused(tmp_path):
    config = ConfigSchema.from_dict(dict(tune_config(tmp_path).to_dict(), eval_edge_paths=[]))
    with pytest.raises(PbgRayError, match="eval_edge_paths, which is empty"):
        run_tune(config)


@pytest.mark.slow
def test_tune_reports_every_epoch_and_returns_the_best_checkpoint_with_its_best_version(
        ray_session, tmp_path):
    """With validation.edge_paths, trials are compared on their best validation (the
    default tune.metric), and the best trial's best version is named and kept."""
    config = ConfigSchema.from_dict(dict(tune_config(tmp_path).to_dict(), validation={
        "edge_paths": [str(tmp_path / "valid")]}))
    write_random_graph(config, num_edges=200)
    write_random_graph(ConfigSchema.from_dict(
        dict(config.to_dict(), edge_paths=[str(tmp_path / "valid")])), num_edges=40, seed=1)
    best = run_tune(config)

    trial_dirs = sorted((tmp_path / "checkpoints-tune" / "pbg_ray_tune").glob("run_trial_*"))
    assert len(trial_dirs) == 2
    epochs_reported = []
    for trial_dir in trial_dirs:
        results = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
        # One report per epoch, each with held-out MRR and a checkpoint; ASHA may stop
        # the worse trial after its first epoch.
        assert [r["epoch"] for r in results] == list(range(1, len(results) + 1))
        assert all(0 < r["mrr"] <= 1 and r["loss"] > 0 for r in results)
        assert all(0 < r["validation"] <= r["best_validation"] <= 1 for r in results)
        assert [r["best_validation"] for r in results] == sorted(r["best_validation"]
                                                                 for r in results)
        assert all(r["checkpoint_dir_name"] for r in results)
        epochs_reported.append(len(results))
    assert max(epochs_reported) == 2

    assert best["config"]["lr"] in (0.02, 0.3)
    assert best["checkpoint_path"] == str(tmp_path / f"checkpoints-{best['trial_id']}")
    best_config = ConfigSchema.from_dict(dict(config.to_dict(), checkpoint_path=best["checkpoint_path"],
                                              lr=best["config"]["lr"]))
    assert_valid_checkpoint(best_config, best["version"])
    assert CheckpointStorage(f"{best['checkpoint_path']}/best").load_version() == \
        best["metrics"]["best_version"]
    assert best["metrics"]["best_validation"] == max(
        r["best_validation"] for trial_dir in trial_dirs for r in
        map(json.loads, (trial_dir / "result.json").read_text().splitlines()))
    trial_config_file = tmp_path / f"checkpoints-{best['trial_id']}" / "config.json"
    assert json.loads(trial_config_file.read_text())["lr"] == best["config"]["lr"]

    # The same command again resumes the finished experiment: nothing is retrained.
    again = run_tune(config)
    assert again["checkpoint_path"] == best["checkpoint_path"]
    assert CheckpointStorage(best["checkpoint_path"]).load_version() == best["version"]


@pytest.mark.faults
@pytest.mark.slow
def test_a_failed_trial_restarts_from_its_newest_version_and_the_sweep_finds_the_same_best(
        ray_session, tmp_path):
    """tune.max_failures: Tune starts a trial whose process died again, and the trial goes
    on from its engine checkpoint's newest version, training each bucket once; the sweep
    ends with the trials' results, and so the best trial, of the same sweep undisturbed."""
    config = tune_config(tmp_path, scheduler="fifo", max_failures=1)
    config = ConfigSchema.from_dict(dict(config.to_dict(), num_epochs=3))
    write_random_graph(config, num_edges=200)
    write_random_graph(ConfigSchema.from_dict(
        dict(config.to_dict(), edge_paths=[str(tmp_path / "valid")])), num_edges=40, seed=1)
    undisturbed_dir = tmp_path / "undisturbed"
    undisturbed_dir.mkdir()
    undisturbed = run_tune(ConfigSchema.from_dict(
        dict(config.to_dict(), checkpoint_path=str(undisturbed_dir / "checkpoints"))))

    # A trial's process is killed about to report its epoch 2 (it reported epoch 1, with
    # its Tune checkpoint, and trained epoch 2).
    with armed("tune.report", hits=2) as fired:
        best = run_tune(config)
    assert fired()

    def last_results(experiment):
        last = {}
        for result_file in experiment.glob("run_trial_*/result.json"):
            results = [json.loads(line) for line in result_file.read_text().splitlines()]
            assert [r["epoch"] for r in results][-1] == 3
            last[results[-1]["config"]["lr"]] = results[-1]
        return last

    disturbed = last_results(tmp_path / "checkpoints-tune" / "pbg_ray_tune")
    expected = last_results(undisturbed_dir / "checkpoints-tune" / "pbg_ray_tune")
    assert set(disturbed) == set(expected) == {0.02, 0.3}
    for lr, result in disturbed.items():
        assert result["mrr"] == pytest.approx(expected[lr]["mrr"], abs=1e-6), lr
        assert result["loss"] == pytest.approx(expected[lr]["loss"], rel=1e-5), lr
    assert best["config"] == undisturbed["config"]
    assert best["metrics"]["mrr"] == pytest.approx(undisturbed["metrics"]["mrr"], abs=1e-6)
    assert best["version"] == 3
    # Every trial, the restarted one too, trained each bucket of each epoch once.
    trial_dirs = {json.loads((p / "config.json").read_text())["lr"]: p
                  for p in tmp_path.glob("checkpoints-*") if (p / "config.json").is_file()}
    assert set(trial_dirs) == {0.02, 0.3}
    for lr, trial_dir in trial_dirs.items():
        trial = ConfigSchema.from_dict(dict(config.to_dict(), checkpoint_path=str(trial_dir),
                                            lr=lr))
        assert edges_lost_or_doubled(trial) == 0
        assert_valid_checkpoint(trial, 3)
