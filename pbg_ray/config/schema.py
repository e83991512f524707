"""The one config schema: PBG's key names, defaults and meanings, and pbg_ray's sections.

A PBG user's config dict (or PBG config module, pbg_ray.config.pbg_file) carries over
unchanged. Every source of configuration (Hydra, a PBG module, a checkpoint's config.json)
goes through `ConfigSchema.from_dict`, which refuses unknown keys and wrong types with a
`PbgRayError` naming the key (pbg_ray.config.convert). Building a ConfigSchema, from a dict,
directly or by `dataclasses.replace`, converts every value to its field's type and checks
every rule (each field's own, declared with it, and those across fields:
pbg_ray.config.validation).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from omegaconf import MISSING

from pbg_ray.config.components import (
    BUCKET_ORDERS, COMPARATORS, LOSS_FUNCTIONS, OPERATORS, REGULARIZERS)
from pbg_ray.config.convert import convert_fields, field_values
from pbg_ray.config.eval import EvalConfig
from pbg_ray.config.model_selection import ValidationConfig
from pbg_ray.config.export import ExportConfig
from pbg_ray.config.importer import ImportConfig
from pbg_ray.config.incremental import IncrementalConfig
from pbg_ray.config.options import (
    Bounds, not_negative, one_of, option, positive, required, storage_locations)
from pbg_ray.config.pbg_file import drop_pbg_only_keys, load_pbg_config_dict
from pbg_ray.config.ray import RayConfig
from pbg_ray.config.serve import ServeConfig
from pbg_ray.config.tune import TuneConfig
from pbg_ray.config.validation import validate_config
from pbg_ray.errors import PbgRayError

path_required = required("this path is required", "Set {key}=<directory>.")


@dataclass
class EntitySchema:
    """One entity type."""

    num_partitions: int = option(1, check=positive, help=
        "Number of partitions of this type; 1 means unpartitioned. All partitioned types "
        "share one count.")
    featurized: bool = option(False, help=
        "Entities are represented as bags of features (edges then carry lhsd/rhsd feature "
        "lists instead of plain ids).")
    dimension: Optional[int] = option(None, check=positive, help=
        "Overrides the global `dimension` for this type.")


@dataclass
class RelationSchema:
    """One relation type; its id in the edge files is its index in `relations`."""

    name: str = option(MISSING, help=
        "A name for the relation type, used in logs, exports and by name in predict.")
    lhs: str = option(MISSING, help=
        "The entity type of the relation's left-hand side (a key of entities).")
    rhs: str = option(MISSING, help=
        "The entity type of the relation's right-hand side (a key of entities).")
    weight: float = option(1.0, check=positive, help=
        "Multiplies the loss of this relation's edges.")
    operator: str = option("none", check=one_of(OPERATORS), help=
        "Transformation applied to the rhs embedding before comparison.")
    all_negs: bool = option(False, help=
        "Negatives are all the entities of the partition, not a sample.")


@dataclass
class ConfigSchema:
    """A whole run. Keys and meanings are PBG's (torchbiggraph.config)."""

    entities: Dict[str, EntitySchema] = option(MISSING, check=required(
        "no entity types are defined", "Add at least one entity type."), help=
        "The entity types, by name: each with its number of partitions (and optionally "
        "featurized, dimension).")
    relations: List[RelationSchema] = option(MISSING, check=required(
        "no relation types are defined", "Add at least one relation type."), help=
        "The relation types; a relation's id in the edge files is its index in this list.")
    dimension: int = option(MISSING, check=positive, help=
        "The dimension of the embeddings (entity types may override it).")
    init_scale: float = option(1e-3, check=positive, help=
        "Standard deviation of the normal distribution new embeddings are drawn from (large "
        "tables repeat one block of draws, as PBG does).")
    max_norm: Optional[float] = option(None, check=positive, help=
        "If set, embeddings whose norm exceeds it are rescaled to it.")
    global_emb: bool = option(True, help=
        "Add to every embedding a learned vector shared by all entities of its type.")
    comparator: str = option("cos", check=one_of(COMPARATORS), help=
        "How the two sides' embeddings, after the operator, are compared into a score: dot, "
        "cos, l2 or squared_l2.")
    bias: bool = option(False, help=
        "Use the first dimension of the embeddings as a bias added to the score instead of "
        "comparing it.")
    loss_fn: str = option("ranking", check=one_of(LOSS_FUNCTIONS), help=
        "How positive scores are set against their negatives: ranking, logistic or softmax.")
    margin: float = option(0.1, help="The margin of the ranking loss.")
    regularization_coef: float = option(0.0, check=not_negative, help=
        "The weight of the regularizer in the loss; 0: no regularization.")
    regularizer: str = option("N3", check=one_of(REGULARIZERS), help=
        "The regularizer applied when regularization_coef > 0 (N3).")

    entity_path: str = option(MISSING, check=path_required, location=True, help=
        "The directory of the entity files (entity_count_{type}_{part}.txt, names).")
    edge_paths: List[str] = option(MISSING, check=required(
        "this path is required", "Set {key}=[<directory>, ...]."), location=True, help=
        "Directories of edge buckets (edges_{lhs}_{rhs}.h5); each epoch trains on each in "
        "turn.")
    checkpoint_path: str = option(MISSING, check=path_required, location=True, help=
        "Where checkpoints are written (a local path or a URI such as s3://bucket/dir); a run "
        "resumes from the newest complete version found there.")
    init_path: Optional[str] = option(None, location=True, help=
        "A checkpoint (v1 directory, pre-1.0 PBG run or model bundle) whose embeddings and "
        "parameters the run starts from.")
    eval_edge_paths: List[str] = option(factory=list, location=True, help=
        "pbg_ray extension: edge paths held out from training, evaluated after training "
        "(PBG's sampled metrics), e.g. a test split.")
    checkpoint_preservation_interval: Optional[int] = option(None, check=positive, help=
        "Every so many epochs, keep that version in an epoch_{N} subdirectory instead of "
        "dropping it when the next one is written.")
    tensorboard_dir: Optional[str] = option(None, location=True, help=
        "pbg_ray extension: write TensorBoard scalars (loss and held-out metrics per bucket "
        "and per epoch) into this directory; null: don't.")

    num_epochs: int = option(1, check=not_negative, help=
        "How many times training goes over every edge.")
    num_edge_chunks: Optional[int] = option(None, check=positive, help=
        "Parts each bucket is split into; an epoch trains every bucket's first chunk, then "
        "every second one, and so on. Null: as few as keep each chunk within "
        "max_edges_per_chunk.")
    max_edges_per_chunk: int = option(1_000_000_000, check=positive, help=
        "The most edges of a chunk, when num_edge_chunks is null.")
    bucket_order: str = option("inside_out", check=one_of(BUCKET_ORDERS), help=
        "The order buckets are trained in: random, affinity, inside_out or outside_in "
        "(PBG's), or beta: Marius's order for a trainer that keeps ray.partition_buffer "
        "partitions in memory, with the fewest partition reads in disk placement.")
    workers: Optional[int] = option(None, check=positive, help=
        "PBG's count of Hogwild processes; accepted and ignored, with a warning: each train "
        "task runs int(ray.cpus_per_trainer) Hogwild threads, ray.num_trainers tasks at once.")
    hogwild_delay: float = option(2.0, check=not_negative, help=
        "PBG's warm-up, in seconds: the first Hogwild thread of a bucket trains alone this "
        "long before the task's other threads join (at once if the bucket's batches run out "
        "sooner), so that the first, largest Adagrad updates of its partitions and of the "
        "shared parameters (relation operators, global embeddings) come without races. "
        "pbg_ray warms up the buckets of the first epoch that train a partition no bucket "
        "has trained yet (at most one per partition); PBG warms up every bucket of its first "
        "epoch. Matters with ray.cpus_per_trainer of 2 or more; 0: no warm-up.")
    seed: int = option(0, check=not_negative, help=
        "pbg_ray extension: the seed of training: new embeddings, the shuffle of each "
        "bucket's edges into batches, the negatives, the held-out edges (eval_fraction) and "
        "the bucket order. With one train task of one thread (ray.num_trainers=1, "
        "ray.cpus_per_trainer=1) two runs write identical checkpoints; more threads or tasks "
        "add only Hogwild's races. The importer's shuffle has its own importer.seed.")
    batch_size: int = option(1000, check=positive, help="Edges per batch.")
    num_batch_negs: int = option(50, check=not_negative, help=
        "Negatives per positive edge taken from the other edges of its batch.")
    num_uniform_negs: int = option(50, check=not_negative, help=
        "Negatives per positive edge drawn uniformly from the partition.")
    beyond_bucket_negs: int = option(0, check=not_negative, help=
        "Negatives from beyond the bucket (docs/quality.md): for each bucket, this many rows "
        "drawn uniformly over every partition of each partitioned entity type, copied from "
        "the values their stores hold (disk placement: those last written); each side of "
        "the bucket's edges scores the rows of the partitions other than its own besides its "
        "own negatives, and with loss_fn=softmax those scores get log(rows of those "
        "partitions / rows of them drawn) added, so that the softmax estimates the one over "
        "every entity of the type. The rows are read-only copies: their gradients, summed "
        "over the bucket, are applied later as a delta (one RowAdagrad step) by the next "
        "task that trains their partition, or at the pass's end. 0: off (PBG's negatives, "
        "from the bucket's partitions only). CPU training only.")
    beyond_batch_negs: int = option(0, check=not_negative, help=
        "Of the beyond_bucket_negs rows drawn for a bucket, how many each batch scores: a "
        "uniform sample of them drawn anew for every batch (the correction counts the "
        "smaller sample), so that a bucket's batches meet more of the other partitions' rows "
        "than one batch scores (docs/quality.md). 0: every batch scores all of them.")
    disable_lhs_negs: bool = option(False, help="Draw no negatives on the left-hand side.")
    disable_rhs_negs: bool = option(False, help="Draw no negatives on the right-hand side.")
    lr: float = option(1e-2, check=not_negative, help=
        "The learning rate of Adagrad (row-wise for embeddings).")
    relation_lr: Optional[float] = option(None, check=not_negative, help=
        "The learning rate of the relation operators' parameters; null: lr.")
    eval_fraction: float = option(0.05, check=Bounds(
        "must be in [0, 1)", "Use e.g. 0.05 to hold out 5% of each bucket.", low=0, high=1,
        high_open=True), help=
        "The fraction of each bucket's edges held out from training and evaluated before and "
        "after it (PBG's sampled metrics).")
    eval_num_batch_negs: int = option(1000, check=not_negative, help=
        "Batch negatives per edge when evaluating held-out edges.")
    eval_num_uniform_negs: int = option(1000, check=not_negative, help=
        "Uniform negatives per edge when evaluating held-out edges.")

    dynamic_relations: bool = option(False, help=
        "Dynamic relation mode: one relation type in the config applies to every relation id "
        "listed in dynamic_rel_count.txt of entity_path.")
    num_gpus: int = option(0, check=not_negative, help=
        "GPUs of each train task when ray.gpus_per_trainer is 0 (PBG's GPU trainer key); 0: "
        "CPU training.")
    half_precision: bool = option(False, help=
        "PBG's GPU trainer's fp16 switch; accepted and ignored, with a warning: pbg_ray "
        "trains in float32.")
    verbose: int = option(0, check=not_negative, help=
        "Logging verbosity: 0 warnings, 1 and more progress details.")

    ray: RayConfig = option(factory=RayConfig, help=
        "Where and how the work runs on Ray (the `ray` section).")
    importer: ImportConfig = option(factory=ImportConfig, help=
        "python -m pbg_ray.import_edges: raw edge files into entity_path and the edge paths "
        "(the `importer` section).")
    export: ExportConfig = option(factory=ExportConfig, help=
        "python -m pbg_ray.export: what is written and where (the `export` section).")
    eval: EvalConfig = option(factory=EvalConfig, help=
        "python -m pbg_ray.eval: what is evaluated and how (the `eval` section).")
    validation: ValidationConfig = option(factory=ValidationConfig, help=
        "Validation edges ranked while training, early stopping and the best version kept "
        "(the `validation` section).")
    serve: ServeConfig = option(factory=ServeConfig, help=
        "python -m pbg_ray.serve: scores, top-k and neighbours over HTTP (the `serve` section).")
    tune: TuneConfig = option(factory=TuneConfig, help=
        "python -m pbg_ray.tune: the search space and how trials run (the `tune` section).")
    incremental: IncrementalConfig = option(factory=IncrementalConfig, help=
        "Training a grown graph from init_path (the `incremental` section).")
    # Where the values came from, for __post_init__'s messages: an argument of the
    # constructor and of dataclasses.replace, not a field (to_dict, == and the reference
    # leave it out; the attribute reads the default, whatever was passed).
    source: InitVar[str] = "config"

    def __post_init__(self, source: str) -> None:
        """Every value converted to its field's type (plain data too: a section given as a
        mapping, a list's one item given alone) and every rule checked; a PbgRayError names
        `source` and the key."""
        values = field_values(self, ConfigSchema, "", source)
        for name, value in convert_fields(values, ConfigSchema, "", source).items():
            setattr(self, name, value)
        validate_config(self, source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "config", warn: bool = True) -> "ConfigSchema":
        """Build and validate a config from plain dicts/lists (PBG's layout).

        `source` names where the dict came from, for error messages; `warn`: whether the
        PBG keys pbg_ray ignores are warned about (pbg_file.drop_pbg_only_keys).
        """
        if not isinstance(data, dict):
            raise PbgRayError(
                f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        return cls(**field_values(drop_pbg_only_keys(data, source, warn), cls, "", source),
                   source=source)

    def checked(self, source: str = "config") -> "ConfigSchema":
        """This config built again: a config changed after it was built
        (`config.num_epochs = "three"`, which __post_init__ does not see) gets the
        PbgRayError naming the key here, before a command starts, and a value given as a
        list's one item (edge_paths="data/train") becomes the list. The commands' library
        functions take every config through it."""
        return dataclasses.replace(self, source=source)

    def to_dict(self) -> Dict[str, Any]:
        """Plain dicts and lists, as written to config.json."""
        return dataclasses.asdict(self)

    def with_absolute_paths(self) -> "ConfigSchema":
        """Local paths of every storage location made absolute (URIs kept), so that Ray
        workers, whose working directory is their raylet's, find the same files."""

        def absolute(path: Optional[str]) -> Optional[str]:
            if path is None or "://" in path:
                return path
            return os.path.abspath(os.path.expanduser(path))

        changes: Dict[str, Dict[str, Any]] = {"": {}}  # section ("": none) -> field -> value
        for key in LOCATIONS:
            value = location(self, key)
            section, _, name = key.rpartition(".")
            changes.setdefault(section, {})[name] = (
                [absolute(p) for p in value] if isinstance(value, list) else absolute(value))
        sections = {section: dataclasses.replace(getattr(self, section), **values)
                    for section, values in changes.items() if section}
        return dataclasses.replace(self, **changes[""], **sections)

    def entity_dimension(self, entity: str) -> int:
        dim = self.entities[entity].dimension
        return self.dimension if dim is None else dim

    def num_partitions(self) -> int:
        """The partition count shared by all partitioned entity types (1 if none)."""
        return max(e.num_partitions for e in self.entities.values())


# Every storage location of every section, by key (`option(location=True)`): each a path or
# URI, or a list of them.
LOCATIONS: Tuple[str, ...] = tuple(storage_locations(ConfigSchema))


def location(config: ConfigSchema, key: str) -> Any:
    """The value of one of LOCATIONS' keys (a top-level key or section.key)."""
    section, _, name = key.rpartition(".")
    return getattr(getattr(config, section) if section else config, name)


def load_pbg_config_file(path: Union[str, Path]) -> ConfigSchema:
    """Load and validate a PBG config module, as torchbiggraph_train would."""
    return ConfigSchema.from_dict(load_pbg_config_dict(path), source=str(path))
