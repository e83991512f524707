"""The built-in demo graph, generated with planted structure.

Users and items each belong to one of `num_communities` communities. Users
follow users of their own community, like items of their own community, and
items are similar to items of the *next* community (an asymmetric relation).
A tenth of the edges are noise. A trained model therefore ranks true
held-out edges far above chance, which makes the demo a real check.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from pbg_ray.io.edges import write_edges
from pbg_ray.io.entities import save_entity_count, save_entity_names, save_relation_names
from pbg_ray.types import Bucket, EdgeList

DEMO_VERSION = 1
DEMO_ENTITIES = {"user": 40_000, "item": 20_000}
# (name, lhs type, rhs type, community shift, train edges)
DEMO_RELATIONS = [
    ("follows", "user", "user", 0, 120_000),
    ("likes", "user", "item", 0, 120_000),
    ("similar_to", "item", "item", 1, 60_000),
]
DEMO_PARTITIONS = 4
DEMO_TEST_FRACTION = 0.05


def cache_dir() -> Path:
    return Path(os.environ.get("PBG_RAY_CACHE", Path.home() / ".cache" / "pbg_ray"))


def planted_targets(src_community: np.ndarray, community: np.ndarray, num_communities: int,
                    shift: int, noise: float, rng: np.random.Generator) -> np.ndarray:
    """rhs ids [E] of edges whose lhs entities are in communities src_community [E]: a
    uniform member of community (c + shift) % num_communities among the rhs candidates
    (community [N]: the community of each), or, with probability `noise`, any candidate."""
    n = len(src_community)
    by_comm = np.argsort(community, kind="stable")
    starts = np.searchsorted(community[by_comm], np.arange(num_communities + 1))
    target_comm = (src_community + shift) % num_communities
    sizes = starts[target_comm + 1] - starts[target_comm]
    dst = by_comm[starts[target_comm] + (rng.random(n) * sizes).astype(np.int64)]
    is_noise = rng.random(n) < noise
    dst[is_noise] = rng.integers(len(community), size=int(is_noise.sum()))
    return dst


def grown_graph(num_nodes: int, num_edges: int, *, growth: float = 0.1,
                num_communities: int = 20, noise: float = 0.1, test_fraction: float = 0.05,
                seed: int = 0) -> Dict[str, List[Tuple[str, str, str]]]:
    """Raw edges (lhs name, "link", rhs name) of a one-type graph with planted communities
    (nodes link inside their community), and of its growth by `growth` x num_nodes new
    nodes with growth x num_edges new edges, each touching a new node on one side and
    any node of its community on the other. Splits: old_train, old_test, new_train,
    new_test (test_fraction of each held out). Nodes are named n0, n1, ...; new nodes
    come after the old ones. Requires num_communities <= num_nodes."""
    rng = np.random.default_rng(seed)
    num_new = max(1, int(round(num_nodes * growth)))
    community = np.concatenate([np.arange(num_communities),  # no community left empty
                                rng.integers(num_communities, size=num_nodes - num_communities),
                                rng.integers(num_communities, size=num_new)])
    src = rng.integers(num_nodes, size=num_edges)
    dst = planted_targets(community[src], community[:num_nodes], num_communities, 0, noise, rng)
    num_grown = max(1, int(round(num_edges * growth)))
    new_src = num_nodes + rng.integers(num_new, size=num_grown)
    new_dst = planted_targets(community[new_src], community, num_communities, 0, noise, rng)
    flip = rng.random(num_grown) < 0.5  # new nodes on both sides
    new_src[flip], new_dst[flip] = new_dst[flip], new_src[flip]
    splits = {}
    for name, (lhs, rhs) in (("old", (src, dst)), ("new", (new_src, new_dst))):
        rows = [(f"n{l}", "link", f"n{r}") for l, r in zip(lhs.tolist(), rhs.tolist())]
        is_test = rng.random(len(rows)) < test_fraction
        splits[f"{name}_train"] = [row for row, t in zip(rows, is_test) if not t]
        splits[f"{name}_test"] = [row for row, t in zip(rows, is_test) if t]
    return splits


def build_demo_graph(out: Path, *, num_communities: int = 100, noise: float = 0.1,
                     seed: int = 0) -> None:
    """Write the demo graph in PBG's layout: out/entities, out/edges/{train,test}."""
    rng = np.random.default_rng(seed)
    community, part_of, offset_of = {}, {}, {}
    for entity, count in DEMO_ENTITIES.items():
        community[entity] = rng.integers(num_communities, size=count)
        # A seeded shuffle, then contiguous ranges: PBG's partitioning.
        order = rng.permutation(count)
        bounds = np.linspace(0, count, DEMO_PARTITIONS + 1).astype(np.int64)
        part_of[entity] = np.empty(count, np.int64)
        offset_of[entity] = np.empty(count, np.int64)
        for part in range(DEMO_PARTITIONS):
            ids = order[bounds[part]:bounds[part + 1]]
            part_of[entity][ids] = part
            offset_of[entity][ids] = np.arange(len(ids))
            save_entity_count(out / "entities", entity, part, len(ids))
            save_entity_names(out / "entities", entity, part, [f"{entity}_{i}" for i in ids])

    # Names of relation ids; torchbiggraph's export_to_tsv reads them in every mode.
    save_relation_names(out / "entities", [name for name, *_ in DEMO_RELATIONS])
    lhs, rhs, rel = [], [], []
    for rel_id, (_, lhs_type, rhs_type, shift, num_train) in enumerate(DEMO_RELATIONS):
        n = int(round(num_train / (1 - DEMO_TEST_FRACTION)))
        src = rng.integers(DEMO_ENTITIES[lhs_type], size=n)
        dst = planted_targets(community[lhs_type][src], community[rhs_type], num_communities,
                              shift, noise, rng)
        lhs.append((lhs_type, src))
        rhs.append((rhs_type, dst))
        rel.append(np.full(n, rel_id, np.int64))

    split = {name: [] for name in ("train", "test")}
    for (lt, src), (rt, dst), r in zip(lhs, rhs, rel):
        is_test = rng.random(len(r)) < DEMO_TEST_FRACTION
        for name, mask in (("train", ~is_test), ("test", is_test)):
            split[name].append((part_of[lt][src[mask]], part_of[rt][dst[mask]],
                                offset_of[lt][src[mask]], offset_of[rt][dst[mask]], r[mask]))
    for name, pieces in split.items():
        lp, rp, lo, ro, r = (np.concatenate(x) for x in zip(*pieces))
        perm = rng.permutation(len(r))  # edges of all relations interleaved
        lp, rp, lo, ro, r = lp[perm], rp[perm], lo[perm], ro[perm], r[perm]
        for lhs_p in range(DEMO_PARTITIONS):
            for rhs_p in range(DEMO_PARTITIONS):
                mask = (lp == lhs_p) & (rp == rhs_p)
                write_edges(out / "edges" / name, Bucket(lhs_p, rhs_p),
                            EdgeList(lo[mask], ro[mask], r[mask]))


def demo_graph_dir() -> Path:
    """Where the demo graph is (built or not)."""
    return cache_dir() / f"demo-v{DEMO_VERSION}"


def demo_graph_path() -> str:
    """The demo graph's directory, built on first use (safe if several
    processes race: each builds privately, the first rename wins)."""
    path = demo_graph_dir()
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=path.parent))
        try:
            build_demo_graph(tmp)
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def demo_checkpoint_path() -> str:
    """Where the demo trains: one directory whatever the working directory, so a rerun
    resumes and eval, export, predict and plot find it without being told."""
    return str(cache_dir() / f"demo-v{DEMO_VERSION}-checkpoints")
