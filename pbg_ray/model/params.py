"""Model parameters shared by all buckets (relation operators, global embeddings) and the
initialisation of entity partitions; conversion to and from PBG checkpoint layout."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.model.operators import OPERATORS
from pbg_ray.types import Bucket

PartitionKey = Tuple[str, int]  # (entity type, partition)


def partition_key(config: ConfigSchema, entity: str, part: int) -> PartitionKey:
    """The partition of `entity` a bucket side uses (0 for unpartitioned types)."""
    return entity, (part if config.entities[entity].num_partitions > 1 else 0)


def partition_keys(config: ConfigSchema, bucket: Bucket) -> List[PartitionKey]:
    """The (entity type, partition) pairs a bucket touches, lhs types first."""
    keys: List[PartitionKey] = []
    for side, part in (("lhs", bucket.lhs), ("rhs", bucket.rhs)):
        for rel in config.relations:
            key = partition_key(config, getattr(rel, side), part)
            if key not in keys:
                keys.append(key)
    return keys


def partition_counts(keys: List[PartitionKey], partitions: List[Tuple[np.ndarray, np.ndarray]]
                     ) -> Dict[str, Dict[int, int]]:
    """{entity: {part: number of entities}} of the partitions a task received."""
    counts: Dict[str, Dict[int, int]] = {}
    for (entity, part), (embs, _) in zip(keys, partitions):
        counts.setdefault(entity, {})[part] = len(embs)
    return counts


@dataclasses.dataclass
class ModelParams:
    """Shared (non-entity) parameters. Keys are PBG's public checkpoint names:
    "relations/{idx}/operator/{side}/{param}" and "entities/{type}/global_embedding";
    `sums` holds the Adagrad accumulators under the same keys. All float32."""

    arrays: Dict[str, np.ndarray]
    sums: Dict[str, np.ndarray]


def operator_key(rel_idx: int, side: str, param: str) -> str:
    return f"relations/{rel_idx}/operator/{side}/{param}"


def global_emb_key(entity: str) -> str:
    return f"entities/{entity}/global_embedding"


def param_layout(config: ConfigSchema, num_relation_ids: int) -> List[Tuple[str, np.ndarray]]:
    """(public name, initial value) of every shared parameter, in the order of
    torchbiggraph's `model.parameters()` (lhs operators, rhs operators, global embeddings),
    which is the order of its global Adagrad's state."""
    layout: List[Tuple[str, np.ndarray]] = []
    for side in ("lhs", "rhs"):
        for idx, rel in enumerate(config.relations):
            if not config.dynamic_relations and side == "lhs":
                continue  # per-relation mode: operators apply to the rhs only
            op = OPERATORS.get(rel.operator)(config.entity_dimension(getattr(rel, side)))
            init = op.init()
            for name, dynamic_name in op.param_names:
                if config.dynamic_relations:
                    value = np.broadcast_to(init[name], (num_relation_ids,) + init[name].shape)
                    layout.append((operator_key(idx, side, dynamic_name), value.copy()))
                else:
                    layout.append((operator_key(idx, side, name), init[name]))
    if config.global_emb:
        for entity in config.entities:
            layout.append((global_emb_key(entity),
                           np.zeros(config.entity_dimension(entity), np.float32)))
    return layout


def init_params(config: ConfigSchema, num_relation_ids: int) -> ModelParams:
    """Operators at the identity, global embeddings at zero, accumulators at zero."""
    layout = param_layout(config, num_relation_ids)
    return ModelParams({k: v for k, v in layout}, {k: np.zeros_like(v) for k, v in layout})


# Draws per table beyond which PBG's fast_approx_rand repeats one block of normal samples
# (a prime count, so consecutive rows get different shifts of it) instead of drawing them all.
APPROX_RAND_BLOCK = 1_000_003


def init_partition(config: ConfigSchema, entity: str, count: int, rng: np.random.Generator,
                   empty: Callable[..., np.ndarray] = np.empty) -> Tuple[np.ndarray, np.ndarray]:
    """(embeddings float32 [count, dim] ~ N(0, init_scale), row-Adagrad sums float32 [count]),
    in arrays from `empty(shape, dtype)`.

    As in PBG (and its I/O spec: "the samples of all the entities of a certain type will not
    be independent"), a table of more than APPROX_RAND_BLOCK values repeats one block of
    that many draws: copying memory is far cheaper than drawing a normal value, and this
    comes off a partition store's start-up."""
    dim = config.entity_dimension(entity)
    numel = count * dim
    block = rng.standard_normal(min(numel, APPROX_RAND_BLOCK), dtype=np.float32)
    block *= np.float32(config.init_scale)
    embs = empty((count, dim), np.float32)
    if numel:
        flat = embs.reshape(-1)
        whole = numel - numel % len(block)
        flat[:whole].reshape(-1, len(block))[...] = block
        flat[whole:] = block[:numel - whole]
    sums = empty((count,), np.float32)
    sums[...] = 0
    return embs, sums


