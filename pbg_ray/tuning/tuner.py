"""Ray Tune over training: one trial = one training run of a sampled config.

Each trial trains with `Trainer` under its own checkpoint_path (`<checkpoint_path>-<trial
id>`, beside the configured one), and after every epoch reports the held-out metrics
(PBG's sampled metrics on eval_edge_paths, and the epoch's mean training loss) with a Tune
checkpoint naming the training run's checkpoint, so ASHA can stop poor trials and a restarted or
resumed trial goes on from its run's newest version. A trial's resources are one
placement group: an optional driver bundle plus one bundle per train task
(ray.num_trainers x ray.cpus_per_trainer / gpus_per_trainer); the train and evaluation
tasks it starts run inside it, and the trainer's actors ask for no CPU. The search prints
what it searches, a line per trial result (ResultLines) and how the trials ended; Ray
Tune's own tables and the trials' pass lines show with `verbose` only.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
from typing import Any, Dict, List, Mapping

from omegaconf import OmegaConf
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.search.sample import Domain

from pbg_ray.config import ConfigSchema
from pbg_ray.config.tune import (
    TRIAL_METRICS, VALIDATION_REPORTS, flat_search_space, grace_period, idle_keys, in_space,
    is_spec, search_metric)
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.metrics import stats_mean
from pbg_ray.io.storage import join, sibling
from pbg_ray.runtime.connect import check_cpus_per_trainer
from pbg_ray.runtime.faults import fault_point
from pbg_ray.training.bucket_task import gpus_per_trainer
from pbg_ray.training.stats import TRAIN, as_sums, epoch_means
from pbg_ray.training.trainer import Trainer

logger = logging.getLogger("pbg_ray")

ENGINE_FILE = "pbg_ray_checkpoint.json"  # inside each Tune checkpoint: where the run's checkpoint is


def search_space(config: ConfigSchema) -> Dict[str, Any]:
    """Tune's param_space: {dotted config key: Tune sampler or fixed value}, without the
    keys that change nothing for `config` (idle_keys)."""
    space = {}
    idle = idle_keys(config)
    for key, spec in flat_search_space(config.tune.search_space).items():
        if key in idle:
            continue
        if is_spec(spec):
            (sampler, args), = spec.items()
            fn = getattr(tune, sampler)
            spec = fn(args) if sampler in ("choice", "grid_search") else fn(*args)
        space[key] = spec
    return space


def starting_point(config: ConfigSchema) -> Dict[str, Any]:
    """The config's own values of the keys its search samples (tune.config_first): the
    first sample's, crossed with any grid_search as a sample is; empty when
    tune.config_first is off or nothing is sampled."""
    if not config.tune.config_first:
        return {}
    values = OmegaConf.create(config.to_dict())
    return {key: OmegaConf.select(values, key, throw_on_missing=True)
            for key, spec in search_space(config).items() if isinstance(spec, Domain)}


def trial_resources(config: ConfigSchema) -> tune.PlacementGroupFactory:
    """One trial's placement group: its driver, then one bundle per train task."""
    trainer = {"CPU": config.ray.task_cpus(), "GPU": gpus_per_trainer(config)}
    return tune.PlacementGroupFactory(
        [{"CPU": config.tune.driver_cpus}] + [trainer] * (config.ray.num_trainers or 1))


def trial_config(base: Dict[str, Any], sampled: Mapping[str, Any], trial_id: str) -> ConfigSchema:
    """The base config with the trial's sampled keys, in its own checkpoint and TensorBoard
    directories: the base ones with the trial's id appended."""
    cfg = OmegaConf.create(base)
    for key, value in sampled.items():
        OmegaConf.update(cfg, key, value, merge=False)
    data = OmegaConf.to_container(cfg)
    data["checkpoint_path"] = sibling(base["checkpoint_path"], trial_id)
    if base.get("tensorboard_dir"):
        data["tensorboard_dir"] = sibling(base["tensorboard_dir"], trial_id)
    return ConfigSchema.from_dict(data, source=f"trial {trial_id}")


def held_out_metrics(trainer: Trainer, epoch_idx: int) -> Dict[str, float]:
    """What a trial reports after an epoch: the epoch's mean training loss and PBG's
    sampled metrics over all of eval_edge_paths, with the current embeddings."""
    metrics = {"epoch": epoch_idx + 1, "version": trainer.version}
    train = epoch_means(trainer.checkpoints.read_stats(), TRAIN).get(epoch_idx, {})
    if "loss" in train:
        metrics["loss"] = train["loss"]
    held_out = []  # {"count", mean metrics} per path -> one edge-weighted mean
    for path in trainer.config.eval_edge_paths:
        means = trainer.evaluate(path)
        count = means.pop("count")
        if count:
            held_out.append(as_sums(count, means))
    selection = trainer.selection
    if selection.history:
        metrics.update(validation=selection.history[-1].value,
                       best_validation=selection.best.value, best_version=selection.best.version)
    return {**metrics, **stats_mean(held_out)}


