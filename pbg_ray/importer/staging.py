"""The staging and commit phase: an import's files appear in place all at once, or not at all.

Every file is first written into staging directories: inside each output directory when
it is local (then renamed into place); for object storage in local scratch space (then
uploaded), or, when tasks on other nodes write them (the Ray engine), under the
output's prefix (then copied inside the store). Once all are written,
`ImportTarget.commit` moves them into place: the graph
files already there are removed (the manifest first, so that a half-replaced graph never
looks complete), then buckets are moved, entity files next, the manifest last. Staging
directories are removed however the import ends, so a failure before the commit leaves
the output directories as they were.

The manifest (pbg_ray_import.json in entity_path) records what was imported and its
stats: the same import run again is a no-op, and a different graph in the output
directories is refused unless importer.overwrite is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.files import write_text_atomic
from pbg_ray.io.raw import input_shards
from pbg_ray.io.storage import ObjectPath, StoragePath, move_into, replace, storage_path

MANIFEST = "pbg_ray_import.json"
GRAPH_FILE_PATTERNS = ("entity_count_*.txt", "entity_names_*.json", "dynamic_rel_count.txt",
                       "dynamic_rel_names.json", "edges_*_*.h5", MANIFEST)


class ImportTarget:
    """The output directories of an import (entity_path, then edge_paths and
    eval_edge_paths) and the manifest that says what they hold."""

    def __init__(self, config: ConfigSchema) -> None:
        self.config = config
        self.entity_path = storage_path(config.entity_path)
        self.edge_paths = [storage_path(p) for p in config.edge_paths + config.eval_edge_paths]

    def graph_files(self) -> List[StoragePath]:
        dirs = [self.entity_path] + self.edge_paths
        return sorted({p for d in dirs if d.is_dir() for pattern in GRAPH_FILE_PATTERNS
                       for p in d.glob(pattern)})

    def identity(self) -> Dict[str, Any]:
        """What makes two imports the same: inputs (each shard with size and mtime), graph,
        settings (the engine aside: both give the same graph)."""
        inputs = [{"path": str(storage_path(spec).absolute()),
                   "shards": [[str(s.path), s.size, s.mtime_ns] for s in input_shards(spec)]}
                  for spec in self.config.importer.inputs]
        config = self.config.to_dict()
        settings = {k: v for k, v in config["importer"].items()
                    if k not in ("inputs", "overwrite", "engine", "ray_min_bytes")}
        return {"inputs": inputs, "outputs": [str(p) for p in self.edge_paths],
                "entities": config["entities"], "relations": config["relations"],
                "dynamic_relations": config["dynamic_relations"], "importer": settings}

    def done(self) -> Optional[Dict[str, Any]]:
        """The stats of this very import if it is already in place; refuses a different
        graph in the output directories unless importer.overwrite is set."""
        existing = self.graph_files()
        if not existing:
            return None
        try:
            previous = json.loads((self.entity_path / MANIFEST).read_text())
        except (OSError, ValueError):
            previous = {}
        if previous.get("identity") == self.identity():
            return previous.get("stats")
        if self.config.importer.overwrite:
            return None
        raise PbgRayError(
            f"the output directories already hold a different graph ({len(existing)} files, e.g. "
            f"{str(existing[0])!r}){'' if previous else ', not imported by pbg_ray'}. Set "
            "importer.overwrite=true to replace it, or point entity_path and edge_paths elsewhere.")

    def commit(self, stages: Staging, stats: Dict[str, Any]) -> None:
        """Move the staged files into place (rename, or upload to object storage):
        buckets, entity files, the manifest with `stats` last."""
        for path in self.graph_files():
            if path.name == MANIFEST:
                path.unlink()  # first: a half-replaced graph must not look complete
        for path in self.graph_files():
            path.unlink()
        for stage, output in zip(stages.edges, self.edge_paths):
            for path in sorted(stage.glob("edges_*_*.h5")):
                _into_place(path, output / path.name)
        for path in sorted(stages.entities.iterdir()):
            if path.name != MANIFEST:
                _into_place(path, self.entity_path / path.name)
        write_text_atomic(self.entity_path / MANIFEST,
                          json.dumps({"identity": self.identity(), "stats": stats}, indent=1))


def _into_place(staged: StoragePath, target: StoragePath) -> None:
    """A staged file to its place: renamed, uploaded, or copied inside the object store."""
    (replace if isinstance(staged, ObjectPath) else move_into)(staged, target)


def _remove(stage: StoragePath) -> None:
    """A staging directory and its files, whatever is left of them."""
    if isinstance(stage, ObjectPath):
        with contextlib.suppress(OSError):
            stage.fs.delete_dir(stage.fs_path)
    else:
        shutil.rmtree(stage, ignore_errors=True)


@dataclasses.dataclass
class Staging:
    """The staging directories of one import: `entities` for entity_path, `edges[i]` for
    output edge path i."""

    entities: StoragePath
    edges: List[StoragePath]


@contextlib.contextmanager
def staging(target: ImportTarget, shared: bool = False) -> Iterator[Staging]:
    """Fresh staging directories for `target`, removed however the block ends. Files
    for a local output directory are staged inside it (then renamed into place); those
    for object storage in local scratch space (then uploaded), or with `shared` (written
    by tasks on any node) under the output's prefix (then copied inside the store)."""
    tag = f".import-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    scratch = Path(tempfile.mkdtemp(prefix="pbg_ray-import-"))

    def stage_dir(output: StoragePath) -> StoragePath:
        return output if isinstance(output, Path) or shared else scratch

    stages = Staging(stage_dir(target.entity_path) / f"{tag}-entities",
                     [stage_dir(path) / f"{tag}-edges{i}"
                      for i, path in enumerate(target.edge_paths)])
    dirs = [stages.entities, *stages.edges, scratch]
    try:
        for stage in dirs:
            stage.mkdir(parents=True, exist_ok=True)
        yield stages
    finally:
        for stage in dirs:
            _remove(stage)
