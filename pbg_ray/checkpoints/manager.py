"""CheckpointManager: the one way to a checkpoint directory, as PBG's CheckpointManager is.

It owns the directory's CheckpointStorage (the v1 files, pbg_ray.checkpoints.directory) and
speaks in versions:

- a training run: `resume` (the current version, checked against the run's config),
  `session` (the run's lock, leftovers of an interrupted run removed, stats of passes that
  never became current dropped), `commit` (stats appended, the new version made current,
  preserved every k epochs, the superseded one dropped), `rollback` (an unfinished
  version's files removed), `read_stats`;
- readers (eval, predict, export, serve, incremental growth, plot): `locate` a version
  (here, in an epoch_{k}/ snapshot, or the best on validation in best/; `holding` finds
  the directory of a version's files), `with_trained_model` (the reader's config with the
  model that version was trained with), `read_config`, `read_model`, `read_partition`;
- writers of single files (partition stores, the parameter server, migrate, bundles):
  `write_partition`, `write_model`, `write_config`, `switch_to`, and the swap files of
  disk placement.

Every write is atomic and a version becomes current only when all its files exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.files import PathLike
from pbg_ray.io.storage import StoragePath, append_text
from pbg_ray.types import EntityName, Partition

# Keys that must match between a run and the checkpoint it resumes.
RESUME_KEYS = ("entities", "relations", "dimension", "global_emb", "dynamic_relations", "bias")
# Keys of the model a version was trained with, besides each entity type's dimension and
# each relation's operator: its readers (eval, export, serve) take them from the config.json
# beside it, so that a config of the graph reads a checkpoint of any model of it (a Ray Tune
# trial's, say, whose dimension was sampled).
MODEL_KEYS = ("dimension", "max_norm", "global_emb", "comparator", "bias")
EVAL_STATS_FILE = "eval_stats.json"  # JSON lines, one per python -m pbg_ray.eval

Arrays = Tuple[np.ndarray, Optional[Dict[str, Any]]]
logger = logging.getLogger("pbg_ray")


def graph_of(config: ConfigSchema) -> Dict[str, Any]:
    """The graph a config describes, by key: what the readers of a checkpoint share with
    the run that trained it."""
    return {"entity types": {name: {"num_partitions": e.num_partitions,
                                    "featurized": e.featurized}
                             for name, e in sorted(config.entities.items())},
            "relations": [{"name": r.name, "lhs": r.lhs, "rhs": r.rhs} for r in config.relations],
            "dynamic_relations": config.dynamic_relations}


def model_keys(config: ConfigSchema) -> Dict[str, Any]:
    """The model's keys of a config (with_trained_model), as on the command line."""
    return {**{key: getattr(config, key) for key in MODEL_KEYS},
            **{f"entities.{name}.dimension": e.dimension for name, e in config.entities.items()},
            **{f"relations.{i}.operator": r.operator for i, r in enumerate(config.relations)}}


