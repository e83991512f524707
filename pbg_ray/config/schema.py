"""The one config schema: PBG's key names, defaults and meanings, plus a `ray` section.

A PBG user's config dict (or PBG config module, see `load_pbg_config_file`)
carries over unchanged. Every source of configuration (Hydra, a PBG module,
a checkpoint's config.json) goes through `ConfigSchema.from_dict`, which
refuses unknown keys and wrong types with a `PbgRayError` naming the key, and
then through `ConfigSchema.validate` for the rules that span several keys.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pbg_ray.config.eval import EvalConfig
from pbg_ray.config.export import ExportConfig
from pbg_ray.config.importer import ImportConfig
from pbg_ray.config.incremental import NEW_ROWS_INITS, IncrementalConfig
from pbg_ray.config.tune import TuneConfig, flat_search_space
from pbg_ray.errors import PbgRayError, did_you_mean

logger = logging.getLogger("pbg_ray")

BUCKET_ORDERS = ("random", "affinity", "inside_out", "outside_in")
PLACEMENTS = ("memory", "disk")

# Keys of torchbiggraph's config that describe how *it* distributes work. Ray
# takes that role here, so they are accepted (a PBG config loads unchanged)
# and ignored, with a note saying what replaces them.
PBG_ONLY_KEYS = {
    "background_io": "partition I/O overlaps training through Ray's object store",
    "hogwild_delay": "train tasks start as Ray schedules them",
    "num_machines": "the Ray cluster decides the machines (ray.address)",
    "num_partition_servers": "partitions live in Ray actors (ray.placement)",
    "distributed_init_method": "Ray connects the processes (ray.address)",
    "distributed_tree_init_order": "the bucket scheduler actor orders buckets",
}


@dataclass
class EntitySchema:
    """One entity type."""

    # Number of partitions of this type; 1 means unpartitioned. All
    # partitioned types share one count.
    num_partitions: int = 1
    # Entities are represented as bags of features (edges then carry
    # lhsd/rhsd feature lists instead of plain ids).
    featurized: bool = False
    # Overrides the global `dimension` for this type.
    dimension: Optional[int] = None


@dataclass
class RelationSchema:
    """One relation type; its id in the edge files is its index in `relations`."""

    name: str = MISSING
    lhs: str = MISSING
    rhs: str = MISSING
    # Multiplies the loss of this relation's edges.
    weight: float = 1.0
    # Transformation applied to the rhs embedding before comparison.
    operator: str = "none"
    # Negatives are all the entities of the partition, not a sample.
    all_negs: bool = False


@dataclass
class RayConfig:
    """Where and how the work runs. None of this changes the model."""

    # None starts a local Ray; "auto" joins the cluster `ray up` started.
    address: Optional[str] = None
    # CPUs of a local Ray started by pbg_ray (None: all of the machine's).
    num_cpus: Optional[int] = None
    # Bytes of object store for a local Ray (None: Ray's default).
    object_store_memory: Optional[int] = None
    # Train tasks running at once (None: as many as partitions and CPUs allow).
    num_trainers: Optional[int] = None
    # Resources each train task asks Ray for.
    cpus_per_trainer: float = 1.0
    gpus_per_trainer: float = 0.0
    # "memory": partitions live in partition-store actors spread over the
    # cluster; "disk": partitions are swapped to checkpoint storage, so one
    # machine trains tables larger than its RAM.
    placement: str = "memory"
    # Partition-store actors (None: one per node, at most one per partition).
    num_partition_stores: Optional[int] = None


@dataclass
class ConfigSchema:
    """A whole run. Keys and meanings are PBG's (torchbiggraph.config)."""

    # --- model ---
    entities: Dict[str, EntitySchema] = MISSING
    relations: List[RelationSchema] = MISSING
    dimension: int = MISSING
    init_scale: float = 1e-3
    max_norm: Optional[float] = None
    global_emb: bool = True
    comparator: str = "cos"
    bias: bool = False
    loss_fn: str = "ranking"
    margin: float = 0.1
    regularization_coef: float = 0.0
    regularizer: str = "N3"

    # --- data ---
    entity_path: str = MISSING
    edge_paths: List[str] = MISSING
    checkpoint_path: str = MISSING
    init_path: Optional[str] = None
    # pbg_ray extension: edge paths held out from training, evaluated after
    # training (PBG's sampled metrics), e.g. a test split.
    eval_edge_paths: List[str] = field(default_factory=list)
    checkpoint_preservation_interval: Optional[int] = None
    # pbg_ray extension: write TensorBoard scalars (loss and held-out metrics per bucket
    # and per epoch) into this directory; null: don't.
    tensorboard_dir: Optional[str] = None

    # --- training ---
    num_epochs: int = 1
    num_edge_chunks: Optional[int] = None
    max_edges_per_chunk: int = 1_000_000_000
    bucket_order: str = "inside_out"
    workers: Optional[int] = None
    batch_size: int = 1000
    num_batch_negs: int = 50
    num_uniform_negs: int = 50
    disable_lhs_negs: bool = False
    disable_rhs_negs: bool = False
    lr: float = 1e-2
    relation_lr: Optional[float] = None
    eval_fraction: float = 0.05
    eval_num_batch_negs: int = 1000
    eval_num_uniform_negs: int = 1000

    # --- expert ---
    dynamic_relations: bool = False
    num_gpus: int = 0
    half_precision: bool = False
    verbose: int = 0

    ray: RayConfig = field(default_factory=RayConfig)
    # python -m pbg_ray.import_edges / python -m pbg_ray.export
    importer: ImportConfig = field(default_factory=ImportConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # python -m pbg_ray.eval
    eval: EvalConfig = field(default_factory=EvalConfig)
    # python -m pbg_ray.tune
    tune: TuneConfig = field(default_factory=TuneConfig)
    # training a grown graph from init_path (pbg_ray/incremental)
    incremental: IncrementalConfig = field(default_factory=IncrementalConfig)

    # ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> "ConfigSchema":
        """Build and validate a config from plain dicts/lists (PBG's layout).

        `source` names where the dict came from, for error messages.
        """
        if not isinstance(data, dict):
            raise PbgRayError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        config = _convert(drop_pbg_only_keys(data, source), cls, "", source)
        config.validate(source)
        return config

    def to_dict(self) -> Dict[str, Any]:
        """Plain dicts and lists, as written to config.json."""
        return dataclasses.asdict(self)

    def with_absolute_paths(self) -> "ConfigSchema":
        """Local paths made absolute (URIs kept), so that Ray workers, whose
        working directory differs from the driver's, find the same files."""

        def absolute(path: Optional[str]) -> Optional[str]:
            if path is None or "://" in path:
                return path
            return os.path.abspath(os.path.expanduser(path))

        return dataclasses.replace(
            self, entity_path=absolute(self.entity_path),
            edge_paths=[absolute(p) for p in self.edge_paths],
            eval_edge_paths=[absolute(p) for p in self.eval_edge_paths],
            checkpoint_path=absolute(self.checkpoint_path), init_path=absolute(self.init_path),
            tensorboard_dir=absolute(self.tensorboard_dir),
            eval=dataclasses.replace(
                self.eval, edge_paths=[absolute(p) for p in self.eval.edge_paths],
                filter_paths=None if self.eval.filter_paths is None
                else [absolute(p) for p in self.eval.filter_paths]),
            tune=dataclasses.replace(self.tune, storage_path=absolute(self.tune.storage_path)))

    def entity_dimension(self, entity: str) -> int:
        dim = self.entities[entity].dimension
        return self.dimension if dim is None else dim

    def num_partitions(self) -> int:
        """The partition count shared by all partitioned entity types (1 if none)."""
        return max(e.num_partitions for e in self.entities.values())

    def validate(self, source: str = "config") -> None:
        """Rules that span several keys. Raises PbgRayError naming the key."""

        def fail(key: str, problem: str, fix: str) -> None:
            raise PbgRayError(f"{source}: {key}: {problem}. {fix}")

        # The model's registries are the one list of valid component names.
        from pbg_ray.model.comparators import COMPARATORS
        from pbg_ray.model.losses import LOSS_FUNCTIONS
        from pbg_ray.model.operators import OPERATORS
        from pbg_ray.model.regularizers import REGULARIZERS

        if not self.entities:
            fail("entities", "no entity types are defined", "Add at least one entity type.")
        if not self.relations:
            fail("relations", "no relation types are defined", "Add at least one relation type.")
        for key in ("entity_path", "checkpoint_path"):
            if not getattr(self, key):
                fail(key, "this path is required", f"Set {key}=<directory>.")
        if not self.edge_paths:
            fail("edge_paths", "this path is required", "Set edge_paths=[<directory>, ...].")
        _positive(self.dimension, "dimension", fail)
        for name, entity in self.entities.items():
            _positive(entity.num_partitions, f"entities.{name}.num_partitions", fail)
            if entity.dimension is not None:
                _positive(entity.dimension, f"entities.{name}.dimension", fail)
        counts = {e.num_partitions for e in self.entities.values()} - {1}
        if len(counts) > 1:
            detail = ", ".join(f"{n}={e.num_partitions}" for n, e in self.entities.items())
            fail("entities.*.num_partitions",
                 f"partition counts don't broadcast ({detail})",
                 "All partitioned entity types must have the same number of partitions "
                 "(unpartitioned types use 1).")
        for idx, rel in enumerate(self.relations):
            key = f"relations[{idx}]"
            for side in ("lhs", "rhs"):
                entity = getattr(rel, side)
                if entity not in self.entities:
                    fail(f"{key}.{side}",
                         f"relation {rel.name!r} uses unknown entity type {entity!r}"
                         f"{did_you_mean(entity, self.entities)}",
                         f"Use one of {sorted(self.entities)} or add it to entities.")
            _choice(rel.operator, OPERATORS.names(), f"{key}.operator", fail)
            if self.regularization_coef > 0 and OPERATORS.get(rel.operator).reg_params is None:
                fail(f"{key}.operator",
                     f"the {self.regularizer} regularizer can't be applied to the "
                     f"{rel.operator!r} operator",
                     "Use another operator or set regularization_coef=0.")
            _positive(rel.weight, f"{key}.weight", fail)
            if rel.operator == "complex_diagonal":
                for entity in {rel.lhs, rel.rhs}:
                    if entity in self.entities and self.entity_dimension(entity) % 2:
                        fail(f"{key}.operator",
                             f"complex_diagonal needs an even dimension, entity type "
                             f"{entity!r} has {self.entity_dimension(entity)}",
                             "Use an even dimension or another operator.")
            if rel.operator in ("linear", "affine", "complex_diagonal", "diagonal", "translation"):
                if self.entity_dimension(rel.lhs) != self.entity_dimension(rel.rhs):
                    fail(f"{key}.operator",
                         f"lhs {rel.lhs!r} and rhs {rel.rhs!r} have different dimensions",
                         "Give both entity types the same dimension.")
        _choice(self.comparator, COMPARATORS.names(), "comparator", fail)
        _choice(self.loss_fn, LOSS_FUNCTIONS.names(), "loss_fn", fail)
        _choice(self.regularizer, REGULARIZERS.names(), "regularizer", fail)
        _choice(self.bucket_order, BUCKET_ORDERS, "bucket_order", fail)
        _choice(self.ray.placement, PLACEMENTS, "ray.placement", fail)
        _positive(self.batch_size, "batch_size", fail)
        _positive(self.num_epochs + 1, "num_epochs", fail)  # 0 epochs is allowed
        _positive(self.max_edges_per_chunk, "max_edges_per_chunk", fail)
        _positive(self.init_scale, "init_scale", fail)
        if self.num_edge_chunks is not None:
            _positive(self.num_edge_chunks, "num_edge_chunks", fail)
        if self.checkpoint_preservation_interval is not None:
            _positive(self.checkpoint_preservation_interval, "checkpoint_preservation_interval", fail)
        if self.workers is not None:
            _positive(self.workers, "workers", fail)
        if self.max_norm is not None:
            _positive(self.max_norm, "max_norm", fail)
        for key in ("num_batch_negs", "num_uniform_negs", "eval_num_batch_negs",
                    "eval_num_uniform_negs", "num_gpus", "verbose", "lr", "regularization_coef"):
            if getattr(self, key) < 0:
                fail(key, f"must not be negative, got {getattr(self, key)}", f"Set {key} to 0 or more.")
        if self.relation_lr is not None and self.relation_lr < 0:
            fail("relation_lr", f"must not be negative, got {self.relation_lr}", "Set it to 0 or more.")
        if not 0 <= self.eval_fraction < 1:
            fail("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}",
                 "Use e.g. 0.05 to hold out 5% of each bucket.")
        if self.num_batch_negs > 0 and self.batch_size % self.num_batch_negs:
            fail("batch_size", f"{self.batch_size} is not a multiple of num_batch_negs="
                 f"{self.num_batch_negs}",
                 "Batches are split into chunks of num_batch_negs edges; pick a batch_size "
                 "that is a multiple of it.")
        if self.disable_lhs_negs and self.disable_rhs_negs:
            fail("disable_lhs_negs", "negatives are disabled on both sides",
                 "Keep at least one of disable_lhs_negs / disable_rhs_negs false.")
        if self.dynamic_relations:
            if len(self.relations) != 1:
                fail("dynamic_relations",
                     f"needs exactly one relation type in the config, got {len(self.relations)}",
                     "In dynamic mode the single relation's settings apply to every relation id "
                     "listed in dynamic_rel_count.txt; keep one relation.")
            if self.global_emb:
                fail("global_emb", "global embeddings can't be used with dynamic_relations",
                     "Set global_emb=false.")
        if self.ray.cpus_per_trainer <= 0:
            fail("ray.cpus_per_trainer", f"must be positive, got {self.ray.cpus_per_trainer}",
                 "Ask for at least a fraction of a CPU per train task.")
        if self.ray.gpus_per_trainer < 0:
            fail("ray.gpus_per_trainer", f"must not be negative, got {self.ray.gpus_per_trainer}",
                 "Use 0 for CPU training.")
        inc = self.incremental
        _choice(inc.new_rows_init, NEW_ROWS_INITS, "incremental.new_rows_init", fail)
        if not 0 <= inc.known_lr_scale <= 1:
            fail("incremental.known_lr_scale", f"must be in [0, 1], got {inc.known_lr_scale}",
                 "Use 0 to freeze what init_path trained, e.g. 0.1 to move it slowly, 1 for no change.")
        if self.init_path is None:
            for key, value, default in (("new_rows_init", inc.new_rows_init, "random"),
                                        ("known_lr_scale", inc.known_lr_scale, 1.0),
                                        ("new_entity_edges_only", inc.new_entity_edges_only, False)):
                if value != default:
                    fail(f"incremental.{key}", "needs init_path: the checkpoint whose rows are known",
                         "Set init_path to the previous run's checkpoint_path.")
        self.tune.validate(fail)
        for key in flat_search_space(self.tune.search_space):
            schema_type(key, f"{source}: tune.search_space")
        if self.eval.version is not None:
            _positive(self.eval.version, "eval.version", fail)
        for k in self.eval.hits_at:
            _positive(k, "eval.hits_at", fail)
        for key in ("num_trainers", "num_partition_stores", "num_cpus"):
            value = getattr(self.ray, key)
            if value is not None:
                _positive(value, f"ray.{key}", fail)


def drop_pbg_only_keys(data: Dict[str, Any], source: str) -> Dict[str, Any]:
    """A copy of a PBG config dict without the keys Ray makes meaningless."""
    for key in sorted(PBG_ONLY_KEYS.keys() & data.keys()):
        logger.info("%s: ignoring PBG key %r: %s", source, key, PBG_ONLY_KEYS[key])
    return {k: v for k, v in data.items() if k not in PBG_ONLY_KEYS}


def _positive(value: Union[int, float], key: str, fail) -> None:
    if value <= 0:
        fail(key, f"must be positive, got {value}", f"Set {key} to a value above 0.")


def _choice(value: str, choices: tuple, key: str, fail) -> None:
    if value not in choices:
        fail(key, f"unknown value {value!r}{did_you_mean(value, choices)}",
             f"Valid values: {', '.join(choices)}.")


# ---------------------------------------------------------------------------
# Plain data -> dataclasses, with errors that name the key.


def _convert(value: Any, hint: Any, key: str, source: str) -> Any:
    where = f"{source}: {key or '<root>'}"
    origin = typing.get_origin(hint)
    if hint is Any:  # e.g. importer.lhs_col: a column index or a column name
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], key, source)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise PbgRayError(f"{where}: expected a mapping, got {value!r}")
        fields = {f.name: f for f in dataclasses.fields(hint)}
        hints = typing.get_type_hints(hint)
        kwargs = {}
        for name, item in value.items():
            if name not in fields:
                sub = f"{key}.{name}" if key else str(name)
                prefix = f"{key}." if key else ""
                raise PbgRayError(
                    f"{source}: unknown key {sub!r}"
                    f"{did_you_mean(sub, [prefix + f for f in fields])}. "
                    f"Valid keys here: {', '.join(fields)}.")
            kwargs[name] = _convert(item, hints[name], f"{key}.{name}" if key else name, source)
        for name, f in fields.items():
            if name not in kwargs and f.default is MISSING and f.default_factory is dataclasses.MISSING:
                sub = f"{key}.{name}" if key else name
                raise PbgRayError(f"{source}: missing required key {sub!r}. Set {sub}=<value>.")
        return hint(**kwargs)
    if value is None or (isinstance(value, str) and value == "???"):
        raise PbgRayError(f"{where}: a value is required. Set {key}=<value>.")
    if origin in (list, List):
        (item_hint,) = typing.get_args(hint)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            if item_hint is str and isinstance(value, str):
                return [value]  # edge_paths=path means a list of one path
            raise PbgRayError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, item_hint, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        _, item_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise PbgRayError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): _convert(v, item_hint, f"{key}.{k}", source) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise PbgRayError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise PbgRayError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise PbgRayError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise PbgRayError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported type in schema: {hint!r}")  # a bug, not user input


