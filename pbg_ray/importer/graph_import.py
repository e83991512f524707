"""import_graph: raw edge files -> PBG's v1 layout, one phase after another.

The recipe, each phase a module of this package (as PyTorch-BigGraph's importer
splits its work):

    read.py          each input's names -> ids, its edges -> a spill file of id records
    dictionaries.py  after the first input: ids -> (partition, offset), shuffled with the
                     seed; an incremental import starts from the previous dictionaries
    routing.py       each spill file -> edge buckets, the previous import's edges first
    staging.py       everything written to staging directories, then moved into place

One parse per input. The first input (for edge_paths[0]) fixes the dictionaries; later
inputs (eval_edge_paths) look their names up in them. `run_import` is what every engine
shares (checks, the manifest, staging, commit, stats); `local_phases` runs the phases in
this process, pbg_ray/importer/ray_engine.py on Ray tasks and actors.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.dictionaries import build_dictionaries, load_previous
from pbg_ray.importer.plan import ImportPlan
from pbg_ray.importer.read import IdReader
from pbg_ray.importer.routing import BucketRouter
from pbg_ray.importer.staging import ImportTarget, Staging, staging
from pbg_ray.io.entities import entity_count_file, load_entity_count
from pbg_ray.io.storage import storage_path

logger = logging.getLogger("pbg_ray")


def check_config(config: ConfigSchema, target: ImportTarget) -> None:
    """What an import needs of the whole config, beyond the importer section's own
    rules (ImportConfig.validate): one input per output, and a previous import apart."""
    settings, outputs = config.importer, target.edge_paths
    if len(settings.inputs) != len(outputs):
        raise PbgRayError(
            f"importer.inputs lists {len(settings.inputs)} file(s) but the config has "
            f"{len(outputs)} edge path(s) (edge_paths then eval_edge_paths: "
            f"{[str(p) for p in outputs]}). Give one input file per edge path.")
    if len(set(outputs)) != len(outputs):
        raise PbgRayError("edge_paths and eval_edge_paths repeat a directory; each input "
                          "needs its own output directory.")
    featurized = [name for name, e in config.entities.items() if e.featurized]
    if featurized:
        raise PbgRayError(f"entity types {featurized} are featurized; the importer reads "
                          "plain entity names only. Set featurized=false for them.")
    if config.dynamic_relations and settings.rel_col is None:
        raise PbgRayError("dynamic_relations=true needs importer.rel_col: the column that "
                          "names each edge's relation.")
    if settings.previous_entity_path is None:
        return
    previous = storage_path(settings.previous_entity_path).resolve()
    if not previous.is_dir():
        raise PbgRayError(f"importer.previous_entity_path {str(previous)!r} is not a "
                          "directory. Give a previous import's entity_path.")
    if previous == target.entity_path.resolve():
        raise PbgRayError(f"importer.previous_entity_path is entity_path ({str(previous)!r}); "
                          "the previous import is never modified in place. Point entity_path "
                          "at a new directory.")
    if len(settings.previous_edge_paths) > len(outputs):
        raise PbgRayError(f"importer.previous_edge_paths lists "
                          f"{len(settings.previous_edge_paths)} path(s) for {len(outputs)} output "
                          "edge path(s). Give at most one per output (edge_paths then "
                          "eval_edge_paths).")
    resolved = {p.resolve() for p in outputs}
    for path in settings.previous_edge_paths:
        if storage_path(path).resolve() in resolved:
            raise PbgRayError(f"importer.previous_edge_paths names {path!r}, an output edge "
                              "path; the previous import is never modified in place. Write "
                              "the grown graph's edges to new directories.")


# An engine's phases: (config, staging directories) -> (stats per input, entity count per
# entity type, number of relations), every file written to the staging directories.
Phases = Callable[[ConfigSchema, Staging], Tuple[List[Dict[str, Any]], Dict[str, int], int]]


def run_import(config: ConfigSchema, phases: Phases, shared: bool = False) -> Dict[str, Any]:
    """Check the config, skip an import already in place, run an engine's `phases` into
    fresh staging directories (`shared`: writable by tasks on any node) and commit them
    with the import's stats, which it returns."""
    target = ImportTarget(config)
    check_config(config, target)
    done = target.done()
    if done is not None:
        logger.warning("%s already holds this import; nothing to do.", target.entity_path)
        return done
    started = time.perf_counter()
    with staging(target, shared) as stages:
        per_input, counts, num_relations = phases(config, stages)
        seconds = time.perf_counter() - started
        result: Dict[str, Any] = {"inputs": per_input, "entities": counts}
        previous = config.importer.previous_entity_path
        if previous:
            result["new_entities"] = {
                name: n - sum(load_entity_count(previous, name, p)
                              for p in range(config.entities[name].num_partitions)
                              if entity_count_file(previous, name, p).is_file())
                for name, n in counts.items()}
        rows = sum(s["rows"] for s in per_input)
        result.update(relations=num_relations, seconds=round(seconds, 3),
                      rows_per_second=round(rows / seconds) if seconds else None)
        target.commit(stages, result)
    return result


def local_phases(config: ConfigSchema, stages: Staging, plan: Optional[ImportPlan] = None
                 ) -> Tuple[List[Dict[str, Any]], Dict[str, int], int]:
    """The phases in this process, input by input, through spill files; with a `plan`,
    its names within ImportPlan.names_bytes."""
    reader = IdReader(config)
    previous = load_previous(config, reader)  # seeds the reader: known names come first
    per_input = []
    names_bytes = plan.names_bytes if plan is not None else None
    for number, (stage, output) in enumerate(zip(stages.edges, config.edge_paths
                                                 + config.eval_edge_paths)):
        spill = stage / "spill.bin"
        stats: Dict[str, Any] = {"output": str(storage_path(output)),
                                 **reader.read(number, spill, names_bytes)}
        if number == 0:  # the first input fixes the dictionaries
            dictionaries = build_dictionaries(config, reader, previous)
            router = BucketRouter(config, reader.types, reader.spill_dtype, dictionaries)
        previous_edges = config.importer.previous_edge_paths[number:number + 1]
        stats.update(router.write_buckets(spill, stage,
                                          previous_edges[0] if previous_edges else None))
        spill.unlink()
        per_input.append(stats)
    dictionaries.write(config, stages.entities)
    return per_input, dictionaries.entity_counts(), len(dictionaries.relation_names)


def import_graph(config: ConfigSchema) -> Dict[str, Any]:
    """Import `config.importer.inputs` into config's entity_path and edge paths in this
    process; returns stats. (api.import_graph also offers the Ray engine.)"""
    return run_import(config, local_phases)