def result_line(trial_id: str, result: Mapping[str, Any], sampled: Mapping[str, Any],
                config: ConfigSchema) -> str:
    """A trial's line after an epoch: the metric searched on first, the training loss,
    the trial's sampled keys, and whether the scheduler stopped it there."""
    metric = search_metric(config)
    shown = [metric] + ["loss"] * (metric != "loss" and "loss" in result)
    values = "  ".join(f"{key}={result[key]:.4g}" for key in shown)
    keys = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in sampled.items())
    stopped = (" (stopped early by ASHA)"
               if result.get("done") and result["epoch"] < config.num_epochs else "")
    return (f"trial {trial_id} epoch {result['epoch']}/{config.num_epochs}: {values}"
            f"  | {keys}{stopped}")


class ResultLines(tune.Callback):
    """What a search prints as it runs (in place of Ray Tune's tables): what it searches
    and what it leaves out, a line per trial result, and how the trials ended."""

    def __init__(self, config: ConfigSchema) -> None:
        self.config = config

    def setup(self, total_num_samples: int = 0, **info: Any) -> None:
        config, settings = self.config, self.config.tune
        idle = idle_keys(config)
        searched = [k for k in flat_search_space(settings.search_space) if k not in idle]
        metric = search_metric(config)
        measured = ("the epoch's training loss" if metric == "loss"
                    else f"{config.validation.metric} on validation.edge_paths"
                    if metric in VALIDATION_REPORTS else "on eval_edge_paths")
        stops = (f"ASHA stops the poor ones early (from epoch {grace_period(config)} on)"
                 if settings.scheduler == "asha"
                 else "each runs them all")
        print(f"{total_num_samples} trials of {', '.join(searched) or 'the config as it is'}: "
              f"each reports {metric} ({measured}) after each of its "
              f"{config.num_epochs} epochs; {stops}", flush=True)
        start = starting_point(config)
        if start:
            print("the first trial trains the config's own values: " + " ".join(
                f"{k}={v}" for k, v in start.items()) + " (tune.config_first)", flush=True)
        space = flat_search_space(settings.search_space)
        for key, value in start.items():
            if not in_space(space[key], value):
                (sampler, args), = space[key].items()
                print(f"{key}={value} is outside its search space {{{sampler}: {args}}}: "
                      "the first trial alone trains it, the others nothing near it; a space "
                      "around it searches what the config sets (conf/tune/quality.yaml: "
                      "around the quality recipe)", flush=True)
        for key, why in idle.items():
            print(f"{key} is left out of the search: it changes nothing here ({why})",
                  flush=True)

    def on_trial_result(self, iteration: int, trials: List[Any], trial: Any,
                        result: Dict[str, Any], **info: Any) -> None:
        print(result_line(trial.trial_id, result, trial.config, self.config), flush=True)

    def on_trial_recover(self, iteration: int, trials: List[Any], trial: Any,
                         **info: Any) -> None:
        print(f"trial {trial.trial_id} failed after epoch {last_epoch(trial)}; it starts "
              "again from its checkpoint (tune.max_failures)", flush=True)

    def on_trial_error(self, iteration: int, trials: List[Any], trial: Any,
                       **info: Any) -> None:
        print(f"trial {trial.trial_id} failed after epoch {last_epoch(trial)} (its error "
              "follows at the end)", flush=True)

    def on_experiment_end(self, trials: List[Any], **info: Any) -> None:
        num_epochs, settings = self.config.num_epochs, self.config.tune
        ended = collections.Counter(
            "failed" if t.status == "ERROR" else "unfinished" if t.status != "TERMINATED"
            else f"ran all {num_epochs} epochs" if last_epoch(t) == num_epochs
            else "stopped early" for t in trials)
        hows = [f"ran all {num_epochs} epochs", "stopped early"]
        counts = [f"{ended[how]} {how}" for how in hows + [h for h in ("failed", "unfinished")
                                                           if ended[h]]]
        print(f"{len(trials)} trials: {', '.join(counts)}; the best has the "
              f"{'highest' if settings.mode == 'max' else 'lowest'} "
              f"{search_metric(self.config)} at its last epoch (which its checkpoint holds)",
              flush=True)


def last_epoch(trial: Any) -> int:
    """The last epoch a Tune trial reported (0: none)."""
    return (trial.last_result or {}).get("epoch", 0)


