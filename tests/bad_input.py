"""Bad input, shared by the tests and benchmarks/fault_bench.py: the corpus in
bad_inputs/ (cases.json says where each file goes and what its refusal must say),
byte-level damage to good files, and the readers a run goes through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_state, row_adagrad_sums
from pbg_ray.config import ConfigSchema, load_pbg_config_file
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.graph_import import import_graph
from pbg_ray.io.edges import check_edges, count_edges, edges_file, read_edges
from pbg_ray.io.entities import (
    dynamic_rel_count_file, load_dynamic_rel_count, load_entity_counts, load_entity_names,
    load_relation_names, num_relation_ids)
from pbg_ray.types import Bucket
from tests.util import config_dict, random_checkpoint, write_random_graph

CORPUS = Path(__file__).with_name("bad_inputs")
DAMAGE = ("cut", "xor", "overwrite")


def load_cases() -> List[Dict[str, Any]]:
    return json.loads((CORPUS / "cases.json").read_text())


def good_graph(root: Path) -> ConfigSchema:
    """The tests' graph under `root`, its edges and a complete checkpoint version 1
    (with its config and row-Adagrad state)."""
    config = ConfigSchema.from_dict(config_dict(root))
    write_random_graph(config)
    random_checkpoint(config)
    storage = CheckpointStorage(config.checkpoint_path)
    for entity, counts in load_entity_counts(config).items():
        for part, count in enumerate(counts):
            embs, _ = storage.load_entity_partition(1, entity, part)
            storage.save_entity_partition(1, entity, part, embs,
                                          row_adagrad_state(np.ones(count, np.float32), config.lr))
    return config


def read_entities(config: ConfigSchema) -> None:
    """Every entity file a run or an export reads."""
    for entity, counts in load_entity_counts(config).items():
        for part in range(len(counts)):
            load_entity_names(config.entity_path, entity, part)
    load_relation_names(config.entity_path)
    if dynamic_rel_count_file(config.entity_path).exists():
        load_dynamic_rel_count(config.entity_path)


def read_edges_as_training(config: ConfigSchema) -> None:
    """Every bucket of the first edge path, counted, read in two chunks and checked
    against the entity counts, as the trainer and its train tasks do."""
    counts, num_rel = load_entity_counts(config), num_relation_ids(config)
    nparts = config.num_partitions()
    for bucket in (Bucket(lhs, rhs) for lhs in range(nparts) for rhs in range(nparts)):
        count_edges(config.edge_paths[0], bucket)
        for chunk in range(2):
            edges = read_edges(config.edge_paths[0], bucket, chunk, 2)
            check_edges(edges, bucket, config, counts, num_rel,
                        str(edges_file(config.edge_paths[0], bucket)))


def read_checkpoint(config: ConfigSchema) -> None:
    """The current version as a resumed run loads it."""
    storage = CheckpointStorage(config.checkpoint_path)
    version = storage.load_version()
    storage.check_version(version, config)
    storage.load_config()
    for entity, counts in load_entity_counts(config).items():
        for part in range(len(counts)):
            embs, state = storage.load_entity_partition(version, entity, part)
            row_adagrad_sums(state, len(embs), str(storage.partition_file(version, entity, part)))
    storage.load_model(version)


def feed(case: Dict[str, Any], workdir: Path) -> None:
    """Give pbg_ray the bad file of `case` where a user's run would meet it."""
    kind = case["file"].split("/")[0]
    source = CORPUS / case["file"]
    if kind == "configs":
        load_pbg_config_file(source)
    elif kind == "raw":
        shutil.copyfile(source, workdir / source.name)
        import_graph(ConfigSchema.from_dict(config_dict(
            workdir, entities={"node": {"num_partitions": 1}}, global_emb=False,
            relations=[{"name": r, "lhs": "node", "rhs": "node"} for r in ("follows", "likes")],
            importer=dict(inputs=[str(workdir / source.name)], **case.get("importer", {})))))
    else:
        config = good_graph(workdir)
        directory, read = {"entities": (config.entity_path, read_entities),
                           "edges": (config.edge_paths[0], read_edges_as_training),
                           "checkpoints": (config.checkpoint_path, read_checkpoint)}[kind]
        shutil.copyfile(source, Path(directory) / case["as"])
        read(config)


def refusal(case: Dict[str, Any], workdir: Path) -> str:
    """The PbgRayError message `case` is refused with; AssertionError if it is accepted
    or the message doesn't name the file and say what the case expects. Any other
    exception escapes as it is."""
    try:
        feed(case, workdir)
    except PbgRayError as err:
        message = str(err)
    else:
        raise AssertionError(f"{case['file']} was accepted")
    named = case.get("as", Path(case["file"]).name)
    assert named in message, f"{case['file']}: the message doesn't name {named!r}: {message}"
    assert case["expect"] in message, f"{case['file']}: {case['expect']!r} not in: {message}"
    return message


def damage(data: bytes, how: str, where: float, junk: bytes) -> bytes:
    """`data` damaged as files get damaged: `cut` short at the fraction `where` of its
    length, or `junk` xor-ed into it (`xor`) or written over it (`overwrite`) there."""
    at = min(int(where * len(data)), max(len(data) - 1, 0))
    if how == "cut":
        return data[:at]
    out = bytearray(data)
    for i, byte in enumerate(junk[:len(out) - at]):
        out[at + i] = out[at + i] ^ byte if how == "xor" else byte
    return bytes(out)
