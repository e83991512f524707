"""python -m pbg_ray.predict [CHECKPOINT_PATH] {score,top-rhs,top-lhs,neighbors} ...

Answers one question about a trained checkpoint (or a model bundle's tag) by entity and
relation names and prints the answer as one JSON line. Without CHECKPOINT_PATH: the demo's
(python -m pbg_ray.train with no arguments trains it).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from pbg_ray.cli import command_parser, report_errors
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.importer.demo import demo_checkpoint_path

COMMANDS = ("score", "top-rhs", "top-lhs", "neighbors")
VALUE_OPTIONS = ("--version", "--tag", "--entity-path")  # options before CHECKPOINT_PATH
EXAMPLES = (
    "python -m pbg_ray.predict top-rhs user_17 likes -k 5       # the demo's checkpoint",
    "python -m pbg_ray.predict model top-rhs alice likes -k 10 --exclude data/train",
    "python -m pbg_ray.predict model score alice follows bob",
    "python -m pbg_ray.predict model/export/bundle.zip --tag v5-int8 neighbors alice -k 5",
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = command_parser(__doc__, EXAMPLES, reference=(
        "the Python API: pbg_ray.Predictor (pbg_ray/evaluation/predictor.py)"))
    # Not nargs="?": argparse would then give a path followed by options to the command;
    # with_checkpoint_path puts the demo's in where none is given.
    parser.add_argument("checkpoint_path",
                        help="a checkpoint directory or a model bundle file (default: the demo's)")
    parser.add_argument("--version", type=int, default=None,
                        help="checkpoint version (default: newest)")
    parser.add_argument("--tag", default=None, help="a model bundle's tag (default: newest)")
    parser.add_argument("--entity-path", default=None, help="where the entity names are "
                        "(default: the checkpoint config's entity_path)")
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser("score", help="score one edge")
    score.add_argument("lhs")
    score.add_argument("relation")
    score.add_argument("rhs")
    for command, first, second in (("top-rhs", "lhs", "relation"), ("top-lhs", "relation", "rhs")):
        top = commands.add_parser(command, help=f"the best {command[4:]} entities")
        top.add_argument(first)
        top.add_argument(second)
        top.add_argument("-k", type=int, default=10)
        top.add_argument("--exclude", nargs="*", default=[], metavar="EDGE_PATH",
                         help="leave out the known edges of these edge paths")
    near = commands.add_parser("neighbors", help="nearest entities of the same type")
    near.add_argument("name")
    near.add_argument("--type", dest="entity_type", default=None)
    near.add_argument("-k", type=int, default=10)
    return parser.parse_args(with_checkpoint_path(list(argv)))


def with_checkpoint_path(argv: List[str]) -> List[str]:
    """`argv` with the demo's checkpoint path inserted where a command comes first (argparse
    would take the command for CHECKPOINT_PATH)."""
    index = 0
    while index < len(argv) and argv[index] in VALUE_OPTIONS + ("-h", "--help"):
        index += 1 if argv[index] in ("-h", "--help") else 2
    if index < len(argv) and argv[index] in COMMANDS:
        return argv[:index] + [demo_checkpoint_path()] + argv[index:]
    return argv


@report_errors
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prints the answer as one JSON line."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model = Predictor.load(args.checkpoint_path, args.version, args.entity_path, args.tag)
    if args.command == "score":
        result = {"score": float(model.score([(args.lhs, args.relation, args.rhs)])[0])}
    elif args.command == "neighbors":
        result = {"neighbors": model.neighbors(args.name, args.entity_type, args.k)}
    elif args.command == "top-rhs":
        result = {"rhs": model.top_rhs(args.lhs, args.relation, args.k, args.exclude)}
    else:
        result = {"lhs": model.top_lhs(args.relation, args.rhs, args.k, args.exclude)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
