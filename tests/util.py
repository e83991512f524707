"""Helpers shared by the tests (importable: `from tests.util import ...`): small PBG-style
configs, random graphs and checkpoints written in PBG's layout, and checkpoint checks."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_sums
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import write_edges
from pbg_ray.io.entities import (
    load_entity_count, load_entity_counts, num_relation_ids, save_entity_count, save_entity_names,
    save_relation_names)
from pbg_ray.model.params import param_layout, params_from_checkpoint
from pbg_ray.types import Bucket, EdgeList

REPO = Path(__file__).resolve().parents[1]
V1_ROOT = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory hierarchy (conftest's memory_cgroup)


def run_in(group: Path, limit: int, args: Sequence[str], cwd: Path,
           env: Mapping[str, str]) -> subprocess.CompletedProcess:
    """`args` run inside the memory cgroup `group`, limited to `limit` bytes."""
    (group / "memory.limit_in_bytes").write_text(str(limit))
    return subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
                           *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env)


def oom_kills(group: Path) -> int:
    """The processes of memory cgroup `group` that the kernel's OOM killer ended."""
    lines = (group / "memory.oom_control").read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith("oom_kill ")))


def config_dict(root: Path, **overrides: Any) -> Dict[str, Any]:
    """A PBG-style config dict for a two-type, three-relation graph under `root`."""
    data = dict(
        entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 2},
                  "tag": {"num_partitions": 1}},
        relations=[
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"},
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "diagonal"},
            {"name": "tagged", "lhs": "item", "rhs": "tag", "operator": "none"},
        ],
        dimension=8,
        entity_path=str(root / "entities"),
        edge_paths=[str(root / "edges")],
        checkpoint_path=str(root / "checkpoints"),
        batch_size=20,
        num_batch_negs=5,
        num_uniform_negs=5,
        # The held-out edges' sampled ranking before and after each bucket (eval_fraction's
        # default, 0.05) against 10 and 10 negatives instead of PBG's 1000 and 1000: a
        # tiny bucket's few held-out edges would be scored as one chunk padded to 1000.
        eval_num_batch_negs=10,
        eval_num_uniform_negs=10,
    )
    data.update(overrides)
    return data


def joining_the_session(ray_session: Any) -> Dict[str, str]:
    """The environment variable by which a command joins the session's Ray (as under `ray
    job submit`) instead of starting one."""
    return {"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}


def write_random_graph(config: ConfigSchema, num_edges: int = 200, seed: int = 0,
                       counts: Dict[str, int] = None) -> Dict[Bucket, EdgeList]:
    """Entity files and one bucket file per (lhs, rhs) partition pair; returns the edges."""
    rng = np.random.default_rng(seed)
    counts = counts or {"user": 30, "item": 20, "tag": 7}
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            n = counts[entity] + part
            save_entity_count(config.entity_path, entity, part, n)
            save_entity_names(config.entity_path, entity, part,
                              [f"{entity}-{part}-{i}" for i in range(n)])
    # torchbiggraph's export_to_tsv reads relation names in every mode.
    save_relation_names(config.entity_path, [r.name for r in config.relations])
    nparts = config.num_partitions()
    written = {}
    for lhs_p in range(nparts):
        for rhs_p in range(nparts):
            rel = rng.integers(len(config.relations), size=num_edges)
            sides = []
            for side, part in (("lhs", lhs_p), ("rhs", rhs_p)):
                types = [getattr(config.relations[r], side) for r in rel]
                sides.append(np.array([
                    rng.integers(counts[t] + (part if config.entities[t].num_partitions > 1 else 0))
                    for t in types], dtype=np.int64))
            edges = EdgeList(sides[0], sides[1], rel.astype(np.int64))
            write_edges(config.edge_paths[0], Bucket(lhs_p, rhs_p), edges)
            written[Bucket(lhs_p, rhs_p)] = edges
    return written


def assert_valid_checkpoint(config: ConfigSchema, version: int, clean: bool = True):
    """Version `version` is current and complete, and pbg_ray's own readers find every
    partition's embeddings (its count of rows, finite) with a RowAdagrad state that decodes,
    and every parameter of the config's model; `clean`: alone as well, no older version or
    temporary file beside it (a killed run leaves those for the next run to remove).
    The oracle tests add the original PBG's own load check (tests/oracle.py)."""
    storage = CheckpointStorage(config.checkpoint_path)
    assert storage.load_version() == version
    storage.check_version(version, config)
    if clean:
        assert not list(storage.path.glob(f"*.v{version - 1}.h5")), "old version not dropped"
        assert not list(storage.path.glob(".*tmp*")), "temporary files left behind"
    for entity, parts in load_entity_counts(config).items():
        for part, count in enumerate(parts):
            embs, optim_state = storage.load_entity_partition(version, entity, part)
            assert embs.shape == (count, config.dimension)
            assert np.isfinite(embs).all()
            sums = row_adagrad_sums(optim_state, count, f"{entity} partition {part}")
            assert sums is not None and np.isfinite(sums).all()
    arrays, optim_state = storage.load_model(version)
    num_relations = num_relation_ids(config)
    assert set(arrays) == {name for name, _ in param_layout(config, num_relations)}
    assert all(np.isfinite(value).all() for value in arrays.values())
    params_from_checkpoint(config, num_relations, arrays, optim_state, where=f"version {version}")


def random_checkpoint(config: ConfigSchema, version: int = 1, seed: int = 0,
                      integer: bool = False) -> None:
    """A complete checkpoint version of random embeddings and parameters for the graph
    in config.entity_path (integer-valued ones make exact score ties)."""
    rng = np.random.default_rng(seed)
    draw = (lambda shape: rng.integers(-1, 2, shape).astype(np.float32)) if integer else \
        (lambda shape: rng.normal(0, 1, shape).astype(np.float32))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    storage.save_config(config)
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            count = load_entity_count(config.entity_path, entity, part)
            storage.save_entity_partition(
                version, entity, part, draw((count, config.entity_dimension(entity))), None)
    layout = param_layout(config, num_relation_ids(config))
    storage.save_model(version, {k: (v if integer else v + draw(v.shape)) for k, v in layout}, None)
    storage.save_version(version)


def commit_random_version(config: ConfigSchema, version: int, best: bool = False) -> None:
    """A random checkpoint version committed as training commits it: made current, kept in
    best/ where it is the `best` on validation so far, and the one before it dropped from
    the checkpoint (its files then live on in best/ alone, where best/ keeps it)."""
    random_checkpoint(config, version=version, seed=version)
    CheckpointManager(config.checkpoint_path).commit(version, [], config, best=best)


def as_torch(value: Any) -> Any:
    """`value` with its numpy arrays as torch tensors (what torch.load gives back)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy(order="C"))
    if isinstance(value, dict):
        return {k: as_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_torch(v) for v in value)
    return value


def partitioned_checkpoint(root: Path, num_partitions: int, num_entities: int,
                           dimension: int, num_edges: int = 4) -> ConfigSchema:
    """A random checkpoint of one entity type, `num_entities` entities spread over
    `num_partitions` partitions (a few more in the later ones), one relation."""
    config = ConfigSchema.from_dict(config_dict(
        root, entities={"node": {"num_partitions": num_partitions}}, dimension=dimension,
        relations=[{"name": "to", "lhs": "node", "rhs": "node", "operator": "translation"}]))
    write_random_graph(config, num_edges, counts={"node": num_entities // num_partitions})
    random_checkpoint(config)
    return config


# Run by peak_memory in a fresh process: import, the warm-up call, then the resident
# memory, then the measured call.
_PEAK_SCRIPT = """
import importlib, json, re, sys
module, name = sys.argv[1].split(":")
target = getattr(importlib.import_module(module), name)
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
warmup, args = json.loads(sys.argv[2])
target(*warmup)
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
target(*args)
print(json.dumps(status("VmHWM") - before))
"""


def peak_memory(target: str, warmup: Sequence[Any], args: Sequence[Any]) -> int:
    """Bytes by which `target` ("module:function", importable) called with `args`
    (JSON values) raises the peak resident memory of a fresh Python process above what it
    held before the call (Linux's VmHWM, reset before the call). It is called with
    `warmup` first (e.g. on a tiny table), so that the code, libraries and thread pools
    a first call brings in are not counted. glibc's mmap threshold is pinned and Arrow
    allocates with malloc, so every large array is mapped and unmapped on its own and
    freed memory is never reused unseen."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1",
               ARROW_DEFAULT_MEMORY_POOL="system",
               PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""),
                                           str(Path(__file__).parent.parent)]))
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, target, json.dumps([warmup, args])],
                          env=env, cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE,
                          text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


