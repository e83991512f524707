"""Filtered full ranking of one bucket's edges against one candidate partition.

An edge's candidates on a side are all the entities of that side's type, spread over the
type's partitions, so its rank (tie rule in metrics.py) is

    1 + sum over candidate partitions p of count_p,
    count_p = #{x in p : score(x) >= pos} - #{x in p excluded : score(x) >= pos},

excluded = the true entity and the known true edges (same relation, same entity on the
other side). Each (bucket, p) is one task; the driver adds the counts up. Known edges for
the rhs side of bucket (l, r) and partition p live in the filter paths' bucket (l, p), for
the lhs side in bucket (p, r) (any bucket index for unpartitioned types). Exclusions are looked up in the very score blocks that are
counted, so rounding can never count an excluded candidate once and subtract it zero times.
A task holds its candidate partition whole and, of the bucket's other partitions, only the
rows its edges name (GatheredRows), so one task can rank many buckets' edges against the
partition it read once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.edges import check_edges, read_edges
from pbg_ray.model.params import PartitionKey, partition_key
from pbg_ray.types import SIDES, Bucket, EdgeList

if TYPE_CHECKING:  # torch loads in the functions that score, never in a driver
    from torch import Tensor

    from pbg_ray.evaluation.scoring import Scorer

# Score blocks of QUERY_BLOCK x CANDIDATE_BLOCK floats (2 MB) stay in cache between the
# bmm that writes them and the comparison that reads them; larger blocks spill out of it
# and the comparison waits on memory. Tall blocks read each candidate block for more
# queries: at d=128 the products run faster than with 256 x 2048 (docs/benchmarks-log.md).
QUERY_BLOCK = 1024
CANDIDATE_BLOCK = 512


class KnownEdges:
    """Known true edges of one filter bucket: for (other side's id, relation id) pairs,
    which entities of a side are true. edges: the bucket's edges of every filter path."""

    def __init__(self, edges: EdgeList, num_relation_ids: int) -> None:
        self.edges = edges
        self.num_relation_ids = num_relation_ids
        self._index: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}

    def _sorted(self, side: str) -> Tuple[np.ndarray, np.ndarray]:
        """(sorted keys other id * R + rel, the side's ids in that order), built once."""
        if side not in self._index:
            other = self.edges.lhs if side == "rhs" else self.edges.rhs
            keys = other * self.num_relation_ids + self.edges.rel
            order = np.argsort(keys, kind="stable")
            self._index[side] = keys[order], getattr(self.edges, side)[order]
        return self._index[side]

    def true_entities(self, side: str, other_ids: np.ndarray, rel_ids: np.ndarray
                      ) -> Tuple[np.ndarray, np.ndarray]:
        """(query row [M], entity of `side` [M]): every known edge matching query i's
        other-side id and relation id (other_ids, rel_ids: [B])."""
        keys, values = self._sorted(side)
        query = other_ids * self.num_relation_ids + rel_ids
        lo = np.searchsorted(keys, query, "left")
        n = np.searchsorted(keys, query, "right") - lo
        rows = np.repeat(np.arange(len(query)), n)
        starts = np.repeat(lo - (np.cumsum(n) - n), n)
        return rows, values[starts + np.arange(len(rows))]


@dataclass(frozen=True)
class GatheredRows:
    """The rows of a partition that a ranking task needs without holding the partition:
    sorted unique offsets and their raw embeddings, indexed by offsets as the partition's
    tensor is."""

    offsets: np.ndarray  # int64 [M], sorted, unique
    rows: np.ndarray  # float32 [M, D]

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, ids: "Tensor") -> "Tensor":
        import torch

        wanted = ids.numpy()
        pos = np.searchsorted(self.offsets, wanted).clip(max=max(0, len(self.offsets) - 1))
        if not np.array_equal(self.offsets[pos], wanted):
            raise PbgRayError("a ranking task was asked for rows it was not given (a bug)")
        return torch.from_numpy(self.rows[pos])  # a copy: the rows may be read-only


