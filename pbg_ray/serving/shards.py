"""What the HTTP service (pbg_ray/serving/service.py) computes, without Ray: faiss indexes of a
checkpoint version's candidate vectors, the top-k search of a shard's partitions (exact or
approximate), and the answers to requests by names, from the model's own scoring
(pbg_ray.evaluation.scoring.Scorer, as the Predictor and eval score). A batch is answered
per query: a query that names an unknown entity or relation (or is otherwise wrong on its
own) gets its error in its answer's place, and the others their answers.

A candidate set is what one side of a relation ranks in one partition of an entity type:
the Scorer's prepared candidate vectors. Sets are shared across relations (key relation
None: entity vectors prepared by the comparator; also the neighbour search's) except where
the relation operator applies to the candidates (rhs side in per-relation mode, operator
other than none: key the relation's index). The query side carries the operator otherwise
(lhs side, dynamic mode): the query vector is transformed, the set is shared.

An index is searched with the comparator's metric: inner product for dot and cos (cos's
prepared vectors have unit norm), L2 for l2 and squared_l2. Its hits are rescored exactly
with the comparator, so every score returned is the model's own; only which candidates
make the top k may differ from exact search, which scores every candidate. A relation's
set needs no index of its own where the query can carry the operator instead: for dot,
<q, op(x)> = <op*(q), x> + <q, t> (op* the adjoint of the operator's linear part, t its
translation, the same for every candidate); for L2, |q - (x + t)| = |(q - t) - x|. Such
sets are searched in the relation-free set's index with the transformed query.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import itertools
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.config import ConfigSchema, ServeConfig
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.evaluation.filtered import KnownEdges, check_rankable
from pbg_ray.evaluation.predictor import relation_by_name
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import (
    load_entity_counts, load_entity_names, load_relation_names, num_relation_ids)
from pbg_ray.io.files import write_bytes_atomic
from pbg_ray.io.storage import StoragePath, is_uri, storage_path
from pbg_ray.model.params import operator_key, params_from_checkpoint
from pbg_ray.types import Bucket

# (entity type, partition, relation index or None): one candidate set (module docstring).
SetKey = Tuple[str, int, Optional[int]]
Ranked = List[Tuple[str, float]]  # (entity name, score), best first
# One query's answer in a batch, or the error that query alone has (an unknown name, say).
Answer = Union[Ranked, float, PbgRayError]
INDEX_DIRECTORY = "serve_index"  # in checkpoint_path, one v{N}/ per checkpoint version
IP_COMPARATORS = ("dot", "cos")
ROW_CACHE = 65536  # rows of query entities the router keeps (per version)
SUGGESTIONS = 64  # names near an unknown one (in sorted order) that "did you mean" weighs


class NamedModel:
    """A checkpoint version's model parameters (as a Scorer) with its entity and relation
    names, without the embedding tables: what answering by names needs besides the rows."""

    def __init__(self, config: ConfigSchema, arrays: Dict[str, np.ndarray],
                 counts: Dict[str, List[int]], source: str) -> None:
        """arrays: the model's parameters by public name; counts: per entity type the rows
        of each partition; source: what they were loaded from (for messages)."""
        check_rankable(config)
        self.config = config
        self.source = source
        self.counts = counts
        num_rel = num_relation_ids(config)
        self.scorer = Scorer(config, params_from_checkpoint(config, num_rel, arrays, None,
                                                            where=source).arrays)
        self.relation_names = (load_relation_names(config.entity_path) if config.dynamic_relations
                               else [r.name for r in config.relations])
        self._names: Dict[str, List[List[str]]] = {}
        # Per entity type: name -> row over all partitions (str and int only: a dict the
        # garbage collector never scans), each partition's first row, the names sorted.
        self._index: Dict[str, Dict[str, int]] = {}
        self._starts: Dict[str, np.ndarray] = {}
        self._sorted: Dict[str, List[str]] = {}

    # --- names ------------------------------------------------------------

    def names(self, entity: str) -> List[List[str]]:
        """The names of an entity type, per partition."""
        if entity not in self._names:
            self._names[entity] = [load_entity_names(self.config.entity_path, entity, p)
                                   for p in range(len(self.counts[entity]))]
            for part, (names, count) in enumerate(zip(self._names[entity], self.counts[entity])):
                if len(names) != count:
                    raise PbgRayError(
                        f"entity type {entity!r} partition {part}: {len(names)} names in "
                        f"{self.config.entity_path!r} but {count} embeddings in "
                        f"{self.source}. Pass the entity_path the checkpoint was trained on.")
        return self._names[entity]

    def _name_index(self, entity: str) -> Dict[str, int]:
        """name -> row of an entity type over all its partitions, built on first use."""
        if entity not in self._index:
            names = self.names(entity)
            self._index[entity] = {n: i for i, n in enumerate(itertools.chain(*names))}
            self._starts[entity] = np.cumsum([0] + [len(part) for part in names])
        return self._index[entity]

    def _suggest(self, name: str, entities: Sequence[str]) -> str:
        """did_you_mean among the names of `entities` that sort next to `name` (a scan of
        millions of names per bad request would stall the service)."""
        near = []
        for entity in entities:
            if entity not in self._sorted:
                self._sorted[entity] = sorted(self._name_index(entity))
            names = self._sorted[entity]
            at = bisect.bisect_left(names, name)
            near += names[max(0, at - SUGGESTIONS // 2):at + SUGGESTIONS // 2]
        return did_you_mean(name, near)

    def _locate(self, entity: str, name: str) -> Tuple[int, int]:
        """(partition, offset) of an entity by name; an entity of another type is named
        as such (the wrong side of a relation)."""
        row = self._name_index(entity).get(name)
        if row is None:
            elsewhere = [e for e in self.config.entities
                         if e != entity and name in self._name_index(e)]
            if elsewhere:
                raise PbgRayError(f"{name!r} is an entity of type {elsewhere[0]!r}, not of type "
                                  f"{entity!r}: check the relation and which side the name "
                                  "is on.")
            raise PbgRayError(f"unknown {entity} entity {name!r}"
                              f"{self._suggest(name, [entity])}.")
        part = int(np.searchsorted(self._starts[entity], row, side="right")) - 1
        return part, row - int(self._starts[entity][part])

    def _relation(self, name: str) -> Tuple[int, int]:
        """(index into config.relations, relation id) of a relation by name."""
        return relation_by_name(self.config, self.relation_names, name)

    def _type_of(self, name: str) -> str:
        found = [entity for entity in self.config.entities if name in self._name_index(entity)]
        if len(found) != 1:
            raise PbgRayError(f"entity {name!r} " + (
                f"is in several types {found}; pass entity_type." if found
                else f"is unknown{self._suggest(name, list(self.config.entities))}."))
        return found[0]


def shard_of(part: int, serve: ServeConfig) -> int:
    """The shard group holding partition `part` of every entity type."""
    return part % serve.shard_groups


def set_keys(config: ConfigSchema, shard: Optional[int] = None) -> List[SetKey]:
    """The candidate sets of the partitions of one shard group (None: all)."""
    keys: List[SetKey] = []
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            if shard is not None and shard_of(part, config.serve) != shard:
                continue
            keys.append((entity, part, None))
            if not config.dynamic_relations:
                keys += [(entity, part, r) for r, rconf in enumerate(config.relations)
                         if rconf.rhs == entity and rconf.operator != "none"]
    return keys


# Operators whose relation sets are searched in the relation-free index, per comparator.
ADJOINT_OPERATORS = {
    "dot": ("none", "translation", "diagonal", "linear", "affine", "complex_diagonal"),
    "l2": ("none", "translation"), "squared_l2": ("none", "translation")}


def shares_index(config: ConfigSchema, key: SetKey) -> bool:
    """Whether a relation's set is searched in the relation-free set's index."""
    relation = key[2]
    return (relation is not None and not config.bias and config.relations[relation].operator
            in ADJOINT_OPERATORS.get(config.comparator, ()))


def index_keys(config: ConfigSchema) -> List[SetKey]:
    """The sets with an index of their own (if their size asks for one)."""
    return [key for key in set_keys(config) if not shares_index(config, key)]


def adjoint_queries(scorer: Scorer, relation: int, queries: Tensor) -> Tensor:
    """Queries [B, D] whose search among the relation-free set ranks candidates as
    `queries` rank the relation's (module docstring); for sets that share_index."""
    config = scorer.config
    operator = config.relations[relation].operator
    p = {name: scorer.params[operator_key(relation, "rhs", name)]
         for name, _ in scorer.operators[relation].param_names}
    if operator == "translation" and config.comparator != "dot":
        return queries - p["translation"]
    if operator == "diagonal":
        return queries * p["diagonal"]
    if operator in ("linear", "affine"):
        return queries @ p["linear_transformation"]  # forward is x @ A^T
    if operator == "complex_diagonal":  # the conjugate diagonal
        return scorer.operators[relation].forward(queries, {"real": p["real"],
                                                            "imag": -p["imag"]})
    return queries


