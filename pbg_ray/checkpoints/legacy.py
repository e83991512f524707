"""Runs of PyTorch-BigGraph before 1.0 (../shared/spec/001), read and converted to v1.

A pre-1.0 run, every file written by torch.save:
  entityPath/entity_count_{type}_{part}.pt  an int (dynamic_rel_count.pt in dynamic mode)
  outdir/CHECKPOINT_VERSION                 the newest version N as ASCII; absent (or 0):
                                            file names carry no version suffix
  outdir/METADATA_1.pt.N                    (config dict with camelCase keys, edge path
                                            count, pass, model state dict without the
                                            entity embeddings, optimizer state dict)
  outdir/{type}_{part}.pt.N                 (embeddings [n, dim], maybe an nn.Parameter;
                                            RowAdagrad state dict or None)
Partitions are numbered from the index base b, 1 as the document says (METADATA_1);
PBG's code of the time also wrote b = 0, named by METADATA_0. An init directory
(loadPath) may lack the metadata, the version file and the optimizer states.

`migrate_run` (python -m pbg_ray.migrate) writes such a run as a v1 checkpoint directory;
`resolve_init_path` turns a pre-1.0 directory or a model bundle given as init_path into one.
torch loads only in the functions that decode torch.save files: a training driver imports
this module to recognise an init_path and never loads torch for a v1 one.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from pbg_ray.checkpoints import bundle
from pbg_ray.checkpoints.directory import public_name, row_adagrad_sums
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.entities import num_relation_ids, save_dynamic_rel_count, save_entity_count
from pbg_ray.io.files import PathLike, atomic_directory
from pbg_ray.model.params import params_from_checkpoint

VERSION_FILE = "CHECKPOINT_VERSION"
METADATA_ENTITY = "METADATA"
ENTITIES_DIR = "entities"  # where a migrated run's entity counts go, inside NEW_DIR
# Keys whose pre-1.0 name is not the camelCase spelling of the v1 one.
RENAMED_KEYS = {"outdir": "checkpoint_path", "loadPath": "init_path"}
_PT_FILE = re.compile(r"(?P<name>.+)_(?P<part>\d+)\.pt(\.(?P<version>\d+))?")


def _snake_case(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower()


def _snake_keys(value: Any) -> Any:
    return {_snake_case(k): v for k, v in value.items()} if isinstance(value, Mapping) else value


def v1_config_dict(legacy: Mapping[str, Any]) -> Dict[str, Any]:
    """A pre-1.0 config dict with v1 key names (entityPath -> entity_path, outdir ->
    checkpoint_path, ...); entity type names are kept as they are."""
    data = {RENAMED_KEYS.get(k, _snake_case(k)): v for k, v in legacy.items()}
    if isinstance(data.get("entities"), Mapping):
        data["entities"] = {name: _snake_keys(e) for name, e in data["entities"].items()}
    if isinstance(data.get("relations"), list):
        data["relations"] = [_snake_keys(r) for r in data["relations"]]
    return data


def torch_load(path: Path, what: str) -> Any:
    """A torch.save'd file, read without running pickled code (weights_only)."""
    import torch

    if not path.is_file():
        raise PbgRayError(f"{what} file {str(path)!r} is missing.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise PbgRayError(f"{what} file {str(path)!r} is not a readable torch.save file "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
                          "Restore it from the original run.") from None


def _integer(value: Any, path: Path, what: str) -> int:
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PbgRayError(f"{what} file {str(path)!r} must hold a non-negative integer, "
                          f"found {type(value).__name__} {str(value)[:40]}.")
    return value


def is_legacy_checkpoint(path: PathLike) -> bool:
    """Whether `path` is a directory in the pre-1.0 layout (version file or .pt files)."""
    path = Path(path)
    return path.is_dir() and ((path / VERSION_FILE).is_file() or any(
        _PT_FILE.fullmatch(p.name) for p in path.iterdir()))