# The tables of peak_growth: partitions of PEAK_ROWS rows of PEAK_DIMENSION floats.
PEAK_ROWS, PEAK_DIMENSION = 24_000, 32


def peak_growth(root: Path, target: str, args_of) -> Tuple[Dict[int, int], int]:
    """({2: peak, 8: peak}, extra bytes): peak_memory of `target` called with
    `args_of(config, name)` on a checkpoint of 2 and of 8 partitions of the same size, and
    how many bytes of embeddings the 8-partition table has more. A command that streams
    partition by partition peaks alike on both; one that holds the table needs the
    extra bytes. (The warm-up call is on a 1-partition table of 100 entities.)"""
    tiny = partitioned_checkpoint(root / "tiny", 1, 100, PEAK_DIMENSION)
    peaks = {}
    for nparts in (2, 8):
        config = partitioned_checkpoint(root / f"p{nparts}", nparts, nparts * PEAK_ROWS,
                                        PEAK_DIMENSION, num_edges=50)
        peaks[nparts] = peak_memory(target, args_of(tiny, f"warmup{nparts}"),
                                    args_of(config, f"p{nparts}"))
    return peaks, 6 * PEAK_ROWS * PEAK_DIMENSION * 4


def assert_streams_partitions(peaks: Dict[int, int], extra: int) -> None:
    """The peak did not grow with the table: 6 more partitions added less than a third of
    their bytes (holding them would add all of it)."""
    growth = peaks[8] - peaks[2]
    assert growth < extra / 3, (
        f"peak memory {peaks[2] / 2**20:.1f} MiB at 2 partitions, {peaks[8] / 2**20:.1f} MiB "
        f"at 8 of the same size: it grew by {growth / 2**20:.1f} MiB with "
        f"{extra / 2**20:.1f} MiB more table")


class ManualClock:
    """A monotonic clock that moves only when the test advances it, for code that takes a
    clock: a wait it measures ends when the test says so, never after real seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self.reads += 1
            self._changed.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.now += seconds

    def wait_reads(self, count: int) -> None:
        """Return once the code under test has read the clock `count` more times (a loop
        that reads it each round has then acted on what it read before the last)."""
        with self._changed:
            target = self.reads + count
            assert self._changed.wait_for(lambda: self.reads >= target, timeout=600)