def set_relation(scorer: Scorer, side: str, relation: int) -> Optional[int]:
    """The relation part of the key of the set `side` of `relation` ranks in."""
    specific = (scorer.relation_specific(side)
                and scorer.config.relations[relation].operator != "none")
    return relation if specific else None


def candidate_vectors(scorer: Scorer, entity: str, rows: Tensor, relation: Optional[int]) -> Tensor:
    """The prepared candidates [N, D] of a set from a partition's raw rows [N, D]."""
    vectors = scorer.entity_vectors(entity, rows)
    if relation is None:
        return scorer.comparator.prepare(vectors)[0]
    return scorer.candidates("rhs", relation, vectors)


def index_kind(config: ConfigSchema, rows: int) -> str:
    """exact, hnsw or ivf for a set of `rows` candidates (serve.index; auto: by size)."""
    serve = config.serve
    if serve.index != "auto":
        return serve.index
    if config.bias or rows < serve.index_min_rows:
        return "exact"
    return "hnsw" if rows < serve.ivf_min_rows else "ivf"


def index_file(config: ConfigSchema, version: int, key: SetKey, kind: str) -> StoragePath:
    """Where a set's index of `version` is saved: beside the version, named by its build
    settings (so changed settings build a new one)."""
    serve = config.serve
    settings = (f"{kind} {serve.hnsw_m} {serve.hnsw_ef_construction}" if kind == "hnsw"
                else f"{kind} {serve.ivf_lists}")
    tag = hashlib.sha1(settings.encode()).hexdigest()[:8]
    entity, part, relation = key
    name = f"{entity}_{part}{'' if relation is None else f'_r{relation}'}.{kind}-{tag}.faiss"
    return storage_path(config.checkpoint_path) / INDEX_DIRECTORY / f"v{version}" / name