@dataclasses.dataclass
class LegacyMetadata:
    config: Dict[str, Any]  # as saved: camelCase keys
    edge_path_count: int
    pass_idx: int
    model_state: Dict[str, Any]  # torchbiggraph state dict keys -> tensors
    optim_state: Optional[Dict[str, Any]]


class LegacyCheckpoint:
    """The newest version of a pre-1.0 checkpoint directory (outdir or loadPath)."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path).absolute()
        if not self.path.is_dir():
            raise PbgRayError(f"{str(self.path)!r} is not a directory. Give the outdir of a "
                              "pre-1.0 PyTorch-BigGraph run.")
        self.version = self._load_version()
        ext = self.extension
        self.files = {m.group("name", "part"): p for p in self.path.iterdir()
                      if (m := _PT_FILE.fullmatch(p.name)) and p.name.endswith(".pt" + ext)}
        if not self.files:
            versions = sorted({int(m.group("version") or 0) for p in self.path.iterdir()
                               if (m := _PT_FILE.fullmatch(p.name))})
            raise PbgRayError(
                f"{str(self.path)!r} holds no pre-1.0 checkpoint file of version {self.version} "
                f"(named like user_1.pt{ext}; versions found: {versions or 'none'}). "
                f"Write the newest version into {VERSION_FILE}, or check the directory.")
        # METADATA_0 says the run numbered partitions from 0; without metadata, a
        # partition 0 file does.
        bases = [int(part) for name, part in self.files if name == METADATA_ENTITY]
        self.index_base = bases[0] if bases else int(
            not any(part == "0" for name, part in self.files if not self._is_count(name)))

    @property
    def extension(self) -> str:
        return f".{self.version}" if self.version > 0 else ""

    @staticmethod
    def _is_count(name: str) -> bool:
        return name.startswith("entity_count_")

    def _load_version(self) -> int:
        path = self.path / VERSION_FILE
        if not path.is_file():
            return 0
        text = path.read_text(errors="replace").strip()
        if not text:
            return 0
        if not text.isdigit():
            raise PbgRayError(f"{str(path)!r} must hold the newest checkpoint version as a decimal "
                              f"number, found {text[:40]!r}.")
        return int(text)

    def partitions(self) -> List[Tuple[str, int]]:
        """(entity type, 0-based partition) of every embeddings file."""
        return sorted((name, int(part) - self.index_base) for name, part in self.files
                      if name != METADATA_ENTITY and not self._is_count(name))

    def partition_file(self, entity: str, part: int) -> Path:
        return self.path / f"{entity}_{part + self.index_base}.pt{self.extension}"

    def metadata_file(self) -> Path:
        return self.path / f"{METADATA_ENTITY}_{self.index_base}.pt{self.extension}"

    def read_metadata(self) -> Optional[LegacyMetadata]:
        """The metadata tuple, None for an init directory without one."""
        path = self.metadata_file()
        if not path.is_file():
            return None
        data = torch_load(path, "metadata")
        if not (isinstance(data, tuple) and len(data) == 5 and isinstance(data[0], Mapping)
                and isinstance(data[3], Mapping)):
            raise PbgRayError(f"metadata file {str(path)!r} must hold a tuple (config dict, int, "
                              "int, model state dict, optimizer state), found "
                              f"{type(data).__name__} {str(data)[:80]}.")
        config, edge_path_count, pass_idx, model_state, optim_state = data
        return LegacyMetadata(dict(config), _integer(edge_path_count, path, "metadata"),
                              _integer(pass_idx, path, "metadata"), dict(model_state), optim_state)

    def read_partition(self, entity: str, part: int
                       ) -> Tuple[np.ndarray, Optional[Dict[str, Any]]]:
        """(float32 embeddings [n, dim], RowAdagrad state dict or None) of a partition."""
        import torch

        path = self.partition_file(entity, part)
        data = torch_load(path, "embeddings")
        if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], torch.Tensor)
                and data[0].ndim == 2 and data[0].is_floating_point()):
            raise PbgRayError(f"embeddings file {str(path)!r} must hold a tuple (2-D float tensor "
                              f"[entities, dimension], optimizer state), found {str(data)[:80]}.")
        embeddings = data[0].detach().to(torch.float32).numpy()
        row_adagrad_sums(data[1], len(embeddings), str(path))  # refuse a malformed state
        return embeddings, data[1]


def model_arrays(model_state: Mapping[str, Any], where: str) -> Dict[str, np.ndarray]:
    """Public parameter name -> float32 array of a torchbiggraph model state dict."""
    import torch

    arrays = {}
    for key, value in model_state.items():
        name = public_name(key)
        if name is None or not isinstance(value, torch.Tensor):
            raise PbgRayError(f"{where}: model state dict entry {key!r} is not a relation operator "
                              "parameter ({side}_operators.{idx}.{param}) or a global embedding "
                              "(global_embs.emb_{type}); pbg_ray can't place it.")
        arrays[name] = value.detach().to(torch.float32).numpy()
    return arrays


def write_v1(legacy: LegacyCheckpoint, target: CheckpointManager, version: int,
             keys: List[Tuple[str, int]], metadata: Optional[LegacyMetadata],
             attrs: Mapping[str, Any]) -> Dict[Tuple[str, int], int]:
    """The partitions `keys` (and the model, if there is metadata) as v1 files of `version`
    in `target`; returns each partition's entity count."""
    counts = {}
    for entity, part in keys:
        embeddings, optim_state = legacy.read_partition(entity, part)
        target.write_partition(version, entity, part, embeddings, optim_state, attrs)
        counts[entity, part] = len(embeddings)
    if metadata is not None:
        arrays = model_arrays(metadata.model_state, str(legacy.metadata_file()))
        target.write_model(version, arrays, metadata.optim_state, attrs)
    return counts


