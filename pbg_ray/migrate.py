"""python -m pbg_ray.migrate OLD_DIR NEW_DIR [--entity-path DIR]

Converts the output directory (outdir) of a pre-1.0 PyTorch-BigGraph run into a v1
checkpoint directory: NEW_DIR gets config.json (v1 key names; checkpoint_path NEW_DIR,
entity_path NEW_DIR/entities with the entity counts), and the newest version's model and
embeddings with their optimizer states. NEW_DIR appears only when complete. Prints one
JSON line. See pbg_ray.checkpoints.legacy for the old layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from pbg_ray.checkpoints.legacy import migrate_run
from pbg_ray.cli import command_parser, report_errors

EXAMPLES = (
    "python -m pbg_ray.migrate old_run/ model/",
    "python -m pbg_ray.migrate old_run/ model/ --entity-path old_data/entities",
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = command_parser(__doc__, EXAMPLES, reference=(
        "the pre-1.0 layout: docs/formats.md; the converted directory also works as init_path"))
    parser.add_argument("old_dir", help="the pre-1.0 run's outdir (CHECKPOINT_VERSION, METADATA_1.pt...)")
    parser.add_argument("new_dir", help="the v1 checkpoint directory to create (absent or empty)")
    parser.add_argument("--entity-path", default=None,
                        help="where the run's entity_count_*.pt files are "
                             "(default: the config's entityPath, then OLD_DIR)")
    return parser.parse_args(argv)


@report_errors
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(json.dumps(migrate_run(args.old_dir, args.new_dir, args.entity_path)))


if __name__ == "__main__":
    main()
