"""python -m pbg_ray.predict [CHECKPOINT_PATH] {score,top-rhs,top-lhs,neighbors} ...

Answers one question about a trained checkpoint (or a model bundle's tag) by entity and
relation names and prints the answer as one JSON line. Without CHECKPOINT_PATH: the demo's
(python -m pbg_ray.train with no arguments trains it). One candidate partition is in
memory at a time.

Batch mode: --queries FILE (a local path or URI) holds one question per line, its
arguments tab-separated as on the command line (score: lhs, relation, rhs; top-rhs: lhs,
relation; top-lhs: relation, rhs; neighbors: name); the answers, one JSON line per
question in the file's order with the question's fields, go to --output (a local path
or URI, written whole when complete; default: standard output). Batches run on Ray: one
task per candidate partition (RAY_ADDRESS joins a cluster; a local Ray otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pbg_ray.cli import command_parser, report_errors
from pbg_ray.engine.partition_map import predictor_map
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.importer.demo import demo_checkpoint_path
from pbg_ray.io.files import write_text_atomic
from pbg_ray.io.storage import storage_path

COMMANDS = ("score", "top-rhs", "top-lhs", "neighbors")
VALUE_OPTIONS = ("--version", "--tag", "--entity-path")  # options before CHECKPOINT_PATH
EXAMPLES = (
    "python -m pbg_ray.predict top-rhs user_17 likes -k 5       # the demo's checkpoint",
    "python -m pbg_ray.predict model top-rhs alice likes -k 10 --exclude data/train",
    "python -m pbg_ray.predict model/export/bundle.zip --tag v5-int8 neighbors alice -k 5",
    "python -m pbg_ray.predict model top-rhs --queries users.tsv --output s3://bucket/top.jsonl",
)
# Per command: its arguments, as the queries file's tab-separated fields.
FIELDS = {"score": ("lhs", "relation", "rhs"), "top-rhs": ("lhs", "relation"),
          "top-lhs": ("relation", "rhs"), "neighbors": ("name",)}
FIELD_HELP = {"lhs": "the lhs entity's name", "relation": "the relation's name",
              "rhs": "the rhs entity's name", "name": "an entity's name"}


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
    helps = {"score": "score one edge", "top-rhs": "the best rhs entities",
             "top-lhs": "the best lhs entities", "neighbors": "nearest entities of the same type"}
    for command, fields in FIELDS.items():
        sub = commands.add_parser(command, help=helps[command])
        for field in fields:  # left out with --queries
            sub.add_argument(field, nargs="?", help=f"{FIELD_HELP[field]} (not with --queries)")
        if command != "score":
            sub.add_argument("-k", type=int, default=10, help="how many entities (default: 10)")
        if command.startswith("top-"):
            sub.add_argument("--exclude", nargs="*", default=[], metavar="EDGE_PATH",
                             help="leave out the known edges of these edge paths")
        if command == "neighbors":
            sub.add_argument("--type", dest="entity_type", default=None)
        sub.add_argument("--queries", default=None, metavar="FILE", help=(
            f"batch mode: one question per line, tab-separated {', '.join(f.upper() for f in fields)} "
            "(a local path or URI)"))
        sub.add_argument("--output", default=None, metavar="PATH_OR_URI", help=(
            "batch mode: where the answers go, one JSON line per question (default: stdout)"))
    args = parser.parse_args(with_checkpoint_path(list(argv)))
    given = [f for f in FIELDS[args.command] if getattr(args, f) is not None]
    if args.queries is None and len(given) != len(FIELDS[args.command]):
        parser.error(f"{args.command} needs {' '.join(f.upper() for f in FIELDS[args.command])}, "
                     "or --queries FILE")
    if args.queries is not None and given:
        parser.error(f"{args.command}: give either {given[0].upper()}... or --queries FILE, not both")
    if args.output is not None and args.queries is None:
        parser.error("--output needs --queries FILE (batch mode)")
    return args


def with_checkpoint_path(argv: List[str]) -> List[str]:
    """`argv` with the demo's checkpoint path inserted where a command comes first (argparse
    would take the command for CHECKPOINT_PATH)."""
    index = 0
    while index < len(argv) and argv[index] in VALUE_OPTIONS + ("-h", "--help"):
        index += 1 if argv[index] in ("-h", "--help") else 2
    if index < len(argv) and argv[index] in COMMANDS:
        return argv[:index] + [demo_checkpoint_path()] + argv[index:]
    return argv


def read_queries(path: str, command: str) -> List[Tuple[str, ...]]:
    """The questions of a queries file: per line its tab-separated fields."""
    fields = FIELDS[command]
    try:
        text = storage_path(path).read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise PbgRayError(f"--queries file {path!r} does not exist.") from None
    queries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        values = tuple(line.rstrip("\r").split("\t"))
        if len(values) != len(fields):
            raise PbgRayError(f"--queries file {path!r}, line {number}: {len(values)} tab-separated "
                              f"field(s), {command} needs {len(fields)} ({', '.join(fields)}).")
        queries.append(values)
    return queries


def answer(model: Predictor, args: argparse.Namespace, queries: Sequence[Tuple[str, ...]]
           ) -> List[Dict[str, Any]]:
    """Each question's answer, with its fields."""
    fields = FIELDS[args.command]
    if args.command == "score":
        found = [{"score": float(s)} for s in model.score(queries)]
    elif args.command == "neighbors":
        found = [{"neighbors": r} for r in model.neighbors_of([q[0] for q in queries],
                                                              args.entity_type, args.k)]
    else:
        side = args.command[4:]  # the ranked side's; its queries are (other entity, relation)
        pairs = [q if side == "rhs" else (q[1], q[0]) for q in queries]
        found = [{side: r} for r in model.top_k(side, pairs, args.k, args.exclude)]
    return [{**dict(zip(fields, q)), **a} for q, a in zip(queries, found)]


@report_errors
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prints the answer as one JSON line (batch mode: writes one per question)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model = Predictor.load(args.checkpoint_path, args.version, args.entity_path, args.tag)
    if args.queries is None:
        query = tuple(getattr(args, f) for f in FIELDS[args.command])
        result = answer(model, args, [query])[0]
        print(json.dumps({k: v for k, v in result.items() if k not in FIELDS[args.command]}))
        return
    queries = read_queries(args.queries, args.command)
    model.use(predictor_map(model.config))
    lines = "".join(json.dumps(a) + "\n" for a in answer(model, args, queries))
    if args.output is None:
        sys.stdout.write(lines)
        return
    write_text_atomic(args.output, lines)
    print(json.dumps({"queries": len(queries), "output": str(storage_path(args.output))}))


if __name__ == "__main__":
    main()
