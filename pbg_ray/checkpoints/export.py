"""A checkpoint version's embeddings (global embeddings added, as PBG does) and relation
parameters as TSV in torchbiggraph_export_to_tsv's layout or as Parquet, one partition at a
time (pbg_ray.io.embedding_tables), or versions and reduced-precision variants of them as a
model bundle (pbg_ray.checkpoints.bundle). Settings: the `export` section.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import numpy as np

from pbg_ray.checkpoints.bundle import BUNDLE_FILE, write_checkpoint_bundle
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.embedding_tables import EmbeddingTables
from pbg_ray.io.entities import load_entity_names, load_relation_names
from pbg_ray.io.storage import storage_path
from pbg_ray.model.params import global_emb_key, param_layout


def export_bundle(config: ConfigSchema) -> Dict[str, Any]:
    """Write `config.export.versions` of config's checkpoint as a model bundle."""
    settings = config.export
    wanted = sorted(set(settings.versions)) if settings.versions else [settings.version]
    checkpoints = CheckpointManager(config.checkpoint_path)
    located = [checkpoints.locate(config, v, "export.versions") for v in wanted]
    output = storage_path(settings.output) if settings.output else located[-1][0].path / "export"
    path = output / BUNDLE_FILE
    tags = write_checkpoint_bundle(path, config, located, settings.variants)
    return {"checkpoint_path": str(located[-1][0].path), "versions": [v for _, v in located],
            "format": "bundle", "file": str(path), "file_bytes": os.path.getsize(path), "tags": tags}


def export_checkpoint(config: ConfigSchema) -> Dict[str, Any]:
    """Export `config.export.version` of config's checkpoint; returns what was written."""
    settings = config.export
    if settings.format == "bundle":
        return export_bundle(config)
    if settings.versions is not None or settings.variants != ["fp32"]:
        raise PbgRayError("export.versions and export.variants apply to export.format=bundle; "
                          f"with format={settings.format} use export.version.")
    checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
        config, settings.version, "export.version")
    output = storage_path(settings.output) if settings.output else checkpoint.path / "export"
    stored, _ = checkpoint.read_model(version)
    relation_names = (load_relation_names(config.entity_path) if config.dynamic_relations
                      else [r.name for r in config.relations])
    # Every parameter in torchbiggraph's order; missing ones at their initial values, as PBG's
    # make_model + load_state_dict(strict=False) would have them.
    params = {name: stored.get(name, init) for name, init in param_layout(config, len(relation_names))}
    num_entities = 0
    with EmbeddingTables(output, settings.format) as tables:
        tables.expect_dimensions({config.entity_dimension(e) for e in config.entities})
        for entity, econf in config.entities.items():
            global_emb = params.get(global_emb_key(entity))
            for part in range(econf.num_partitions):
                names = load_entity_names(config.entity_path, entity, part)
                embeddings, _ = checkpoint.read_partition(version, entity, part)
                if len(names) != len(embeddings):
                    raise PbgRayError(
                        f"entity type {entity!r} partition {part}: {len(names)} names in "
                        f"entity_path but {len(embeddings)} embeddings in version {version}. "
                        "The checkpoint was trained on another import; check entity_path.")
                if global_emb is not None:
                    embeddings += global_emb
                tables.write_entities(entity, part, names, embeddings)
                num_entities += len(names)
        for name, value in params.items():
            if not name.startswith("relations/"):
                continue
            _, idx, _, side, param = name.split("/")
            rel = config.relations[int(idx)]
            if config.dynamic_relations:  # one row of the stacked parameter per relation
                for rel_name, row in zip(relation_names, np.asarray(value)):
                    tables.write_relation_parameter(rel_name, side, rel.operator, param, row)
            else:
                tables.write_relation_parameter(rel.name, side, rel.operator, param, np.asarray(value))
    return {"checkpoint_path": str(checkpoint.path), "version": version, "format": settings.format,
            "entities": num_entities, "files": [str(p) for p in tables.files]}


def print_sizes(tags: List[Dict[str, Any]]) -> None:
    """Each bundle tag's bytes of parameters, reduced ones beside their version's fp32 tag."""
    full = {t["version"]: t for t in tags if t["precision"] == "fp32"}
    for tag in tags:
        line = f"tag {tag['tag']}: {tag['bytes']:,} bytes of parameters"
        ref = full.get(tag["version"])
        if ref is not None and ref is not tag:
            line += (f", {ref['bytes'] / tag['bytes']:.2f}x smaller than {ref['tag']} "
                     f"({ref['bytes']:,} bytes)")
        print(line)