def _check_counts(entity_dir: Path, counts: Mapping[Tuple[str, int], int],
                  index_base: int) -> None:
    """Refuse entity count files in entity_dir that disagree with the embeddings."""
    for (entity, part), rows in counts.items():
        path = entity_dir / f"entity_count_{entity}_{part + index_base}.pt"
        if not path.is_file():
            continue
        count = _integer(torch_load(path, "entity count"), path, "entity count")
        if count != rows:
            raise PbgRayError(f"entity count file {str(path)!r} says {count} entities but the "
                              f"checkpoint has {rows} embeddings for {entity!r} partition {part}. "
                              "Pass the entity directory of this run (--entity-path).")


def migrate_run(old_dir: PathLike, new_dir: PathLike,
                entity_path: Optional[PathLike] = None) -> Dict[str, Any]:
    """Write the pre-1.0 run in old_dir as a v1 checkpoint directory new_dir (absent or
    empty): config.json with v1 keys (checkpoint_path new_dir, entity_path
    new_dir/entities, which receives the entity counts), the newest version's model and
    embeddings with their optimizer states. entity_path: where the run's
    entity_count_*.pt files are, if not at the config's entityPath. new_dir appears
    only once complete."""
    new = Path(new_dir).absolute()
    if new.exists() and (not new.is_dir() or any(new.iterdir())):
        raise PbgRayError(f"{str(new)!r} already exists and is not empty. Migrate into a new "
                          "directory.")
    legacy = LegacyCheckpoint(old_dir)
    metadata = legacy.read_metadata()
    if metadata is None:
        raise PbgRayError(
            f"{str(legacy.path)!r} has no {legacy.metadata_file().name}, so the run's config is "
            "unknown: it is an init directory (loadPath). Give it as init_path instead, or "
            "migrate the outdir of the run.")
    source = f"{legacy.metadata_file()}: config"
    data = v1_config_dict(metadata.config)
    entity_dirs = [Path(entity_path)] if entity_path else [
        Path(p) for p in (data.get("entity_path"), legacy.path) if p and Path(p).is_dir()]
    data.update(checkpoint_path=str(new), entity_path=str(new / ENTITIES_DIR))
    config = ConfigSchema.from_dict(data, source=source)
    keys = [(e, p) for e, econf in config.entities.items() for p in range(econf.num_partitions)]
    missing = [str(legacy.partition_file(*k)) for k in keys if not legacy.partition_file(*k).is_file()]
    if missing:
        raise PbgRayError(f"{len(missing)} embeddings file(s) of version {legacy.version} named by "
                          f"the config are missing, e.g. {missing[0]!r}. Restore them from the run.")
    version = max(legacy.version, 1)
    attrs = {"config/json": json.dumps(config.to_dict()), "migrated_from": str(legacy.path),
             "legacy/edge_path_count": metadata.edge_path_count, "legacy/pass": metadata.pass_idx}
    with atomic_directory(new) as stage:
        staged_checkpoint = CheckpointManager(stage)
        counts = write_v1(legacy, staged_checkpoint, version, keys, metadata, attrs)
        for entity_dir in entity_dirs:
            _check_counts(entity_dir, counts, legacy.index_base)
        for (entity, part), count in counts.items():
            save_entity_count(stage / ENTITIES_DIR, entity, part, count)
        staged = dataclasses.replace(config, entity_path=str(stage / ENTITIES_DIR))
        if config.dynamic_relations:
            count_file = [d / "dynamic_rel_count.pt" for d in entity_dirs
                          if (d / "dynamic_rel_count.pt").is_file()]
            if not count_file:
                raise PbgRayError(f"dynamic_relations is set but no dynamic_rel_count.pt is in "
                                  f"{[str(d) for d in entity_dirs]}. Pass the run's entity "
                                  "directory (--entity-path).")
            save_dynamic_rel_count(stage / ENTITIES_DIR, _integer(
                torch_load(count_file[0], "relation count"), count_file[0], "relation count"))
        # The model must fit the config: names and shapes, as training will need them.
        params_from_checkpoint(staged, num_relation_ids(staged),
                               *staged_checkpoint.read_model(version))
        staged_checkpoint.write_config(config)
        staged_checkpoint.switch_to(version)
    return {"old_dir": str(legacy.path), "new_dir": str(new), "version": version,
            "partitions": len(keys), "entities": sum(counts.values())}


