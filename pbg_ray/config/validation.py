"""The rules of a whole config: those of PBG's top-level keys, each section's own
(`validate(fail)` of EntitySchema, RelationSchema, RayConfig, ImportConfig, EvalConfig,
IncrementalConfig, TuneConfig, ServeConfig, ExportConfig) and those that span sections, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pbg_ray.config.components import (
    BUCKET_ORDERS, COMPARATORS, LOSS_FUNCTIONS, REGULARIZERS, SAME_DIMENSION_OPERATORS,
    UNREGULARIZED_OPERATORS)
from pbg_ray.config.convert import schema_type
from pbg_ray.config.options import (
    Fail, check_choice, check_no_credentials, check_not_negative, check_positive)
from pbg_ray.config.tune import flat_search_space
from pbg_ray.errors import did_you_mean

if TYPE_CHECKING:
    from pbg_ray.config.schema import ConfigSchema


def validate_config(config: "ConfigSchema", fail: Fail, source: str) -> None:
    """Raise (through `fail`) at the first rule the config breaks."""
    if not config.entities:
        fail("entities", "no entity types are defined", "Add at least one entity type.")
    if not config.relations:
        fail("relations", "no relation types are defined", "Add at least one relation type.")
    for key in ("entity_path", "checkpoint_path"):
        if not getattr(config, key):
            fail(key, "this path is required", f"Set {key}=<directory>.")
    if not config.edge_paths:
        fail("edge_paths", "this path is required", "Set edge_paths=[<directory>, ...].")
    check_positive(config.dimension, "dimension", fail)
    for name, entity in config.entities.items():
        entity.validate(f"entities.{name}", fail)
    counts = {e.num_partitions for e in config.entities.values()} - {1}
    if len(counts) > 1:
        detail = ", ".join(f"{n}={e.num_partitions}" for n, e in config.entities.items())
        fail("entities.*.num_partitions",
             f"partition counts don't broadcast ({detail})",
             "All partitioned entity types must have the same number of partitions "
             "(unpartitioned types use 1).")
    for idx, rel in enumerate(config.relations):
        rel.validate(f"relations[{idx}]", fail)
        _relation_fits_entities(config, idx, fail)
    check_choice(config.comparator, COMPARATORS, "comparator", fail)
    check_choice(config.loss_fn, LOSS_FUNCTIONS, "loss_fn", fail)
    check_choice(config.regularizer, REGULARIZERS, "regularizer", fail)
    check_choice(config.bucket_order, BUCKET_ORDERS, "bucket_order", fail)
    config.ray.validate(fail)
    _training_keys(config, fail)
    if config.dynamic_relations:
        if len(config.relations) != 1:
            fail("dynamic_relations",
                 f"needs exactly one relation type in the config, got {len(config.relations)}",
                 "In dynamic mode the single relation's settings apply to every relation id "
                 "listed in dynamic_rel_count.txt; keep one relation.")
        if config.global_emb:
            fail("global_emb", "global embeddings can't be used with dynamic_relations",
                 "Set global_emb=false.")
    config.incremental.validate(fail)
    config.export.validate(fail)
    if config.init_path is None:
        for key in config.incremental.keys_needing_init_path():
            fail(f"incremental.{key}", "needs init_path: the checkpoint whose rows are known",
                 "Set init_path to the previous run's checkpoint_path.")
    config.tune.validate(fail)
    for key in flat_search_space(config.tune.search_space):
        schema_type(type(config), key, f"{source}: tune.search_space")
    config.eval.validate(fail)
    config.serve.validate(fail)
    if config.bias and config.serve.index in ("hnsw", "ivf"):
        fail("serve.index", f"{config.serve.index} can't search a biased comparator's scores "
             "(bias=true adds each vector's first coordinate, which no faiss metric does)",
             "Set serve.index=exact (or auto, which searches biased models exactly).")
    config.importer.validate(fail)
    _locations(config, fail)


# Every storage location of every section, by key: each a path or URI, or a list of them.
LOCATIONS = ("entity_path", "edge_paths", "eval_edge_paths", "checkpoint_path", "init_path",
             "tensorboard_dir", "importer.inputs", "importer.previous_entity_path",
             "importer.previous_edge_paths", "eval.edge_paths", "eval.filter_paths",
             "export.output", "tune.storage_path")


def location(config: "ConfigSchema", key: str) -> Any:
    """The value of one of LOCATIONS' keys (a top-level key or section.key)."""
    section, _, field = key.rpartition(".")
    return getattr(getattr(config, section) if section else config, field)


