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

from pbg_ray.checkpoints.exporter import export_checkpoint, print_sizes
from pbg_ray.cli import hydra_entry
from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.partition_jobs import partition_map

EXAMPLES = (
    "python -m pbg_ray.export                                 # the demo's checkpoint, as TSV",
    "python -m pbg_ray.export config.py export.format=parquet export.output=s3://bucket/embeddings",
    "python -m pbg_ray.export config.py export.format=bundle 'export.variants=[fp32,int8]'",
)


def run(config: ConfigSchema) -> None:
    result = export_checkpoint(config, partition_map(config))
    if result["format"] == "bundle":
        print_sizes(result["tags"])
    print(json.dumps(result))


main = hydra_entry(run, __doc__, ("checkpoint_path", "export."), EXAMPLES)

if __name__ == "__main__":
    main()
