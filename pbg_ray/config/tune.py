"""The `tune` section of the config: what `python -m pbg_ray.tune` searches and how.

The search space maps config keys (dotted, as on the command line: `lr`,
`ray.num_trainers`, `relations.0.operator`) to Ray Tune sampling specs written as
plain YAML, so conf/tune/*.yaml and command-line overrides can declare them:

    search_space:
      lr: {loguniform: [0.01, 0.5]}
      dimension: {choice: [50, 100]}
      margin: 0.2                        # a fixed value

A key that changes nothing for the config at hand (IDLE_KEYS: `margin` without the ranking
loss, ...) is left out of the search, with a note saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from pbg_ray.config.options import Bounds, Fail, not_negative, one_of, option
from pbg_ray.config.pbg_file import IGNORED_KEYS

if TYPE_CHECKING:
    from pbg_ray.config.schema import ConfigSchema

# Sampler name -> number of arguments (None: a non-empty list of values).
SAMPLERS: Dict[str, Optional[int]] = {
    "uniform": 2, "loguniform": 2, "quniform": 3, "randint": 2, "lograndint": 2,
    "choice": None, "grid_search": None,
}
SCHEDULERS = ("asha", "fifo")
MODES = ("max", "min")
# What a trial reports after each epoch: PBG's sampled metrics on eval_edge_paths, the
# epoch's mean training loss and, with validation.edge_paths, validation.metric at the
# latest validation and at the best one so far (whose version best/ keeps).
VALIDATION_REPORTS = ("validation", "best_validation")
TRIAL_METRICS = ("mrr", "r1", "r10", "r50", "auc", "pos_rank", "loss") + VALIDATION_REPORTS
# Keys that change nothing for some configs: key -> (the keys that decide whether it acts,
# why it doesn't for a config, or None where it does).
IDLE_KEYS: Dict[str, Tuple[Tuple[str, ...], Callable[["ConfigSchema"], Optional[str]]]] = {
    "margin": (("loss_fn",), lambda c: None if c.loss_fn == "ranking" else
               f"the ranking loss's margin, and loss_fn={c.loss_fn}"),
    "regularizer": (("regularization_coef",), lambda c: None if c.regularization_coef > 0 else
                    "applied with regularization_coef above 0 only, and it is 0"),
    "relation_lr": (("relations", "global_emb"), lambda c: None if c.global_emb or any(
        r.operator != "none" for r in c.relations) else
        "no relation operator has parameters (all are none) and global_emb is false"),
    "num_batch_negs": (("relations",), lambda c: None if not all(
        r.all_negs for r in c.relations) else "every relation has all_negs=true"),
    "num_uniform_negs": (("relations",), lambda c: None if not all(
        r.all_negs for r in c.relations) else "every relation has all_negs=true"),
    "max_edges_per_chunk": (("num_edge_chunks",), lambda c: None if c.num_edge_chunks is None
                            else f"num_edge_chunks={c.num_edge_chunks} sets the chunks"),
    "hogwild_delay": ((), lambda c: None if int(c.ray.task_cpus()) >= 2 else
                      f"ray.cpus_per_trainer={c.ray.task_cpus():g} in a trial: one Hogwild "
                      "thread a task, so no warm-up"),
    "dimension": (("entities",), lambda c: None if any(
        e.dimension is None for e in c.entities.values()) else
        "every entity type sets its own dimension"),
    **{key: ((), lambda c, why=why: f"pbg_ray ignores it: {why}")
       for key, (_, why) in IGNORED_KEYS.items()},
}


def is_spec(value: Any) -> bool:
    """A sampling spec is a mapping with exactly one key, a sampler's name."""
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SAMPLERS