def check_init_path(init_path: str) -> None:
    """Refuse an init_path that holds nothing to start from."""
    path = Path(init_path)
    if not (CheckpointManager(init_path).exists() or bundle.is_bundle(path)
            or is_legacy_checkpoint(path)):
        raise PbgRayError(
            f"init_path {init_path!r} holds no checkpoint: it is neither a checkpoint_path "
            "with checkpoint_version.txt, a pre-1.0 PBG run nor a model bundle. Point it at "
            "one, or set init_path=null to start from random embeddings.")


def resolve_init_path(init_path: str, scratch_dir: PathLike) -> str:
    """init_path as a v1 checkpoint directory: a v1 one as it is; a pre-1.0 directory
    (its newest version) or a model bundle (its newest tag) converted into scratch_dir,
    which is replaced."""
    path = Path(init_path)
    is_bundle = bundle.is_bundle(path)
    if CheckpointManager(path).exists() or not (
            is_bundle or is_legacy_checkpoint(path)):
        return init_path
    scratch = Path(scratch_dir)
    for stale in [scratch, *scratch.parent.glob(f".{scratch.name}.staging-*")]:  # earlier runs'
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_directory(scratch) as stage:
        if is_bundle:
            with bundle.load(path) as model:
                model.to_checkpoint(stage)
        else:
            legacy = LegacyCheckpoint(path)
            checkpoint = CheckpointManager(stage)
            version = max(legacy.version, 1)
            write_v1(legacy, checkpoint, version, legacy.partitions(), legacy.read_metadata(),
                     {"migrated_from": str(legacy.path)})
            checkpoint.switch_to(version)
    return str(scratch)