# The other hyperparameters torch.optim.Adagrad's state_dict() records, at their defaults.
ADAGRAD_DEFAULTS = {"lr_decay": 0, "eps": 1e-10, "weight_decay": 0,
                    "initial_accumulator_value": 0, "foreach": None, "maximize": False,
                    "differentiable": False, "fused": None}


def relation_lr(config: ConfigSchema) -> float:
    return config.lr if config.relation_lr is None else config.relation_lr


def params_to_checkpoint(config: ConfigSchema, params: ModelParams
                         ) -> Tuple[Dict[str, np.ndarray], Optional[dict]]:
    """(public name -> array, the state dict torchbiggraph's global Adagrad would write)."""
    names = list(params.arrays)
    if not names:
        return {}, {}  # PBG's DummyOptimizer state
    # torch.optim.Adagrad(...).state_dict() with these sums, in numpy arrays, so that the
    # processes that hold parameters never import torch.
    state = {i: {"step": np.zeros((), np.float32), "sum": np.array(params.sums[n], np.float32)}
             for i, n in enumerate(names)}
    group = {"lr": relation_lr(config), **ADAGRAD_DEFAULTS, "params": list(range(len(names)))}
    return dict(params.arrays), {"state": state, "param_groups": [group]}


@dataclasses.dataclass
class KnownRows:
    """What init_path trained, in an incremental run (pbg_ray.incremental): the leading
    rows of each entity partition, and of each shared parameter's first dimension, that
    are known. Their learning rate is multiplied by `lr_scale`; 0 freezes them."""

    partitions: Dict[PartitionKey, int]
    params: Dict[str, int]
    lr_scale: float


def known_rows(known: Optional[KnownRows], key: PartitionKey) -> Tuple[int, float]:
    """(rows of partition `key` init_path trained, their learning rate's scale): (0, 1.0)
    outside an incremental run."""
    return (known.partitions.get(key, 0), known.lr_scale) if known is not None else (0, 1.0)


def _fitted(config: ConfigSchema, name: str, value: Any, initial: np.ndarray, grow: bool,
            what: str) -> np.ndarray:
    """`value` as float32 of initial's shape. With `grow`, a dynamic relation parameter
    with fewer relation ids fills the first rows; the new ids keep `initial`'s rows."""
    shape, expected = np.shape(value), initial.shape
    if shape == expected:
        return np.array(value, np.float32)
    if (grow and config.dynamic_relations and name.startswith("relations/")
            and len(shape) == len(expected) and shape[1:] == expected[1:] and shape[0] < expected[0]):
        grown = initial.copy()
        grown[:shape[0]] = value
        return grown
    raise PbgRayError(f"{what} {name!r} has shape {shape}, the config needs {expected}. Check "
                      "dimension and the relation count.")


def params_from_checkpoint(config: ConfigSchema, num_relation_ids: int,
                           arrays: Dict[str, np.ndarray], optim_state: Optional[dict],
                           grow: bool = False, where: Optional[str] = None) -> ModelParams:
    """Parameters from a checkpoint (missing ones at their initial values). `grow`: the
    checkpoint is an init_path of a grown graph, whose relation ids (dynamic mode) are a
    prefix of this config's; its optimizer state covers only the parameters it has.
    `where`: what they were read from (a model file, a version, a bundle tag), named in errors."""
    prefix = f"{where}: " if where else ""
    params = init_params(config, num_relation_ids)
    for name, value in arrays.items():
        if name not in params.arrays:
            raise PbgRayError(f"{prefix}checkpoint parameter {name!r} does not belong to this "
                              f"config's model (expected {sorted(params.arrays)}). Check the "
                              "operator, dynamic_relations and global_emb settings.")
        params.arrays[name] = _fitted(config, name, value, params.arrays[name], grow,
                                      f"{prefix}checkpoint parameter")
    state: Dict[Any, Any] = (optim_state or {}).get("state", {})
    # The state is indexed by the position of each parameter in the writer's layout: ours,
    # less the parameters a grown graph added (relations and entity types only append).
    names = [n for n in params.arrays if n in arrays] if grow else list(params.arrays)
    for idx, name in enumerate(names):
        entry = state.get(idx)
        if entry is not None and "sum" in entry:
            params.sums[name] = _fitted(config, name, np.asarray(entry["sum"], np.float32),
                                        params.sums[name], grow, f"{prefix}optimizer state for")
    return params