def flat_search_space(space: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{dotted config key: spec or fixed value}; nested mappings that are not specs
    (`ray: {num_trainers: {choice: [1, 2]}}`) name sub-keys."""
    flat: Dict[str, Any] = {}
    for key, value in space.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not is_spec(value):
            flat.update(flat_search_space(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def check_search_space(space: Dict[str, Any], key: str, fail: Fail) -> None:
    """The check of tune.search_space (`key`): no ray or tune key is searched, and every
    sampling spec is well formed (fixed values are checked with the trial's config)."""
    for name, spec in flat_search_space(space).items():
        where = f"{key}.{name}"
        if name.split(".")[0] in ("ray", "tune"):
            fail(where, "ray and tune settings can't be searched: every trial gets the same "
                 "resources and search", "Set them outside the search space, e.g. "
                 "ray.num_trainers=2.")
        if is_spec(spec):
            check_spec(where, spec, fail)


def check_spec(where: str, spec: Dict[str, Any], fail: Fail) -> None:
    """Refuse a malformed sampling spec of the key `where`."""
    (sampler, args), = spec.items()
    arity = SAMPLERS[sampler]
    if arity is None:
        if not isinstance(args, list) or not args:
            fail(where, f"{sampler} needs a non-empty list of values, got {args!r}",
                 f"Write {{{sampler}: [value, ...]}}.")
        return
    if (not isinstance(args, list) or len(args) != arity
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)):
        fail(where, f"{sampler} needs {arity} numbers, got {args!r}",
             f"Write {{{sampler}: [low, high{', q' if arity == 3 else ''}]}}.")
    if args[0] >= args[1]:
        fail(where, f"{sampler}'s low bound {args[0]} is not below its high bound {args[1]}",
             "Swap or widen the bounds.")
    if sampler.startswith("log") and args[0] <= 0:
        fail(where, f"{sampler} needs positive bounds, got {args!r}", "Use bounds above 0.")


def in_space(spec: Dict[str, Any], value: Any) -> bool:
    """Whether a sampling spec (is_spec) draws from around `value`: one of a choice's or a
    grid's values, within a range's bounds."""
    (sampler, args), = spec.items()
    if SAMPLERS[sampler] is None:
        return value in args
    return isinstance(value, (int, float)) and args[0] <= value <= args[1]


at_least_one = Bounds("must be at least 1", "Set {key} to 1 or more.", low=1)


@dataclass
class TuneConfig:
    """`python -m pbg_ray.tune`: a Ray Tune search over config keys, one engine run per trial."""

    search_space: Dict[str, Any] = option(factory=dict, check=check_search_space, help=
        "Config key -> sampling spec ({uniform|loguniform|randint|lograndint: [lo, hi]}, "
        "{quniform: [lo, hi, q]}, {choice|grid_search: [values]}) or a fixed value.")
    metric: Optional[str] = option(None, check=one_of(TRIAL_METRICS), help=
        "Reported after every epoch and compared between trials (see TRIAL_METRICS); null: "
        "best_validation where validation.edge_paths is set, else mrr (sampled, on "
        "eval_edge_paths).")
    mode: str = option("max", check=one_of(MODES), help=
        "Whether the best trial has the highest (max) or lowest (min) metric.")
    num_samples: int = option(1, check=at_least_one, help=
        "Trials sampled (each grid_search value is crossed with every sample).")
    config_first: bool = option(True, help=
        "The first sample takes the config's own values of the sampled keys (the config as "
        "given, e.g. a recipe, is one of the trials), so the best trial is never one the "
        "search found worse than its starting point; false: every sample drawn.")
    max_concurrent: Optional[int] = option(None, check=at_least_one.with_fix(
        "Set it to 1 or more, or null for no limit."), help=
        "Trials running at once; null: as many as the cluster's resources fit.")
    scheduler: str = option("asha", check=one_of(SCHEDULERS), help=
        '"asha" stops poor trials early (asynchronous successive halving over epochs); "fifo" '
        "runs every trial to num_epochs.")
    grace_period: Optional[int] = option(None, check=at_least_one.with_fix(
        "Set it to 1 or more, or null for a third of num_epochs."), help=
        "ASHA: epochs every trial runs before it may be stopped; null: a third of num_epochs "
        "(at least 1), so that a trial learns before it is compared.")
    reduction_factor: float = option(2.0, check=Bounds(
        "must be above 1", "Use e.g. 2 (half the trials go on at each rung) or 4.", low=1,
        low_open=True), help=
        "ASHA: 1 / reduction_factor of the trials go on at each rung.")
    driver_cpus: float = option(0.0, check=not_negative, help=
        "CPUs of each trial's driver (it only orchestrates: its train tasks take "
        "ray.cpus_per_trainer / ray.gpus_per_trainer each, ray.num_trainers of them).")
    storage_path: Optional[str] = option(None, location=True, help=
        "Ray Tune's storage (null: <checkpoint_path>-tune); rerunning with the same one "
        "resumes the experiment. Each trial's engine checkpoints go to "
        "<checkpoint_path>-<trial id>.")
    name: str = option("pbg_ray_tune", help=
        "The experiment's name: Ray Tune's experiment directory is <storage_path>/<name>.")
    max_failures: int = option(0, check=not_negative, help=
        "Times a failed trial is restarted from its last checkpoint.")


def search_metric(config: "ConfigSchema") -> str:
    """The metric the search compares trials on: tune.metric, or its default."""
    if config.tune.metric is not None:
        return config.tune.metric
    return "best_validation" if config.validation.edge_paths else "mrr"


def grace_period(config: "ConfigSchema") -> int:
    """The epochs every ASHA trial runs: tune.grace_period, or its default, at most
    num_epochs."""
    chosen = config.tune.grace_period or max(1, config.num_epochs // 3)
    return min(chosen, config.num_epochs)


def idle_keys(config: "ConfigSchema") -> Dict[str, str]:
    """The keys of config.tune.search_space that change nothing for `config` (IDLE_KEYS)
    -> why; a key stays searched when a key that decides it is searched too (margin
    with loss_fn)."""
    searched = flat_search_space(config.tune.search_space)
    idle = {}
    for key in searched.keys() & IDLE_KEYS.keys():
        deciding, why = IDLE_KEYS[key]
        if not any(s == d or s.startswith(f"{d}.") for s in searched for d in deciding):
            reason = why(config)
            if reason:
                idle[key] = reason
    return dict(sorted(idle.items()))