def filter_buckets(config: ConfigSchema, side: str, other_part: int, cand_part: int
                   ) -> Dict[Bucket, List[int]]:
    """The buckets that may hold known edges whose `side` entity is in partition cand_part
    and whose other entity is in partition other_part, with the relations (indices into
    config.relations) to take from each. An unpartitioned type's edges may sit in any
    bucket index of its side, so every one of those is read for it."""
    nparts = {s: max(config.entities[getattr(r, s)].num_partitions for r in config.relations)
              for s in SIDES}
    wanted: Dict[Bucket, List[int]] = {}
    for idx, rconf in enumerate(config.relations):
        parts = {}
        for s, part in ((side, cand_part), ("lhs" if side == "rhs" else "rhs", other_part)):
            partitioned = config.entities[getattr(rconf, s)].num_partitions > 1
            parts[s] = [part] if partitioned else range(nparts[s])
        for lhs in parts["lhs"]:
            for rhs in parts["rhs"]:
                wanted.setdefault(Bucket(lhs, rhs), []).append(idx)
    return wanted


def read_known(config: ConfigSchema, filter_paths: Sequence[str],
               buckets: Mapping[Bucket, List[int]], entity_counts: Mapping, num_rel: int
               ) -> KnownEdges:
    """The known edges of the given buckets (filter_buckets) in every filter path."""
    lists = [EdgeList(*(np.empty(0, np.int64),) * 3)]
    for bucket, relations in buckets.items():
        for path in filter_paths:
            edges = read_edges(path, bucket)
            check_edges(edges, bucket, config, entity_counts, num_rel,
                        f"filter edge file {path}/edges_{bucket.lhs}_{bucket.rhs}.h5")
            if not config.dynamic_relations:  # in dynamic mode all ids share one relation config
                edges = edges[np.flatnonzero(np.isin(edges.rel, relations))]
            lists.append(EdgeList(edges.lhs, edges.rhs, edges.rel))
    return KnownEdges(EdgeList.cat(lists), num_rel)


