"""The rules of a whole config: each field's own check (declared with the field,
`option(check=...)`, run by options.check_fields), and the rules across fields, within a
section (ImportConfig.validate, ExportConfig.validate) or across sections, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pbg_ray.config.components import SAME_DIMENSION_OPERATORS, UNREGULARIZED_OPERATORS
from pbg_ray.config.convert import schema_type
from pbg_ray.config.options import Fail, check_fields
from pbg_ray.config.tune import flat_search_space
from pbg_ray.errors import PbgRayError, did_you_mean

if TYPE_CHECKING:
    from pbg_ray.config.schema import ConfigSchema


def validate_config(config: "ConfigSchema", source: str) -> None:
    """Raise a PbgRayError naming `source` and the key at the first rule the config breaks."""

    def fail(key: str, problem: str, fix: str) -> None:
        raise PbgRayError(f"{source}: {key}: {problem}. {fix}")

    check_fields(config, "", fail)
    counts = {e.num_partitions for e in config.entities.values()} - {1}
    if len(counts) > 1:
        detail = ", ".join(f"{n}={e.num_partitions}" for n, e in config.entities.items())
        fail("entities.*.num_partitions",
             f"partition counts don't broadcast ({detail})",
             "All partitioned entity types must have the same number of partitions "
             "(unpartitioned types use 1).")
    for idx in range(len(config.relations)):
        _relation_fits_entities(config, idx, fail)
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
    config.export.validate(fail)
    if config.init_path is None:
        for key in config.incremental.keys_needing_init_path():
            fail(f"incremental.{key}", "needs init_path: the checkpoint whose rows are known",
                 "Set init_path to the previous run's checkpoint_path.")
    for key in flat_search_space(config.tune.search_space):
        schema_type(type(config), key, f"{source}: tune.search_space")
    if config.bias and config.serve.index in ("hnsw", "ivf"):
        fail("serve.index", f"{config.serve.index} can't search a biased comparator's scores "
             "(bias=true adds each vector's first coordinate, which no faiss metric does)",
             "Set serve.index=exact (or auto, which searches biased models exactly).")
    config.importer.validate(fail)
    if config.ray.device_step or config.ray.gpus_per_trainer > 0 or config.num_gpus > 0:
        _device_step_features(config, fail)
    if config.ray.cuda_graphs and not (config.ray.gpus_per_trainer > 0 or config.num_gpus > 0):
        fail("ray.cuda_graphs", "CUDA graphs need train tasks on GPUs",
             "Set ray.gpus_per_trainer above 0, or ray.cuda_graphs=false.")


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


def _device_step_features(config: "ConfigSchema", fail: Fail) -> None:
    """What the device step (GPU training, ray.device_step) does not train."""
    key, off = (("ray.device_step", "false") if config.ray.device_step else
                ("ray.gpus_per_trainer", "0") if config.ray.gpus_per_trainer > 0 else
                ("num_gpus", "0"))
    for name, entity in config.entities.items():
        if entity.featurized:
            fail(f"entities.{name}.featurized",
                 f"featurized entities train on CPUs only, and {key} asks for the device step",
                 f"Train on CPUs ({key}={off}) or make {name!r} a plain entity type.")
    if config.beyond_bucket_negs:
        fail("beyond_bucket_negs", f"negatives from beyond the bucket are drawn by the CPU "
             f"kernel only, and {key} asks for the device step",
             f"Set beyond_bucket_negs=0, or train on CPUs ({key}={off}).")
    dims = {name: config.entity_dimension(name) for name in config.entities}
    if len(set(dims.values())) > 1:
        name = min(dims, key=lambda n: (dims[n] == config.dimension, n))
        fail(f"entities.{name}.dimension",
             f"the device step ({key}) trains entity types of one dimension, and they "
             f"have {dims}",
             f"Give every entity type dimension={config.dimension}, or train on CPUs "
             f"({key}={off}).")


def _training_keys(config: "ConfigSchema", fail: Fail) -> None:
    """PBG's training keys that depend on one another."""
    if config.num_batch_negs > 0 and config.batch_size % config.num_batch_negs:
        fail("batch_size", f"{config.batch_size} is not a multiple of num_batch_negs="
             f"{config.num_batch_negs}",
             "Batches are split into chunks of num_batch_negs edges; pick a batch_size "
             "that is a multiple of it.")
    if config.disable_lhs_negs and config.disable_rhs_negs:
        fail("disable_lhs_negs", "negatives are disabled on both sides",
             "Keep at least one of disable_lhs_negs / disable_rhs_negs false.")
    if config.beyond_batch_negs > config.beyond_bucket_negs:
        fail("beyond_batch_negs", f"{config.beyond_batch_negs} is more than the "
             f"beyond_bucket_negs={config.beyond_bucket_negs} rows a bucket draws, which each "
             f"batch samples from",
             "Set beyond_bucket_negs to at least beyond_batch_negs, or beyond_batch_negs=0.")