def run_trial(sampled: Dict[str, Any], base: Dict[str, Any]) -> None:
    """Tune's function trainable: train the sampled config, reporting after every epoch."""
    trial_id = tune.get_context().get_trial_id()
    config = trial_config(base, sampled, trial_id)
    if not config.verbose:  # Ray's line per Tune checkpoint
        logging.getLogger("ray.train").setLevel(logging.WARNING)
    restored = tune.get_checkpoint()
    if restored is not None:  # a restarted or resumed trial: go on from its run's version
        with restored.as_directory() as directory:
            with open(os.path.join(directory, ENGINE_FILE)) as f:
                path = json.load(f)["checkpoint_path"]
        config = ConfigSchema.from_dict(dict(config.to_dict(), checkpoint_path=path),
                                        source=f"trial {trial_id}")
    trainer = Trainer(config)
    trainer.progress = bool(config.verbose)  # ResultLines prints a line per epoch

    def report(epoch_idx: int) -> None:
        metrics = held_out_metrics(trainer, epoch_idx)
        fault_point("tune.report")
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, ENGINE_FILE), "w") as f:
                json.dump({"checkpoint_path": config.checkpoint_path, "version": trainer.version}, f)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))

    if not trainer.run(on_epoch_end=report).bucket_stats and trainer.version > 0:
        report(config.num_epochs - 1)  # already trained: report where it stands


def run_tune(config: ConfigSchema) -> Dict[str, Any]:
    """Run the search of config.tune on the connected Ray; returns the best trial:
    {"trial_id", "config" (its sampled keys), "metrics", "checkpoint_path", "version",
    "experiment_path"}. Rerunning with the same experiment directory resumes it."""
    config = config.checked()
    settings = config.tune
    metric = search_metric(config)
    if metric in VALIDATION_REPORTS and not config.validation.edge_paths:
        raise PbgRayError(
            f"tune.metric={metric} is measured on validation.edge_paths, which is empty. Set "
            "validation.edge_paths=[<validation edges>], or tune on another tune.metric.")
    if metric not in VALIDATION_REPORTS + ("loss",) and not config.eval_edge_paths:
        raise PbgRayError(
            f"tune.metric={metric} is measured on eval_edge_paths, which is empty. "
            "Set validation.edge_paths=[<validation edges>] (and tune.metric=null), or "
            "eval_edge_paths=[<held-out edges>], or tune on tune.metric=loss tune.mode=min.")
    check_cpus_per_trainer(config.ray)
    base = config.to_dict()
    # What the placement group fits (trial_resources).
    base["ray"]["num_trainers"] = config.ray.num_trainers or 1
    base["ray"]["cpus_per_trainer"] = config.ray.task_cpus()
    trainable = tune.with_resources(tune.with_parameters(run_trial, base=base),
                                    trial_resources(config))
    storage_path = settings.storage_path or sibling(config.checkpoint_path, "tune")
    experiment_path = join(storage_path, settings.name)
    if tune.Tuner.can_restore(experiment_path):
        logger.warning("resuming the Ray Tune experiment in %s", experiment_path)
        tuner = tune.Tuner.restore(experiment_path, trainable, resume_errored=True)
    else:
        if settings.scheduler == "asha":
            # time_attr "epoch" (not Tune's report count) stays right for resumed trials.
            scheduler = ASHAScheduler(time_attr="epoch", max_t=config.num_epochs,
                                      grace_period=grace_period(config),
                                      reduction_factor=settings.reduction_factor)
        else:
            scheduler = FIFOScheduler()
        start = starting_point(config)
        tuner = tune.Tuner(
            trainable, param_space=search_space(config),
            tune_config=tune.TuneConfig(
                search_alg=BasicVariantGenerator(points_to_evaluate=[start] if start else None),
                metric=metric, mode=settings.mode, num_samples=settings.num_samples,
                max_concurrent_trials=settings.max_concurrent, scheduler=scheduler),
            run_config=tune.RunConfig(
                name=settings.name, storage_path=storage_path, callbacks=[ResultLines(config)],
                verbose=2 if config.verbose else 0,
                failure_config=tune.FailureConfig(max_failures=settings.max_failures)))
    # Tune's legacy output, which prints nothing at verbose=0 (the new one still prints a
    # table of the experiment): ResultLines prints what the search does.
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    results = tuner.fit()
    for error in results.errors:
        logger.warning("a trial failed: %s", error)
    try:
        best = results.get_best_result(metric, settings.mode, scope="last")
    except RuntimeError:
        best = None
    if best is None or best.checkpoint is None:
        first = f" The first error: {results.errors[0]}" if results.errors else ""
        raise PbgRayError(f"no trial of {experiment_path} reported {metric}.{first}")
    with best.checkpoint.as_directory() as directory:
        with open(os.path.join(directory, ENGINE_FILE)) as f:
            engine = json.load(f)
    reported = ("epoch", "version", "best_version", *TRIAL_METRICS)  # Tune adds bookkeeping keys of its own
    return {"trial_id": best.metrics["trial_id"], "config": dict(best.config),
            "metrics": {k: best.metrics[k] for k in reported if k in best.metrics},
            "checkpoint_path": engine["checkpoint_path"], "version": engine["version"],
            "experiment_path": experiment_path}