def schema_type(path: str, source: str = "command line") -> Any:
    """The type the schema gives a dotted key; refuses keys that don't exist
    (e.g. `lr` typed `lrr`) with the nearest valid name.

    Keys under `entities.<type>` may name any entity type; list items are
    addressed by index (`relations.0.operator`).
    """
    hint: Any = ConfigSchema
    done: List[str] = []
    for part in path.split("."):
        origin = typing.get_origin(hint)
        if origin in (Union, types.UnionType):
            hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
            origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            if part not in hints:
                where = ".".join(done) or "the top level"
                raise PbgRayError(
                    f"{source}: unknown key {'.'.join(done + [part])!r}"
                    f"{did_you_mean('.'.join(done + [part]), ['.'.join(done + [h]) for h in hints])}. "
                    f"Valid keys at {where}: {', '.join(hints)}.")
            hint = hints[part]
        elif origin in (dict, Dict):
            hint = typing.get_args(hint)[1]
        elif origin in (list, List):
            if not part.isdigit():
                raise PbgRayError(f"{source}: {'.'.join(done)} is a list; address its items by "
                                  f"index (e.g. {'.'.join(done)}.0), not {part!r}.")
            hint = typing.get_args(hint)[0]
        else:
            raise PbgRayError(f"{source}: {'.'.join(done)!r} is a plain value and has no key {part!r}.")
        done.append(part)
    return hint


