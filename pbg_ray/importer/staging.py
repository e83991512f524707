"""The staging and commit phase: an import's files appear in place all at once, or not at all.

Every file is first written into staging directories: inside each output directory when
it is local (then renamed into place), in local scratch space for object storage (then
uploaded). Once all are written, `ImportTarget.commit` moves them into place: the graph
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
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.files import write_text_atomic
from pbg_ray.io.storage import StoragePath, move_into, storage_path

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
        """What makes two imports the same: inputs (with size and mtime), graph, settings."""
        inputs = []
        for path in self.config.importer.inputs:
            stat = Path(path).stat() if Path(path).is_file() else None
            inputs.append({"path": os.path.abspath(path), "size": stat and stat.st_size,
                           "mtime_ns": stat and stat.st_mtime_ns})
        config = self.config.to_dict()
        settings = {k: v for k, v in config["importer"].items() if k not in ("inputs", "overwrite")}
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
                move_into(path, output / path.name)
        for path in sorted(stages.entities.iterdir()):
            if path.name != MANIFEST:
                move_into(path, self.entity_path / path.name)
        write_text_atomic(self.entity_path / MANIFEST,
                          json.dumps({"identity": self.identity(), "stats": stats}, indent=1))


@dataclasses.dataclass
class Staging:
    """The staging directories of one import: `entities` for entity_path, `edges[i]` for
    output edge path i."""

    entities: Path
    edges: List[Path]


@contextlib.contextmanager
def staging(target: ImportTarget) -> Iterator[Staging]:
    """Fresh staging directories for `target`, removed however the block ends. Files
    for a local output directory are staged inside it (then renamed into place), those
    for object storage in local scratch space (then uploaded)."""
    tag = f".import-{os.getpid()}"
    scratch = Path(tempfile.mkdtemp(prefix="pbg_ray-import-"))

    def stage_dir(output: StoragePath) -> Path:
        return output if isinstance(output, Path) else scratch

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
            shutil.rmtree(stage, ignore_errors=True)