def _locations(config: "ConfigSchema", fail: Fail) -> None:
    """Every storage location of every section: none carries credentials."""
    for key in LOCATIONS:
        value = location(config, key)
        if isinstance(value, list):
            for idx, path in enumerate(value):
                check_no_credentials(path, f"{key}[{idx}]", fail)
        else:
            check_no_credentials(value, key, fail)


def _relation_fits_entities(config: "ConfigSchema", idx: int, fail: Fail) -> None:
    """A relation's sides name entity types whose dimensions its operator can map."""
    rel, key = config.relations[idx], f"relations[{idx}]"
    for side in ("lhs", "rhs"):
        entity = getattr(rel, side)
        if entity not in config.entities:
            fail(f"{key}.{side}",
                 f"relation {rel.name!r} uses unknown entity type {entity!r}"
                 f"{did_you_mean(entity, config.entities)}",
                 f"Use one of {sorted(config.entities)} or add it to entities.")
    if config.regularization_coef > 0 and rel.operator in UNREGULARIZED_OPERATORS:
        fail(f"{key}.operator",
             f"the {config.regularizer} regularizer can't be applied to the "
             f"{rel.operator!r} operator",
             "Use another operator or set regularization_coef=0.")
    if rel.operator == "complex_diagonal":
        for entity in {rel.lhs, rel.rhs}:
            if config.entity_dimension(entity) % 2:
                fail(f"{key}.operator",
                     f"complex_diagonal needs an even dimension, entity type "
                     f"{entity!r} has {config.entity_dimension(entity)}",
                     "Use an even dimension or another operator.")
    if (rel.operator in SAME_DIMENSION_OPERATORS
            and config.entity_dimension(rel.lhs) != config.entity_dimension(rel.rhs)):
        fail(f"{key}.operator",
             f"lhs {rel.lhs!r} and rhs {rel.rhs!r} have different dimensions",
             "Give both entity types the same dimension.")


def _training_keys(config: "ConfigSchema", fail: Fail) -> None:
    """PBG's training keys: sizes, counts and rates."""
    check_positive(config.batch_size, "batch_size", fail)
    check_positive(config.num_epochs + 1, "num_epochs", fail)  # 0 epochs is allowed
    check_positive(config.max_edges_per_chunk, "max_edges_per_chunk", fail)
    check_positive(config.init_scale, "init_scale", fail)
    for key in ("num_edge_chunks", "checkpoint_preservation_interval", "workers", "max_norm"):
        if getattr(config, key) is not None:
            check_positive(getattr(config, key), key, fail)
    for key in ("num_batch_negs", "num_uniform_negs", "eval_num_batch_negs",
                "eval_num_uniform_negs", "num_gpus", "verbose", "lr", "regularization_coef",
                "hogwild_delay", "seed"):
        check_not_negative(getattr(config, key), key, fail)
    if config.relation_lr is not None:
        check_not_negative(config.relation_lr, "relation_lr", fail)
    if not 0 <= config.eval_fraction < 1:
        fail("eval_fraction", f"must be in [0, 1), got {config.eval_fraction}",
             "Use e.g. 0.05 to hold out 5% of each bucket.")
    if config.num_batch_negs > 0 and config.batch_size % config.num_batch_negs:
        fail("batch_size", f"{config.batch_size} is not a multiple of num_batch_negs="
             f"{config.num_batch_negs}",
             "Batches are split into chunks of num_batch_negs edges; pick a batch_size "
             "that is a multiple of it.")
    if config.disable_lhs_negs and config.disable_rhs_negs:
        fail("disable_lhs_negs", "negatives are disabled on both sides",
             "Keep at least one of disable_lhs_negs / disable_rhs_negs false.")
