"""python -m pbg_ray.export [PBG_CONFIG.py] [key=value ...]

Writes a checkpoint's embeddings (global embeddings added, as PBG does) and
relation parameters as TSV in torchbiggraph_export_to_tsv's layout or as
Parquet (a dataset of one file per entity partition), to a local directory or a
URI (s3://, gs://, ...). Settings under `export.`: format (tsv, parquet), version
(null: the best on validation where training kept one, else the newest), output (null:
<checkpoint_path>/export). One Ray task per entity partition reads and converts it (ray.*
settings as for training);
<output>/_SUCCESS is written last.

export.format=bundle writes <output>/bundle.zip (pbg_ray.checkpoints.bundle): a tag per checkpoint
version of export.versions and per precision of export.variants (fp32, fp16, int8), and
prints each tag's size beside the fp32 one's.
"""

from __future__ import annotations

import json
from typing import Dict, Sequence

from pbg_ray.checkpoints.exporter import export_checkpoint, print_sizes, with_trained_model
from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.runtime.budget import DRIVER, RAY_PROCESSES, TASK_WORKER, MemoryBudget, MemoryPlan
from pbg_ray.runtime.connect import check_plan_fits, local_task_slots
from pbg_ray.runtime.partition_jobs import partition_map

EXAMPLES = (
    "python -m pbg_ray.export                                 # the demo's checkpoint, as TSV",
    "python -m pbg_ray.export config.py export.format=parquet export.output=s3://bucket/embeddings",
    "python -m pbg_ray.export config.py export.format=bundle 'export.variants=[fp32,int8]'",
)


# Bytes an export task holds per byte of its partition's embeddings: the embeddings, the
# names and what it builds (TSV text about 4.6x, a Parquet table about 1.8x, by
# tracemalloc on a 200,000 x 64 partition; a bundle's variants taken as TSV's), rounded up.
EXPORT_COPIES = {"tsv": 5.0, "parquet": 2.0, "bundle": 5.0}


def export_plan(config: ConfigSchema, counts: Dict[str, Sequence[int]], tasks: int
                ) -> MemoryPlan:
    """What an export holds at its peak: partition_map's window of tasks (two per CPU
    slot: one running, one result waiting), each with the largest partition."""
    largest = max(n * config.entity_dimension(e) * 4 for e in config.entities for n in counts[e])
    return MemoryPlan("this export", None, 0,
                      int(EXPORT_COPIES[config.export.format] * largest), 2 * tasks,
                      RAY_PROCESSES + DRIVER + tasks * TASK_WORKER)


def check_export_fits(config: ConfigSchema) -> None:
    """Refuse an export on the local Ray whose plan exceeds the memory budget."""
    counts, tasks = load_entity_counts(config), local_task_slots(config.ray)

    def fix(budget: MemoryBudget) -> str:
        ways = []
        if tasks > 1 and export_plan(config, counts, 1).total <= budget.bytes:
            ways.append(f"ray.num_cpus={config.ray.cpus_per_trainer:g} (one task at a time)")
        if config.export.format == "tsv":
            ways.append("export.format=parquet (a Parquet table takes about 2 copies of a "
                        "partition, TSV text 5)")
        return "; or ".join(ways + [
            "split the entities into more partitions, or give it more memory "
            "(ray.memory_budget states it in bytes where the detected limit is wrong)"])

    check_plan_fits(config.ray, export_plan(config, counts, tasks), fix)


def run(config: ConfigSchema) -> None:
    config = with_trained_model(config.checked())
    check_export_fits(config)
    result = export_checkpoint(config, partition_map(config))
    if result["format"] == "bundle":
        print_sizes(result["tags"])
    print(json.dumps(result))


main = hydra_entry(run, __doc__, ("checkpoint_path", "export."), EXAMPLES)

if __name__ == "__main__":
    main()