def check_value(path: str, value: Any, source: str = "command line") -> None:
    """Refuse a value of the wrong type for a dotted key (plain values only)."""
    hint = schema_type(path, source)
    if not dataclasses.is_dataclass(hint) and typing.get_origin(hint) not in (dict, Dict):
        _convert(value, hint, path, source)


def load_pbg_config_dict(path: Union[str, Path]) -> Dict[str, Any]:
    """The raw dict of a PBG config module (a .py file defining get_torchbiggraph_config())."""
    path = Path(path)
    if not path.is_file():
        raise PbgRayError(f"PBG config file {str(path)!r} does not exist.")
    spec = importlib.util.spec_from_file_location(f"_pbg_config_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise PbgRayError(f"PBG config file {str(path)!r} failed to import: {err!r}") from err
    getter = getattr(module, "get_torchbiggraph_config", None)
    if getter is None:
        raise PbgRayError(f"PBG config file {str(path)!r} defines no get_torchbiggraph_config(). "
                          "Add one that returns the config dict.")
    data = getter()
    if not isinstance(data, dict):
        raise PbgRayError(f"PBG config file {str(path)!r}: get_torchbiggraph_config() must return "
                          f"a dict, got {type(data).__name__}.")
    return drop_pbg_only_keys(data, str(path))


def load_pbg_config_file(path: Union[str, Path]) -> ConfigSchema:
    """Load and validate a PBG config module, as torchbiggraph_train would."""
    return ConfigSchema.from_dict(load_pbg_config_dict(path), source=str(path))


def register_configs() -> None:
    """The schema in Hydra's ConfigStore: conf/config.yaml builds on it, so every
    key has its documented default and Hydra knows the types."""
    ConfigStore.instance().store(name="pbg_ray_schema", node=ConfigSchema)


register_configs()