def build_index(vectors: np.ndarray, kind: str, comparator: str, serve: ServeConfig) -> Any:
    """A faiss index (hnsw or ivf) of vectors float32 [N, D] with the comparator's metric."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    metric = faiss.METRIC_INNER_PRODUCT if comparator in IP_COMPARATORS else faiss.METRIC_L2
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, serve.hnsw_m, metric)
        index.hnsw.efConstruction = serve.hnsw_ef_construction
    else:
        lists = serve.ivf_lists or int(4 * np.sqrt(n))
        lists = max(1, min(lists, n // 39 or 1))  # faiss wants 39 training points per list
        quantizer = (faiss.IndexFlatIP if metric == faiss.METRIC_INNER_PRODUCT
                     else faiss.IndexFlatL2)(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, lists, metric)
        sample = vectors[np.random.default_rng(0).permutation(n)[:lists * 256]]
        index.train(sample)
    index.add(vectors)
    return index


def build_set_index(config: ConfigSchema, version: int, key: SetKey) -> Dict[str, Any]:
    """Build and save the index of one set of `version` unless it is saved already (an
    exact set has none). Returns its figures: key, kind, rows, seconds (0: found saved)."""
    import faiss

    entity, part, relation = key
    checkpoint = CheckpointManager(config.checkpoint_path)
    rows = checkpoint.read_partition(version, entity, part)[0]
    kind = index_kind(config, len(rows))
    figures = {"key": list(key), "kind": kind, "rows": len(rows), "seconds": 0.0}
    path = index_file(config, version, key, kind)
    if kind == "exact" or path.is_file():
        return figures
    start = time.perf_counter()
    model = NamedModel(config, checkpoint.read_model(version)[0], {}, f"version {version}")
    vectors = candidate_vectors(model.scorer, entity, torch.from_numpy(rows), relation)
    index = build_index(vectors.numpy(), kind, config.comparator, config.serve)
    write_bytes_atomic(path, faiss.serialize_index(index).tobytes())
    figures["seconds"] = time.perf_counter() - start
    return figures


def drop_old_indexes(config: ConfigSchema, keep: Sequence[int]) -> None:
    """Remove the saved indexes of versions other than `keep` (local checkpoints only)."""
    if is_uri(config.checkpoint_path):
        return
    root = storage_path(config.checkpoint_path) / INDEX_DIRECTORY
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if directory.name not in {f"v{v}" for v in keep}:
            for file in directory.iterdir():
                file.unlink(missing_ok=True)
            directory.rmdir()


@dataclasses.dataclass
class CandidateSet:
    vectors: Tensor  # prepared candidates [N, D]
    index: Any  # the faiss index, None: exact search


class ShardTables:
    """The candidate sets of one shard group's partitions of a checkpoint version, and
    their top-k search."""

    def __init__(self, config: ConfigSchema, version: int, shard: int) -> None:
        import faiss

        self.config = config
        self.version = version
        checkpoint = CheckpointManager(config.checkpoint_path)
        model = NamedModel(config, checkpoint.read_model(version)[0], {}, f"version {version}")
        self.scorer = model.scorer
        self.num_relations = len(model.relation_names)
        self.tables: Dict[Tuple[str, int], Tensor] = {}
        self.sets: Dict[SetKey, CandidateSet] = {}
        for key in set_keys(config, shard):
            entity, part, relation = key
            if (entity, part) not in self.tables:
                self.tables[entity, part] = torch.from_numpy(
                    checkpoint.read_partition(version, entity, part)[0])
            vectors = candidate_vectors(self.scorer, entity, self.tables[entity, part], relation)
            kind = index_kind(config, len(vectors))
            index = None
            if kind != "exact" and not shares_index(config, key):
                path = index_file(config, version, key, kind)
                index = faiss.deserialize_index(np.frombuffer(path.read_bytes(), np.uint8))
                if kind == "hnsw":
                    index.hnsw.efSearch = config.serve.hnsw_ef_search
                else:
                    index.nprobe = config.serve.ivf_probes
            self.sets[key] = CandidateSet(vectors, index)
        self._known: Dict[Tuple[str, Bucket], KnownEdges] = {}

    def rows(self, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        """Raw embeddings [len(offsets), D] of a partition."""
        return self.tables[entity, part][torch.from_numpy(np.asarray(offsets, np.int64))].numpy()

    def known(self, path: str, bucket: Bucket) -> KnownEdges:
        """The edges of a bucket of an edge path (the last few buckets kept)."""
        if (path, bucket) not in self._known:
            if len(self._known) >= 64:
                self._known.pop(next(iter(self._known)))
            self._known[path, bucket] = KnownEdges(read_edges(path, bucket), self.num_relations)
        return self._known[path, bucket]

    def banned(self, key: SetKey, num: int, exclude: Optional[Dict[str, Any]],
               skip: Optional[np.ndarray]) -> List[np.ndarray]:
        """Per query, the offsets left out of the answer: `skip` [B] (-1: none) and the
        true entities of the known edges of exclude's edge paths."""
        banned = [np.empty(0, np.int64) for _ in range(num)]
        if skip is not None:
            banned = [np.array([s]) if s >= 0 else b for s, b in zip(skip, banned)]
        if exclude:
            side, part = exclude["side"], key[1]
            for other_part in set(exclude["other_parts"]):
                mine = np.flatnonzero(np.asarray(exclude["other_parts"]) == other_part)
                bucket = Bucket(other_part, part) if side == "rhs" else Bucket(part, other_part)
                for path in exclude["paths"]:
                    rows, ids = self.known(path, bucket).true_entities(
                        side, np.asarray(exclude["other_ids"])[mine],
                        np.asarray(exclude["rel_ids"])[mine])
                    for r in np.unique(rows):
                        banned[mine[r]] = np.concatenate([banned[mine[r]], ids[rows == r]])
        return banned

    def search(self, key: SetKey, queries: np.ndarray, k: int, exact: bool = False,
               exclude: Optional[Dict[str, Any]] = None, skip: Optional[np.ndarray] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The k best candidates of set `key` for prepared queries [B, D]: scores float32
        [B, k] (-inf past the end) and offsets int64 [B, k] (-1 there). exclude: {paths,
        side, other_parts, other_ids, rel_ids} (known edges left out); skip: an offset per
        query left out (-1: none)."""
        cands = self.sets[key]
        q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
        banned = self.banned(key, len(q), exclude, skip)
        n = len(cands.vectors)
        index, probe = cands.index, q
        if shares_index(self.config, key):
            index = self.sets[key[0], key[1], None].index
            probe = adjoint_queries(self.scorer, key[2], q)
        if exact or index is None:
            scores = self.scorer.matrix(q, cands.vectors)
            for i, ids in enumerate(banned):
                scores[i, torch.from_numpy(ids)] = -float("inf")
            top = torch.topk(scores, min(k, n), dim=1)
            values, offsets = top.values, top.indices
        else:
            wanted = min(n, k + max(len(b) for b in banned))
            if hasattr(index, "hnsw"):
                index.hnsw.efSearch = max(self.config.serve.hnsw_ef_search, wanted)
            _, hits = index.search(np.ascontiguousarray(probe.numpy()), wanted)
            offsets = torch.from_numpy(hits)
            found = cands.vectors[offsets.clamp_min(0)]
            # The comparator's exact scores of the hits: [B, 1, D] x [B, wanted, D].
            values = self.scorer.comparator.matrix(q.unsqueeze(1), found)[:, 0]
            values[offsets < 0] = -float("inf")
            for i, ids in enumerate(banned):
                values[i, torch.from_numpy(np.isin(hits[i], ids))] = -float("inf")
            top = torch.topk(values, min(k, wanted), dim=1)
            values, offsets = top.values, offsets.gather(1, top.indices)
        offsets = offsets.clone()
        offsets[values == -float("inf")] = -1
        return values.numpy(), offsets.numpy()

    def search_group(self, entity: str, parts: Sequence[int], relation: Optional[int],
                     queries: np.ndarray, k: int, exact: bool = False,
                     exclude: Optional[Dict[str, Any]] = None,
                     skip: Optional[Tuple[int, int]] = None
                     ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """search() of the sets (entity, part, relation) of `parts` (this shard group's),
        as one call: a request reaches each shard group once. skip: the (partition,
        offset) of an entity left out of every query's answer."""
        return [self.search((entity, part, relation), queries, k, exact, exclude,
                            None if skip is None else
                            np.full(len(queries), skip[1] if skip[0] == part else -1))
                for part in parts]


# The shards, as the router reaches them: rows(entity, part, offsets) -> raw rows, and
# search(entity, parts, relation, queries, k, exact, exclude, skip) -> [(scores, offsets)
# per part] (ShardTables.search_group), both awaitable.
RowsFn = Callable[[str, int, np.ndarray], Awaitable[np.ndarray]]
SearchFn = Callable[..., Awaitable[List[Tuple[np.ndarray, np.ndarray]]]]


@dataclasses.dataclass
class TopQuery:
    relation: int  # index into config.relations
    rel_id: int
    other_entity: str  # the type of the entity given
    part: int
    offset: int


def per_query(queries: Sequence[Any], resolve: Callable[[Any], Any]
              ) -> Tuple[List[Optional[PbgRayError]], Dict[int, Any]]:
    """Each query of a batch resolved on its own (names to rows, relation names to ids):
    (the answers so far: the PbgRayError of each query that failed, None elsewhere;
    {index: resolve(query)} of the others)."""
    answers: List[Optional[PbgRayError]] = []
    resolved: Dict[int, Any] = {}
    for i, query in enumerate(queries):
        try:
            resolved[i] = resolve(query)
            answers.append(None)
        except PbgRayError as err:
            answers.append(err)
    return answers, resolved


class ServingModel(NamedModel):
    """Requests by names answered from a checkpoint version's model and its shards."""

    def __init__(self, config: ConfigSchema, version: Optional[int],
                 previous: Optional["ServingModel"] = None) -> None:
        """The model of `version` (None: the newest); the names are read now, or taken
        from `previous` (the version served before) when the entity counts are the same."""
        checkpoint, version = CheckpointManager(config.checkpoint_path).locate(
            config, version, "serve.version")
        super().__init__(config, checkpoint.read_model(version)[0],
                         load_entity_counts(config), f"version {version} of "
                         f"{str(checkpoint.path)!r}")
        self.version = version
        self._rows: "OrderedDict[Tuple[str, int, int], np.ndarray]" = OrderedDict()
        if previous is not None and previous.counts == self.counts:
            self._names, self._index = previous._names, previous._index
            self._starts, self._sorted = previous._starts, previous._sorted
        for entity in config.entities:
            self._name_index(entity)

    def check(self, k: int, batch: Sequence[Any]) -> None:
        serve = self.config.serve
        if not 1 <= k <= serve.max_k:
            raise PbgRayError(f"k={k} is out of range: ask for 1 to {serve.max_k} "
                              "(serve.max_k) results.")
        if not 1 <= len(batch) <= serve.max_batch:
            raise PbgRayError(f"{len(batch)} queries in one request: send 1 to "
                              f"{serve.max_batch} (serve.max_batch).")

    def check_exclude(self, paths: Sequence[str]) -> List[str]:
        """Edge paths a request may exclude: those of the config, by path or last name."""
        known = list(self.config.edge_paths) + list(self.config.eval_edge_paths)
        by_name = {p.rstrip("/").rsplit("/", 1)[-1]: p for p in known}
        found = []
        for path in paths:
            if path not in known and path not in by_name:
                raise PbgRayError(f"exclude: {path!r} is not an edge path of the served config"
                                  f"{did_you_mean(path, list(by_name) + known)}. Edge paths: "
                                  f"{', '.join(known)}.")
            found.append(by_name.get(path, path))
        return found

    def metadata(self) -> Dict[str, Any]:
        config = self.config
        return {
            "version": self.version,
            "entity_types": {e: {"count": sum(self.counts[e]), "partitions": len(self.counts[e]),
                                 "dimension": config.entity_dimension(e)}
                             for e in config.entities},
            "relations": [{"name": name, **{k: getattr(config.relations[r], k)
                                            for k in ("lhs", "rhs", "operator")}}
                          for name, (r, _) in ((n, self._relation(n))
                                               for n in self.relation_names)],
            "dimension": config.dimension, "comparator": config.comparator,
            "index": config.serve.index, "shard_groups": config.serve.shard_groups,
        }

    async def _vectors(self, rows: RowsFn, entity: str, located: List[Tuple[int, int]]
                       ) -> Tensor:
        """Entity vectors [B, D] (Scorer.entity_vectors) of (partition, offset) pairs; the
        rows come from the shards, the last ROW_CACHE fetched are kept."""
        missing = sorted({(entity, p, o) for p, o in located} - set(self._rows))
        parts = np.array([p for _, p, _ in missing])
        offsets = np.array([o for _, _, o in missing])
        fetched = await asyncio.gather(*(rows(entity, int(p), offsets[parts == p])
                                         for p in np.unique(parts)))
        for p, values in zip(np.unique(parts), fetched):
            for o, row in zip(offsets[parts == p], values):
                self._rows[entity, int(p), int(o)] = row
        while len(self._rows) > ROW_CACHE:
            self._rows.popitem(last=False)
        out = np.stack([self._rows[entity, p, o] for p, o in located])
        return self.scorer.entity_vectors(entity, torch.from_numpy(out))

    async def score(self, rows: RowsFn, edges: Sequence[Tuple[str, str, str]]
                    ) -> List[Answer]:
        """The scores of (lhs, relation, rhs) name triples (as Predictor.score); an edge
        with an unknown name gets its PbgRayError instead."""
        self.check(1, edges)

        def resolve(edge: Tuple[str, str, str]) -> Tuple[int, int, Tuple[int, int],
                                                           Tuple[int, int]]:
            relation, rel_id = self._relation(edge[1])
            rconf = self.config.relations[relation]
            return (relation, rel_id, self._locate(rconf.lhs, edge[0]),
                    self._locate(rconf.rhs, edge[2]))

        answers, resolved = per_query(edges, resolve)
        for relation in sorted({r[0] for r in resolved.values()}):
            idx = [i for i, r in resolved.items() if r[0] == relation]
            rconf = self.config.relations[relation]
            lhs = await self._vectors(rows, rconf.lhs, [resolved[i][2] for i in idx])
            rhs = await self._vectors(rows, rconf.rhs, [resolved[i][3] for i in idx])
            rel_ids = torch.tensor([resolved[i][1] for i in idx])
            query = self.scorer.queries("rhs", relation, rel_ids, lhs)
            scores = self.scorer.pos(query, self.scorer.candidates("rhs", relation, rhs))
            for i, score in zip(idx, scores.tolist()):
                answers[i] = score
        return answers

    async def top(self, rows: RowsFn, search: Callable[[int], SearchFn], side: str,
                  queries: Sequence[Tuple[str, str]], k: int, exclude: Sequence[str] = (),
                  exact: bool = False) -> List[Answer]:
        """The k best `side` entities for (given name, relation name) pairs (the given
        entity is the other side's); a query with an unknown name gets its PbgRayError
        instead. exclude: edge paths whose known edges are left out. search(shard group)
        reaches a shard."""
        self.check(k, queries)
        paths = self.check_exclude(exclude)
        other = "lhs" if side == "rhs" else "rhs"

        def resolve(query: Tuple[str, str]) -> TopQuery:
            relation, rel_id = self._relation(query[1])
            entity = getattr(self.config.relations[relation], other)
            return TopQuery(relation, rel_id, entity, *self._locate(entity, query[0]))

        answers, resolved = per_query(queries, resolve)
        for relation in sorted({q.relation for q in resolved.values()}):
            idx = [i for i, q in resolved.items() if q.relation == relation]
            group = [resolved[i] for i in idx]
            rconf = self.config.relations[relation]
            vectors = await self._vectors(rows, group[0].other_entity,
                                          [(q.part, q.offset) for q in group])
            rel_ids = torch.tensor([q.rel_id for q in group])
            prepared = self.scorer.queries(side, relation, rel_ids, vectors).numpy()
            known = {"paths": paths, "side": side, "other_parts": [q.part for q in group],
                     "other_ids": [q.offset for q in group],
                     "rel_ids": [q.rel_id for q in group]} if paths else None
            ranked = await self._search(search, getattr(rconf, side),
                                        set_relation(self.scorer, side, relation), prepared, k,
                                        exact, known, None)
            for i, answer in zip(idx, ranked):
                answers[i] = answer
        return answers

    def _neighbor_query(self, query: Dict[str, Any]
                        ) -> Tuple[str, Optional[List[float]], Optional[Tuple[int, int]]]:
        """(entity type, vector, (partition, offset)) of a neighbours query: {"entity":
        name, "entity_type": type or None} (vector None) or {"vector": [D floats],
        "entity_type": type} (partition and offset None)."""
        entity = query.get("entity_type")
        if entity is not None and entity not in self.config.entities:
            raise PbgRayError(f"unknown entity type {entity!r}"
                              f"{did_you_mean(entity, self.config.entities)}.")
        if (query.get("vector") is None) == (query.get("entity") is None):
            raise PbgRayError("a neighbours query gives either entity (a name) or vector.")
        if query.get("vector") is None:
            entity = entity or self._type_of(query["entity"])
            return entity, None, self._locate(entity, query["entity"])
        if entity is None:
            raise PbgRayError("a neighbours query by vector needs entity_type.")
        dim = self.config.entity_dimension(entity)
        if len(query["vector"]) != dim or not np.isfinite(query["vector"]).all():
            raise PbgRayError(f"vector has {len(query['vector'])} values; {entity} "
                              f"embeddings have {dim}, all finite.")
        return entity, query["vector"], None

    async def neighbors(self, rows: RowsFn, search: Callable[[int], SearchFn],
                        queries: Sequence[Dict[str, Any]], k: int, exact: bool = False
                        ) -> List[Answer]:
        """The k entities nearest (by the comparator, as Predictor.neighbors) to each
        query (_neighbor_query: an entity by name, itself left out, or an entity vector,
        global embedding included); a query that is wrong on its own (an unknown name,
        a vector of the wrong length) gets its PbgRayError instead."""
        self.check(k, queries)
        answers, resolved = per_query(queries, self._neighbor_query)
        for i, (entity, vector, located) in resolved.items():
            # each its own type; a batch of one type could share a search
            if located is None:
                query = torch.tensor([vector], dtype=torch.float32)
            else:
                query = await self._vectors(rows, entity, [located])
            prepared = self.scorer.comparator.prepare(query)[0].numpy()
            answers[i] = (await self._search(search, entity, None, prepared, k, exact, None,
                                             located))[0]
        return answers

    async def _search(self, search: Callable[[int], SearchFn], entity: str,
                      relation: Optional[int], queries: np.ndarray, k: int, exact: bool,
                      known: Optional[Dict[str, Any]], skip: Optional[Tuple[int, int]]
                      ) -> List[Ranked]:
        """Every partition of `entity` searched by its shard group (one call per group),
        the hits merged into the k best per query, with names."""
        groups: Dict[int, List[int]] = {}
        for part in range(len(self.counts[entity])):
            groups.setdefault(shard_of(part, self.config.serve), []).append(part)
        answered = await asyncio.gather(*(search(group)(entity, parts, relation, queries, k,
                                                        exact, known, skip)
                                          for group, parts in groups.items()))
        parts = [part for group in groups.values() for part in group]
        found = [pair for pairs in answered for pair in pairs]
        scores = np.concatenate([s for s, _ in found], axis=1)
        where = [(part, o) for part, (_, offsets) in zip(parts, found) for o in offsets.T]
        names = self.names(entity)
        answers = []
        for i, row in enumerate(scores):
            best = np.argsort(-row, kind="stable")[:k]
            answers.append([(names[where[j][0]][int(where[j][1][i])], float(row[j]))
                            for j in best if row[j] != -np.inf])
        return answers


def in_process_shards(config: ConfigSchema, version: int
                      ) -> Tuple[Callable[..., Awaitable[np.ndarray]], Callable[[int], Callable]]:
    """Every shard group of `version` in this process, as the router reaches them through
    Ray Serve: (rows(entity, part, offsets), search(group)(...)), what ServingModel's
    queries take. For the Python API and for measuring the service without Serve."""
    shards = [ShardTables(config, version, g) for g in range(config.serve.shard_groups)]

    async def rows(entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        return shards[shard_of(part, config.serve)].rows(entity, part, offsets)

    def search(group: int) -> Callable:
        async def call(*args: Any) -> Any:
            return shards[group].search_group(*args)
        return call

    return rows, search