def count_above(scorer: Scorer, queries: Tensor, pos: Tensor, candidates: Tensor,
                rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Per query, the candidates scoring >= its positive, less the excluded ones that do.

    queries [B, D], pos [B], candidates [N, D]; (rows, cols) [M]: excluded (query,
    candidate) pairs, unique. Returns int64 [B]."""
    import torch

    from pbg_ray.model.losses import count_at_least

    B, N = len(queries), len(candidates)
    counts = torch.zeros(B, dtype=torch.int64)
    # Exclusions ordered by (query block, candidate): each score block's are one slice.
    key = (rows // QUERY_BLOCK) * N + cols
    order = np.argsort(key, kind="stable")
    key, rows, cols = key[order], torch.from_numpy(rows[order]), torch.from_numpy(cols[order])
    # One score buffer, and one for torch's comparison where the C count cannot serve.
    scores = torch.empty(QUERY_BLOCK * CANDIDATE_BLOCK)
    above = torch.empty(QUERY_BLOCK * CANDIDATE_BLOCK)
    pos = pos.contiguous()
    for r0 in range(0, B, QUERY_BLOCK):
        q, p = queries[r0:r0 + QUERY_BLOCK], pos[r0:r0 + QUERY_BLOCK]
        block_key = (r0 // QUERY_BLOCK) * N
        edges = np.minimum(np.arange(0, N + CANDIDATE_BLOCK, CANDIDATE_BLOCK), N)
        bounds = np.searchsorted(key, block_key + edges)
        for i, c0 in enumerate(range(0, N, CANDIDATE_BLOCK)):
            k = candidates[c0:c0 + CANDIDATE_BLOCK]
            shape = (len(q), len(k))
            s = scorer.matrix(q, k, scores[:shape[0] * shape[1]].view(1, *shape))
            if not count_at_least(s, p, counts[r0:r0 + len(q)]):
                # Compared into a float buffer: bool outputs and their sums are several
                # times slower.
                a = torch.ge(s, p.unsqueeze(1), out=above[:shape[0] * shape[1]].view(shape))
                counts[r0:r0 + len(q)] += a.sum(1).long()
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                r, c = rows[lo:hi] - r0, cols[lo:hi] - c0
                counts.index_add_(0, r + r0, -torch.ge(s[r, c], p[r]).long())
    return counts.numpy()


def relation_groups(config: ConfigSchema, rel: np.ndarray) -> Iterator[Tuple[int, np.ndarray]]:
    """(index into config.relations, edge positions) of the edges scored alike: each
    relation on its own in per-relation mode, all edges at once in dynamic mode."""
    if config.dynamic_relations:
        yield 0, np.arange(len(rel))
        return
    for relation in np.unique(rel):
        yield int(relation), np.flatnonzero(rel == relation)


def check_rankable(config: ConfigSchema) -> None:
    """Refuse configs whose entities have no candidate set to rank against."""
    featurized = sorted(e for e, c in config.entities.items() if c.featurized)
    if featurized:
        raise PbgRayError(f"entity types {featurized} are featurized: their entities are bags "
                          "of features, with no embedding to rank against. Set "
                          "eval.filtered=false to get PBG's sampled metrics only.")


def rank_counts(scorer: Scorer, bucket: Bucket, edges: EdgeList, cand_part: int,
                tables: Mapping[PartitionKey, Tensor],
                known: Mapping[str, Optional[KnownEdges]]) -> Dict[str, np.ndarray]:
    """count_p (module docstring) of every edge of `bucket` for candidate partition
    cand_part, per side: {"lhs": int64 [E], "rhs": int64 [E]}. tables: the raw embeddings
    [N, D] of partition cand_part of each type, and of the bucket's partitions (or their
    rows the edges name, GatheredRows); known: per side, the known edges of its filter
    bucket (None: unfiltered)."""
    return buckets_rank_counts(scorer, [(bucket, edges, known)], cand_part, tables)[0]


def buckets_rank_counts(scorer: Scorer, shares: Sequence[Tuple[Bucket, EdgeList, Mapping[
                            str, Optional[KnownEdges]]]], cand_part: int,
                        tables: Mapping[PartitionKey, Tensor]) -> List[Dict[str, np.ndarray]]:
    """rank_counts of several buckets' edges (each with its known edges) against one
    candidate partition: the candidates prepared once, and the queries of every bucket
    scored together, so that score blocks stay full however few edges a bucket has."""
    import torch

    config = scorer.config
    counts = [{side: np.zeros(len(edges), np.int64) for side in SIDES} for _, edges, _ in shares]
    candidates: Dict[Tuple[str, str, int], Tensor] = {}
    # Per candidate set: (share, side, edge positions, queries, positives, excluded pairs).
    pending: Dict[Tuple[str, str, int], List[Tuple[Any, ...]]] = {}
    for share, (bucket, edges, known) in enumerate(shares):
        ids = {side: getattr(edges, side) for side in SIDES}
        rel_ids = torch.from_numpy(edges.rel)
        for relation, idx in relation_groups(config, edges.rel):
            rconf = config.relations[relation]
            keys = {side: partition_key(config, getattr(rconf, side), part)
                    for side, part in zip(SIDES, bucket)}
            vectors = {side: scorer.entity_vectors(key[0], tables[key][torch.from_numpy(ids[side][idx])])
                       for side, key in keys.items()}
            for side, other in (("lhs", "rhs"), ("rhs", "lhs")):
                entity = getattr(rconf, side)
                cand_key = partition_key(config, entity, cand_part)
                if cand_key[1] != cand_part:
                    continue  # an unpartitioned type is ranked by the tasks of partition 0 only
                queries = scorer.queries(side, relation, rel_ids[idx], vectors[other])
                pos = scorer.pos(queries, scorer.candidates(side, relation, vectors[side]))
                cache_key = (entity, relation if scorer.relation_specific(side, relation) else -1)
                if cache_key not in candidates:
                    candidates[cache_key] = scorer.candidates(
                        side, relation, scorer.entity_vectors(entity, tables[cand_key]))
                rows, cols = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
                if keys[side] == cand_key:  # the true entity is a candidate here
                    rows.append(np.arange(len(idx)))
                    cols.append(ids[side][idx])
                if known.get(side) is not None:
                    r, c = known[side].true_entities(side, ids[other][idx], edges.rel[idx])
                    rows.append(r)
                    cols.append(c)
                pending.setdefault(cache_key, []).append(
                    (share, side, idx, queries, pos, np.concatenate(rows), np.concatenate(cols)))
    for cache_key, items in pending.items():
        num = len(candidates[cache_key])
        starts = np.cumsum([0] + [len(item[2]) for item in items])
        pairs = np.unique(np.concatenate([(rows + start) * num + cols for start, (*_, rows, cols)
                                          in zip(starts, items)]))
        above = count_above(scorer, torch.cat([item[3] for item in items]),
                            torch.cat([item[4] for item in items]), candidates[cache_key],
                            pairs // num, pairs % num)
        for start, (share, side, idx, *_) in zip(starts, items):
            counts[share][side][idx] = above[start:start + len(idx)]
    return counts
