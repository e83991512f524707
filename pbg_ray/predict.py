"""python -m pbg_ray.predict [CHECKPOINT_PATH] {score,top-rhs,top-lhs,neighbors} ...

Answers one question about a trained checkpoint (or a model bundle's tag) by entity and
relation names and prints the answer as one JSON line: the question's fields and
{"score": s} for an edge, {"hits": [{"name": n, "score": s}, ...]} (best first) for the k
best or nearest entities, as the service answers (docs/formats.md, "Answers").
CHECKPOINT_PATH is a checkpoint directory, a bundle, or a PBG config file (its
checkpoint_path and entity_path); without it: the demo's (python -m pbg_ray.train with no
arguments trains it). One candidate partition is in memory at a time.

Batch mode: --queries FILE (a local path or URI) holds one question per line, its
arguments tab-separated as on the command line (score: lhs, relation, rhs; top-rhs: lhs,
relation; top-lhs: relation, rhs; neighbors: entity); the answers, one JSON line per
question in the file's order with its line number and fields, go to --output (a local
path or URI, written whole when complete; default: standard output). A line that is no
question, or names an entity or relation the model lacks, gets an "error" instead, is
reported on stderr with its number, and makes the exit status 1; the others are answered.
Batches run on Ray: one task per candidate partition (RAY_ADDRESS joins a cluster; a
local Ray otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pbg_ray.checkpoints.directory import BEST_DIR
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.cli import command_parser, report_errors
from pbg_ray.config import load_pbg_config_file
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.entity_names import names_bytes
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.evaluation.questions import NeighborQuery, answer_json
from pbg_ray.importer.demo import demo_checkpoint_path
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.io.files import write_text_atomic
from pbg_ray.io.storage import storage_path
from pbg_ray.runtime.budget import memory_budget
from pbg_ray.runtime.partition_jobs import predictor_map

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
          "top-lhs": ("relation", "rhs"), "neighbors": ("entity",)}
# Batch mode keeps every partition's names where they take at most this share of the memory
# budget: each names file is then read once (to find the questions' names), not again to
# name the answers.
NAMES_SHARE = 0.25
FIELD_HELP = {"lhs": "the lhs entity's name", "relation": "the relation's name",
              "rhs": "the rhs entity's name", "entity": "an entity's name"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = command_parser(__doc__, EXAMPLES, reference=(
        "the Python API: api.Predictor (pbg_ray/api.py)"))
    # Not nargs="?": argparse would then give a path followed by options to the command;
    # with_checkpoint_path puts the demo's in where none is given.
    parser.add_argument("checkpoint_path",
                        help="a checkpoint directory or a model bundle file (default: the demo's)")
    parser.add_argument("--version", type=int, default=None,
                        help="checkpoint version (default: the best on validation, where "
                        "training kept one in best/, else the newest)")
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


@dataclasses.dataclass(frozen=True)
class Question:
    """One question: its line in the queries file (0: the command line) and its fields."""

    line: int
    fields: Tuple[str, ...]


def read_queries(path: str, command: str) -> Tuple[List[Question], Dict[int, str]]:
    """The questions of a queries file, and the problem of each line that holds none, by
    line number."""
    fields = FIELDS[command]
    try:
        text = storage_path(path).read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise PbgRayError(f"--queries file {path!r} does not exist.") from None
    questions, problems = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        values = tuple(line.rstrip("\r").split("\t"))
        if len(values) != len(fields):
            problems[number] = (f"{len(values)} tab-separated field(s), {command} needs "
                                f"{len(fields)} ({', '.join(fields)})")
        else:
            questions.append(Question(number, values))
    return questions, problems


def answer(model: Predictor, args: argparse.Namespace, questions: Sequence[Question]
           ) -> Dict[int, Dict[str, Any]]:
    """Each question's fields and its answer (questions.answer_json: its score, its hits,
    or the error of a question naming what the model lacks), by line."""
    asked = [q.fields for q in questions]
    if args.command == "score":
        found = model.score_each(asked)
    elif args.command == "neighbors":
        found = model.neighbors_each(
            [NeighborQuery(q[0], args.entity_type) for q in asked], args.k)
    else:
        side = args.command[4:]  # the ranked side; its queries are (other entity, relation)
        found = model.top_k_each(side, [q if side == "rhs" else (q[1], q[0]) for q in asked],
                                 args.k, args.exclude)
    fields = FIELDS[args.command]
    typed = {"entity_type": args.entity_type} if getattr(args, "entity_type", None) else {}
    return {q.line: {**dict(zip(fields, q.fields)), **typed, **answer_json(a)}
            for q, a in zip(questions, found)}


def answer_batch(model: Predictor, args: argparse.Namespace) -> None:
    """Batch mode: one JSON line per question of the queries file, in its order (an
    "error" instead of the answer where a line is not a question or names what the model
    lacks); each failed line is also reported on stderr, and the exit status is 1 if any
    failed. Every partition's names are kept where they fit NAMES_SHARE of the budget."""
    questions, errors = read_queries(args.queries, args.command)
    model.use(predictor_map(model.config))
    names = names_bytes(model.config, load_entity_counts(model.config))
    if names <= NAMES_SHARE * memory_budget(model.config.ray).bytes:
        model.entity_names.keep_all()
    answers = answer(model, args, questions) if questions else {}
    errors.update((line, a["error"]) for line, a in answers.items() if "error" in a)
    for line, error in errors.items():
        answers.setdefault(line, {"error": error})
    text = "".join(json.dumps({"line": line, **answers[line]}) + "\n" for line in sorted(answers))
    if args.output is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(args.output, text)
        print(json.dumps({"queries": len(answers), "failed": len(errors),
                          "output": str(storage_path(args.output))}))
    for line, error in sorted(errors.items()):
        print(f"pbg_ray: error: --queries file {args.queries!r}, line {line}: {error}",
              file=sys.stderr)
    if errors:
        print(f"pbg_ray: {len(errors)} of {len(answers)} questions failed; the others are "
              "answered", file=sys.stderr)
        sys.exit(1)


def load_model(args: argparse.Namespace) -> Predictor:
    """The Predictor of CHECKPOINT_PATH: a checkpoint directory, a model bundle, or a PBG
    config file (its checkpoint_path and entity_path), as the other commands take first."""
    path, entity_path = args.checkpoint_path, args.entity_path
    if path.endswith(".py"):
        config = load_pbg_config_file(path).with_absolute_paths()
        path, entity_path = config.checkpoint_path, entity_path or config.entity_path
    model = Predictor.load(path, args.version, entity_path, args.tag)
    best = CheckpointManager(storage_path(path) / BEST_DIR)
    if args.version is None and args.tag is None and best.exists():
        print(f"pbg_ray: reading version {best.version()}, the best on validation, kept in "
              f"{best.path} (--version N reads another)", file=sys.stderr)
    return model


@report_errors
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prints the answer as one JSON line (batch mode: writes one per question)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if with_checkpoint_path(argv) != argv:
        print(f"pbg_ray: no CHECKPOINT_PATH given: predict reads the built-in demo graph's "
              f"checkpoint ({demo_checkpoint_path()})", file=sys.stderr)
    model = load_model(args)
    if args.queries is not None:
        answer_batch(model, args)
        return
    question = Question(0, tuple(getattr(args, f) for f in FIELDS[args.command]))
    result = answer(model, args, [question])[0]
    if "error" in result:
        raise PbgRayError(result["error"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
