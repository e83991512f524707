"""A checkpoint version's embeddings (global embeddings added, as PBG does) and relation
parameters as TSV in torchbiggraph_export_to_tsv's layout or as Parquet (one file per
entity partition; pbg_ray.io.embedding_tables), or versions and reduced-precision variants
of them as a model bundle (pbg_ray.checkpoints.bundle), to a local directory or a URI.
Settings: the `export` section.

Out of core: the work is one job per entity partition that reads its partition itself
(`partition_entities`, `bundle_partition`); the driver holds the model's parameters and
the results of the jobs in flight. A `MapPartitions` runs the jobs: `in_process` here,
one after another; runtime/partition_jobs.py as parallel Ray tasks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from pbg_ray.checkpoints.bundle import BUNDLE_FILE, write_checkpoint_bundle
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.per_partition import MapPartitions, in_process
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io import embedding_tables as tables
from pbg_ray.io.entities import load_entity_names, load_relation_names
from pbg_ray.io.storage import StoragePath, file_size, storage_path
from pbg_ray.model.params import global_emb_key, param_layout

@dataclasses.dataclass(frozen=True)
class PartitionJob:
    """What a job needs to read one entity partition of a checkpoint version."""

    checkpoint_path: str
    version: int
    entity_path: str
    entity: str
    part: int
    global_emb: Any  # float32 [D] or None

    def read(self) -> Tuple[List[str], np.ndarray]:
        """(names [N], embeddings [N, D] with the global embedding added)."""
        checkpoint = CheckpointManager(self.checkpoint_path)
        names = load_entity_names(self.entity_path, self.entity, self.part)
        embeddings, _ = checkpoint.read_partition(self.version, self.entity, self.part)
        if len(names) != len(embeddings):
            raise PbgRayError(
                f"entity type {self.entity!r} partition {self.part}: {len(names)} names in "
                f"entity_path but {len(embeddings)} embeddings in version {self.version}. "
                "The checkpoint was trained on another import; check entity_path.")
        if self.global_emb is not None:
            embeddings += self.global_emb
        return names, embeddings


def tsv_partition(job: PartitionJob) -> Tuple[int, List[bytes]]:
    """(entities, lines of entities.tsv) of one partition."""
    names, embeddings = job.read()
    return len(names), tables.tsv_entities(names, embeddings)


def parquet_partition(job: PartitionJob, path: str) -> Tuple[int, str]:
    """(entities, file) of one partition written as its Parquet file at `path`."""
    names, embeddings = job.read()
    tables.write_parquet_entities(storage_path(path), job.entity, job.part, names, embeddings)
    return len(names), path


def export_output(config: ConfigSchema, checkpoint: CheckpointManager) -> StoragePath:
    settings = config.export
    return storage_path(settings.output) if settings.output else checkpoint.path / "export"


def with_trained_model(config: ConfigSchema) -> ConfigSchema:
    """`config` with the model that the (newest) version its export reads was trained with
    (CheckpointManager.with_trained_model)."""
    settings = config.export
    wanted = (max(settings.versions) if settings.format == "bundle" and settings.versions
              else settings.version)
    checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
        config, wanted, "export.versions" if wanted != settings.version else "export.version")
    return checkpoint.with_trained_model(config, version)


def export_bundle(config: ConfigSchema, run: MapPartitions = in_process) -> Dict[str, Any]:
    """Write `config.export.versions` of config's checkpoint as a model bundle."""
    settings = config.export
    wanted = sorted(set(settings.versions)) if settings.versions else [settings.version]
    checkpoints = CheckpointManager(config.checkpoint_path)
    located = [checkpoints.locate(config, v, "export.versions") for v in wanted]
    output = tables.begin_export(export_output(config, located[-1][0]))
    created = not output.exists()
    path = output / BUNDLE_FILE
    try:
        tags = write_checkpoint_bundle(path, config, located, settings.variants, run)
    except BaseException:
        tables.abandon_export(output, [path], created)
        raise
    result = {"checkpoint_path": str(located[-1][0].path), "versions": [v for _, v in located],
              "format": "bundle", "file": str(path), "file_bytes": file_size(path), "tags": tags}
    tables.finish_export(output, {k: v for k, v in result.items() if k != "tags"})
    return result


def export_checkpoint(config: ConfigSchema, run: MapPartitions = in_process) -> Dict[str, Any]:
    """Export `config.export.version` of config's checkpoint, one job per entity partition
    run by `run`; returns what was written. The output's _SUCCESS is written last; a
    failed export leaves none, and none of this export's files. The model's keys are the
    checkpoint's (with_trained_model)."""
    config = with_trained_model(config.checked())
    settings = config.export
    if settings.format == "bundle":
        return export_bundle(config, run)
    checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
        config, settings.version, "export.version")
    output = tables.begin_export(export_output(config, checkpoint))
    created = not output.exists()
    stored, _ = checkpoint.read_model(version)
    relation_names = (load_relation_names(config.entity_path) if config.dynamic_relations
                      else [r.name for r in config.relations])
    # Every parameter in torchbiggraph's order; missing ones at their initial values, as PBG's
    # make_model + load_state_dict(strict=False) would have them.
    params = {name: stored.get(name, init) for name, init in param_layout(config, len(relation_names))}
    jobs = [PartitionJob(str(checkpoint.path), version, config.entity_path, entity, part,
                         params.get(global_emb_key(entity)))
            for entity, econf in config.entities.items() for part in range(econf.num_partitions)]
    dims = [config.entity_dimension(e) for e in config.entities]
    targets = ([output / tables.ENTITIES_TSV] if settings.format == "tsv" else
               [tables.parquet_file(output, j.entity, j.part, config.entity_dimension(j.entity), dims)
                for j in jobs])
    written = targets + [output / f"relation_types.{settings.format}"]
    try:
        if settings.format == "tsv":
            counts: List[int] = []

            def lines() -> Iterator[List[bytes]]:
                for count, text in run(tsv_partition, [(j,) for j in jobs]):
                    counts.append(count)
                    yield text

            files = [tables.write_tsv_entities(output, lines())]
        else:
            counts = [count for count, _ in run(parquet_partition, [
                (j, str(t)) for j, t in zip(jobs, targets)])]
            files = list(targets)
            for dim in set(dims):
                tables.remove_stale(tables.parquet_dataset(output, dim, dims), targets)
        files.append(tables.write_relation_types(output, settings.format,
                                                 relation_rows(config, params, relation_names)))
    except BaseException:
        tables.abandon_export(output, written, created)
        raise
    result = {"checkpoint_path": str(checkpoint.path), "version": version,
              "format": settings.format, "entities": sum(counts),
              "partitions": len(jobs), "files": [str(p) for p in files]}
    tables.finish_export(output, result)
    return result


def relation_rows(config: ConfigSchema, params: Dict[str, Any],
                  relation_names: List[str]) -> List[tables.RelationRow]:
    """The rows of relation_types.{tsv,parquet}: every operator parameter, per relation."""
    rows = []
    for name, value in params.items():
        if not name.startswith("relations/"):
            continue
        _, idx, _, side, param = name.split("/")
        rel = config.relations[int(idx)]
        if config.dynamic_relations:  # one row of the stacked parameter per relation
            rows += [tables.relation_row(rel_name, side, rel.operator, param, row)
                     for rel_name, row in zip(relation_names, np.asarray(value))]
        else:
            rows.append(tables.relation_row(rel.name, side, rel.operator, param, np.asarray(value)))
    return rows


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