class CheckpointManager:
    """The versions of one checkpoint directory (a local path or a URI)."""

    def __init__(self, path: PathLike) -> None:
        self.storage = CheckpointStorage(path)

    @property
    def path(self) -> StoragePath:
        return self.storage.path

    # --- a training run ---------------------------------------------------

    def resume(self, config: ConfigSchema) -> int:
        """The current version (0 for a new directory, which is not created yet), refused
        when incomplete or when it holds a different graph or model than `config`."""
        version = self.storage.load_version()
        if version > 0:
            self.storage.check_version(version, config)
            previous = self.storage.load_config()
            for key in RESUME_KEYS:
                if getattr(previous, key) != getattr(config, key):
                    raise PbgRayError(
                        f"checkpoint_path {str(self.path)!r} holds a run whose {key!r} differs "
                        f"from this config's ({getattr(previous, key)!r} there, "
                        f"{getattr(config, key)!r} here), so it can't be resumed. Use another "
                        "checkpoint_path, or init_path to start from its embeddings.")
        return version

    @contextlib.contextmanager
    def session(self, version: int, keep_stats: Callable[[Dict[str, Any]], bool]) -> Iterator[int]:
        """Hold the directory for one run that resumes `version`; yields the number of
        stats lines kept. Before: an interrupted run's leftovers (temporary files, parts
        of an unfinished version) and the stats lines `keep_stats` refuses go. After,
        however the run ends: leftovers of an unfinished version and swap files go. (The
        config is written with each version, so a run that fails before its first one
        leaves the directory's config.json as it was.)"""
        with self.storage.lock():
            self.storage.remove_leftovers(version)
            self.storage.keep_stats(keep_stats)
            try:
                yield sum(1 for _ in self.storage.load_stats())
            finally:
                self.rollback()

    def commit(self, version: int, stats: List[Dict[str, Any]], config: ConfigSchema,
               preserve_as_epoch: Optional[int] = None, best: bool = False,
               release: Callable[[int], None] = lambda superseded: None) -> None:
        """Make `version`, whose files are all written, current: its stats lines are
        appended, the run's config is written, checkpoint_version.txt names it, a copy goes
        to epoch_{k}/ when `preserve_as_epoch` is k and to best/ when it is the `best` on
        validation so far; then `release(version - 1)` lets the writers reuse the
        superseded version's files (disk placement recycles them as swap files) and what
        is left of that version is dropped."""
        self.storage.append_stats(stats)
        self.storage.save_config(config)
        self.storage.save_version(version)
        if preserve_as_epoch is not None:
            self.storage.preserve_version(
                version, self.storage.snapshot_path(preserve_as_epoch), config)
        if best:
            self.storage.preserve_version(version, self.storage.best_path(), config)
        if version > 1:
            release(version - 1)
            self.storage.drop_version(version - 1, config)

    def rollback(self) -> None:
        """Remove what is not part of the current version: an unfinished version's files,
        temporary and swap files."""
        self.storage.remove_leftovers(self.storage.load_version())

    def read_stats(self) -> Iterator[Dict[str, Any]]:
        """The lines of training_stats.json of complete passes."""
        return self.storage.load_stats()

    # --- readers ------------------------------------------------------------

    def version(self) -> int:
        """The current version, 0 if there is none."""
        return self.storage.load_version()

    def exists(self) -> bool:
        """Whether the directory is a v1 checkpoint (it names a current version)."""
        return self.storage.version_file().is_file()

    def best_version(self) -> int:
        """The version best on validation, kept in best/ (validation.edge_paths); 0 if none."""
        return CheckpointManager(self.storage.best_path()).version()

    def default_version(self, best: bool = True) -> int:
        """The version a reader takes when none is asked for: with `best`, the one best/
        keeps where training kept one, else the newest; 0 if there is none."""
        return (best and self.best_version()) or self.version()

    def kept(self) -> List["CheckpointManager"]:
        """This directory, then its epoch_{k}/ snapshots and best/: where a version's files
        may be."""
        return ([self] + [CheckpointManager(p) for p in sorted(self.path.glob("epoch_*"))]
                + [CheckpointManager(self.storage.best_path())])

    def holding(self, version: int) -> "CheckpointManager":
        """The manager of the directory whose files are those of `version`: this one, an
        epoch_{k}/ snapshot or best/ (a version superseded here lives on there only); this
        one where none holds it (its reads then name the missing file)."""
        return next((c for c in self.kept() if c.has_model(version)), self)

    def locate(self, config: ConfigSchema, version: Optional[int], setting: str,
               best: bool = True) -> Tuple["CheckpointManager", int]:
        """(the manager of the directory holding `version`, version): for version None the
        default_version (with `best`: the one best on validation, in best/, where a run
        with validation.edge_paths kept one; else the newest, this directory); an older one
        from an epoch_{k}/ snapshot (checkpoint_preservation_interval) or best/. `setting`
        names the key that picks the version, for the message. Refused where the version's
        files are not all there, or its config.json describes another graph (trained_on)."""
        candidates = [c for c in self.kept() if c.exists()]
        if not candidates:
            raise PbgRayError(f"{str(self.path)!r} holds no checkpoint. Train first "
                              "(python -m pbg_ray.train) or check checkpoint_path.")
        if version is None:
            version = self.default_version(best)
        for candidate in candidates:
            if version > 0 and candidate.version() == version:
                if candidate.storage.config_file().is_file():
                    candidate.trained_on(config)
                candidate.storage.check_version(version, config)
                return candidate, version
        found = sorted({c.version() for c in candidates} - {0})
        raise PbgRayError(f"checkpoint version {version} is not in {str(self.path)!r} "
                          f"(versions there: {found or 'none'}). Set {setting} to one of them.")

    def read_config(self) -> ConfigSchema:
        return self.storage.load_config()

    def trained_on(self, config: ConfigSchema) -> ConfigSchema:
        """The config this directory's run was trained with (its config.json), refused in
        one line where it describes another graph than `config` (entity types, their
        partitions, relations and their sides)."""
        trained = self.read_config()
        for key, there in graph_of(trained).items():
            here = graph_of(config)[key]
            if there != here:
                raise PbgRayError(
                    f"{str(self.path)!r} holds a model of another graph: its {key} differ from "
                    f"this config's ({there!r} there, {here!r} here). Point checkpoint_path at "
                    "a checkpoint of this config's graph, or use the config it was trained "
                    "with.")
        return trained

    def with_trained_model(self, config: ConfigSchema, version: int) -> ConfigSchema:
        """`config` with the model that version `version` of this directory was trained
        with (MODEL_KEYS, each entity type's dimension and each relation's operator, from
        its config.json), a warning naming the keys that differed. Refused in one line
        where the config describes another graph (entity types, their partitions,
        relations and their sides)."""
        trained = self.trained_on(config)
        model = dataclasses.replace(
            config, **{key: getattr(trained, key) for key in MODEL_KEYS},
            entities={name: dataclasses.replace(e, dimension=trained.entities[name].dimension)
                      for name, e in config.entities.items()},
            relations=[dataclasses.replace(r, operator=t.operator)
                       for r, t in zip(config.relations, trained.relations)])
        differ = [f"{key}={value} (this config: {model_keys(config)[key]})"
                  for key, value in model_keys(model).items() if value != model_keys(config)[key]]
        if differ:
            logger.warning("version %d of %r was trained with %s: the model's keys are taken "
                           "from its config.json.", version, str(self.path), ", ".join(differ))
        return model

    def read_model(self, version: int) -> Tuple[Dict[str, np.ndarray], Optional[Dict[str, Any]]]:
        """The relation and global parameters by public name, and the optimizer state."""
        return self.storage.load_model(version)

    def read_partition(self, version: int, entity: EntityName, part: Partition) -> Arrays:
        """A partition's embeddings and RowAdagrad state."""
        return self.storage.load_entity_partition(version, entity, part)

    def partition_size(self, version: int, entity: EntityName, part: Partition) -> int:
        """The number of entities of a partition's embeddings file."""
        return self.storage.count_entity_rows(self.partition_file(version, entity, part))

    def read_partition_rows(self, version: int, entity: EntityName, part: Partition,
                            offsets: np.ndarray) -> np.ndarray:
        """The embeddings at `offsets` of a partition, read without the rest of it."""
        return self.storage.read_entity_rows(self.partition_file(version, entity, part), offsets)

    def has_partition(self, version: int, entity: EntityName, part: Partition) -> bool:
        return self.partition_file(version, entity, part).is_file()

    def has_model(self, version: int) -> bool:
        return self.model_file(version).is_file()

    def partition_file(self, version: int, entity: EntityName, part: Partition) -> StoragePath:
        return self.storage.partition_file(version, entity, part)

    def model_file(self, version: int) -> StoragePath:
        return self.storage.model_file(version)

    def stats_file(self) -> StoragePath:
        return self.storage.stats_file()

    def append_eval_stats(self, line: str) -> None:
        """One JSON line of `python -m pbg_ray.eval`'s report into eval_stats.json."""
        append_text(self.path / EVAL_STATS_FILE, line)

    # --- writers of single files -------------------------------------------------

    def write_partition(self, version: int, entity: EntityName, part: Partition,
                        embeddings: np.ndarray, optim_state: Optional[Mapping[str, Any]],
                        metadata: Mapping[str, Any] = {}) -> None:
        self.storage.save_entity_partition(version, entity, part, embeddings, optim_state,
                                           metadata)

    def write_model(self, version: int, params: Mapping[str, np.ndarray],
                    optim_state: Optional[Mapping[str, Any]],
                    metadata: Mapping[str, Any] = {}) -> None:
        self.storage.save_model(version, params, optim_state, metadata)

    def prepare(self) -> None:
        """Create the directory (nothing on object storage, which has none)."""
        self.storage.prepare()

    def write_config(self, config: ConfigSchema) -> None:
        self.storage.save_config(config)

    def switch_to(self, version: int) -> None:
        """Make `version` current; call only once all of its files are written."""
        self.storage.save_version(version)

    def swap_file(self, owner: str, number: int) -> StoragePath:
        """Disk placement: the `number`-th swap file of partition store `owner`."""
        return self.storage.swap_file(owner, number)

    def swap_files(self, owner: str) -> List[StoragePath]:
        return self.storage.swap_files(owner)

    # The files of one partition, by path (disk placement's train tasks and swap files).
    read_partition_file = staticmethod(CheckpointStorage.read_entity_partition)
    write_partition_file = staticmethod(CheckpointStorage.write_entity_partition)
