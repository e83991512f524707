"""Use a trained checkpoint by names: score edges, top-k tails or heads, nearest neighbours.

    from pbg_ray import Predictor
    model = Predictor.load("model/checkpoints")          # the newest version
    model = Predictor.load("export/bundle.zip", tag="v10-int8")  # or a model bundle's tag
    model.score([("alice", "follows", "bob")])            # -> float32 [1]
    model.top_rhs("alice", "follows", k=10, exclude=["data/edges/train"])
    model.top_lhs("follows", "bob", k=10)
    model.neighbors("alice", k=10)
    model.top_k("rhs", [("alice", "follows"), ("bob", "likes")], k=10)   # many queries at once

Scores are the model's (pbg_ray.evaluation.scoring): `score` and `top_rhs` rank by the rhs
side's score, `top_lhs` by the lhs side's (the same in per-relation mode; dynamic relations
score the sides with different operators). Neighbours are compared by the comparator
on the entities' prepared vectors (global embedding added, no relation operator).

Out of core: only the model's parameters stay loaded. Entity partitions (embeddings and
names) are read when a query needs them, one candidate partition at a time: each
partition's k best per query are merged into the answer, so memory holds a few
partitions whatever the table's size (`cache_partitions` of them are kept between
calls). The per-partition work goes through a `MapPartitions` (in this process by
default; runtime/partition_jobs.py runs it as Ray tasks that read their partitions themselves).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints import bundle
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.per_partition import MapPartitions, in_process
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.evaluation.filtered import QUERY_BLOCK, KnownEdges, check_rankable
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import load_entity_names, load_relation_names, num_relation_ids
from pbg_ray.model.params import params_from_checkpoint
from pbg_ray.types import Bucket

Ranked = List[Tuple[str, float]]  # (entity name, score), best first
Triple = Tuple[str, str, str]  # (lhs name, relation name, rhs name)


@dataclasses.dataclass(frozen=True)
class EmbeddingSource:
    """Where a Predictor reads entity partitions: a checkpoint version or a bundle's tag
    (picklable, so a task reads its partition itself)."""

    path: str
    version: Optional[int] = None  # a checkpoint's
    tag: Optional[str] = None      # a bundle's

    def read(self, entity: str, part: int) -> np.ndarray:
        """float32 [N, D] of an entity partition."""
        if self.tag is not None:
            with bundle.load(self.path, self.tag) as model:
                return model.embeddings(entity, part)
        return CheckpointManager(self.path).read_partition(self.version, entity, part)[0]


class _Cached:
    """An EmbeddingSource keeping the `size` partitions read last (least recently used
    dropped first)."""

    def __init__(self, source: EmbeddingSource, size: int) -> None:
        self.source, self.size = source, size
        self._kept: "collections.OrderedDict[Tuple[str, int], np.ndarray]" = collections.OrderedDict()

    def read(self, entity: str, part: int) -> np.ndarray:
        return _lru(self._kept, (entity, part), self.size, lambda: self.source.read(entity, part))


def _lru(kept: "collections.OrderedDict", key: Any, size: int, make: Callable[[], Any]) -> Any:
    """kept[key], made by `make` if absent; at most `size` entries are kept."""
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    value = make()
    if size > 0:
        kept[key] = value
        while len(kept) > size:
            kept.popitem(last=False)
    return value


@dataclasses.dataclass(frozen=True)
class _Queries:
    """Queries against one candidate type: per query the relation (index into
    config.relations, relation id, -1 for neighbours), the other side's entity
    (partition, offset) and its prepared vector [Q, D]."""

    side: str  # the side ranked ("lhs", "rhs"), "neighbors" for same-type neighbours
    entity: str  # the candidates' type
    relation: np.ndarray
    rel_id: np.ndarray
    other_part: np.ndarray
    other_id: np.ndarray
    vectors: np.ndarray


def partition_top_k(config: ConfigSchema, params: Dict[str, np.ndarray], tables: Any,
                    queries: _Queries, part: int, k: int, exclude: Sequence[str]
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """(scores float32 [Q, k'], offsets int64 [Q, k']) of each query's k best candidates
    in partition `part` of its type (k' = min(k, partition size); -inf where excluded).
    tables: what reads the partition (EmbeddingSource)."""
    with warnings.catch_warnings():  # arrays from Ray's object store: read-only, never written
        warnings.simplefilter("ignore", UserWarning)
        scorer = Scorer(config, params)
        q_all = torch.from_numpy(queries.vectors)
    table = torch.from_numpy(tables.read(queries.entity, part))
    vectors = scorer.entity_vectors(queries.entity, table)
    count = len(queries.relation)
    kk = min(k, len(table))
    scores = np.full((count, kk), -np.inf, np.float32)
    offsets = np.zeros((count, kk), np.int64)
    excluded = _excluded(queries, part, exclude, num_relation_ids(config) if exclude else 0)
    groups = ([(-1, np.arange(count))] if queries.side == "neighbors" else
              [(r, np.flatnonzero(queries.relation == r)) for r in np.unique(queries.relation)])
    for relation, rows in groups:
        if queries.side == "neighbors":
            cands = scorer.comparator.prepare(vectors)[0]
        else:
            cands = scorer.candidates(queries.side, int(relation), vectors)
        for start in range(0, len(rows), QUERY_BLOCK):
            block = rows[start:start + QUERY_BLOCK]
            s = scorer.matrix(q_all[torch.from_numpy(block)], cands)
            for i, row in enumerate(block):
                ids = excluded.get(int(row))
                if ids is not None:
                    s[i, torch.from_numpy(ids)] = -float("inf")
            if kk:
                top = torch.topk(s, kk, dim=1)
                scores[block], offsets[block] = top.values.numpy(), top.indices.numpy()
    return scores, offsets


def _excluded(queries: _Queries, part: int, exclude: Sequence[str], num_rel: int
              ) -> Dict[int, np.ndarray]:
    """query row -> candidate offsets in `part` left out: for neighbours the entity itself;
    else the rhs (lhs) entities of the known edges (other entity, relation, x) of the
    `exclude` edge paths."""
    if queries.side == "neighbors":
        return {int(r): queries.other_id[r:r + 1] for r in np.flatnonzero(queries.other_part == part)}
    found: Dict[int, List[np.ndarray]] = {}
    for other_part in np.unique(queries.other_part) if exclude else ():
        rows = np.flatnonzero(queries.other_part == other_part)
        bucket = (Bucket(int(other_part), part) if queries.side == "rhs"
                  else Bucket(part, int(other_part)))
        for path in exclude:
            known = KnownEdges(read_edges(path, bucket), num_rel)
            hit, ids = known.true_entities(queries.side, queries.other_id[rows], queries.rel_id[rows])
            for r, i in zip(rows[hit], ids):
                found.setdefault(int(r), []).append(np.array([i]))
    return {r: np.concatenate(ids) for r, ids in found.items()}


def partition_rows(tables: Any, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
    """float32 [len(offsets), D]: the given rows of one partition."""
    return tables.read(entity, part)[offsets]


def relation_by_name(config: ConfigSchema, relation_names: List[str], name: str
                     ) -> Tuple[int, int]:
    """(index into config.relations, relation id) of a relation by name, or the project's
    error naming the nearest ones."""
    if name not in relation_names:
        raise PbgRayError(f"unknown relation {name!r}{did_you_mean(name, relation_names)}. "
                          f"Relations: {', '.join(relation_names[:20])}"
                          f"{' ...' if len(relation_names) > 20 else ''}.")
    rel_id = relation_names.index(name)
    return (0 if config.dynamic_relations else rel_id), rel_id


class Predictor:
    """A checkpoint version (or a bundle's tag) with its entity and relation names."""

    def __init__(self, config: ConfigSchema, arrays: Dict[str, np.ndarray],
                 source: EmbeddingSource, where: str, run: Optional[MapPartitions] = None,
                 cache_partitions: int = 2) -> None:
        """arrays: the model's parameters by public name; source: where the entity
        partitions are; where: what it is, for messages; run: how per-partition work runs
        (None: in this process, keeping the `cache_partitions` partitions read last)."""
        check_rankable(config)
        self.config = config
        self.source = where
        num_rel = num_relation_ids(config)
        self.params = params_from_checkpoint(config, num_rel, arrays, None, where=where).arrays
        self.scorer = Scorer(config, self.params)
        self.relation_names = (load_relation_names(config.entity_path) if config.dynamic_relations
                               else [r.name for r in config.relations])
        self.embedding_source = source
        self.cache_partitions = cache_partitions
        self.use(run)
        self._names: "collections.OrderedDict[Tuple[str, int], Tuple[List[str], Dict[str, int]]]" = (
            collections.OrderedDict())

    def use(self, run: Optional[MapPartitions]) -> None:
        """Run per-partition work with `run` (None: in this process, with the cache)."""
        self.run = run or in_process
        self.tables = (_Cached(self.embedding_source, self.cache_partitions) if run is None
                       else self.embedding_source)

    @classmethod
    def load(cls, checkpoint_path: str, version: Optional[int] = None,
             entity_path: Optional[str] = None, tag: Optional[str] = None,
             run: Optional[MapPartitions] = None, cache_partitions: int = 2) -> "Predictor":
        """The checkpoint in checkpoint_path (its config.json says the rest), or a model
        bundle file (pbg_ray.checkpoints.bundle); version None: the newest; tag (bundles) None: the
        newest; entity_path: where the names are, if not where training found them; run,
        cache_partitions: see the constructor."""
        if bundle.is_bundle(checkpoint_path):
            if version is not None:
                raise PbgRayError(f"{checkpoint_path!r} is a model bundle: pick one of its tags "
                                  "(tag / --tag), not a version.")
            with bundle.load(checkpoint_path, tag) as model:
                config = model.config
                if entity_path is not None:
                    config = dataclasses.replace(config, entity_path=entity_path)
                return cls(config, model.model_arrays(), EmbeddingSource(str(checkpoint_path), tag=model.tag),
                           f"tag {model.tag!r} of {checkpoint_path!r}", run, cache_partitions)
        checkpoint = CheckpointManager(checkpoint_path)
        if checkpoint.path.is_file():
            raise PbgRayError(f"{str(checkpoint_path)!r} is a file, neither a checkpoint "
                              "directory nor a model bundle. Give the checkpoint_path that "
                              "training wrote (a directory) or an exported bundle (.zip).")
        config = dataclasses.replace(checkpoint.read_config(), checkpoint_path=str(checkpoint.path))
        if entity_path is not None:
            config = dataclasses.replace(config, entity_path=entity_path)
        checkpoint, version = checkpoint.locate(config, version, "version")
        return cls(config, checkpoint.read_model(version)[0],
                   EmbeddingSource(str(checkpoint.path), version),
                   f"version {version} of {str(checkpoint.path)!r}", run, cache_partitions)

    # --- names ------------------------------------------------------------

    def _partition_names(self, entity: str, part: int) -> Tuple[List[str], Dict[str, int]]:
        """(names, name -> offset) of one partition, kept among the partitions read last."""
        def read() -> Tuple[List[str], Dict[str, int]]:
            names = load_entity_names(self.config.entity_path, entity, part)
            return names, {n: i for i, n in enumerate(names)}
        return _lru(self._names, (entity, part), self.cache_partitions, read)

    def names(self, entity: str) -> List[List[str]]:
        """The names of an entity type, per partition (all of them: mind the table's size)."""
        return [self._partition_names(entity, p)[0]
                for p in range(self.config.entities[entity].num_partitions)]

    def find(self, entity: str, names: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """(partition, offset) int64 [len(names)] of entities by name, partition -1 where
        the type has no such name; one partition's names read at a time."""
        parts = np.full(len(names), -1, np.int64)
        offsets = np.zeros(len(names), np.int64)
        wanted = {n for n in names}
        for part in range(self.config.entities[entity].num_partitions):
            if not wanted:
                break
            index = self._partition_names(entity, part)[1]
            for i, name in enumerate(names):
                if parts[i] < 0 and name in index:
                    parts[i], offsets[i] = part, index[name]
                    wanted.discard(name)
        return parts, offsets

    def unknown_entity(self, entity: str, name: str) -> PbgRayError:
        """The error of a name that `entity` lacks, with the nearest names it has."""
        return PbgRayError(f"unknown {entity} entity {name!r}{self._suggest(entity, name)}.")

    def _locate(self, entity: str, names: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """find(), raising unknown_entity for the first name the type lacks."""
        parts, offsets = self.find(entity, names)
        if (parts < 0).any():
            raise self.unknown_entity(entity, names[int(np.argmax(parts < 0))])
        return parts, offsets

    def _suggest(self, entity: str, name: str) -> str:
        """did_you_mean over the type's names, one partition at a time."""
        for part in range(self.config.entities[entity].num_partitions):
            hint = did_you_mean(name, self._partition_names(entity, part)[0])
            if hint:
                return hint
        return ""

    def relation(self, name: str) -> Tuple[int, int]:
        """(index into config.relations, relation id) of a relation by name."""
        return relation_by_name(self.config, self.relation_names, name)

    def _vectors(self, entity: str, parts: np.ndarray, offsets: np.ndarray) -> Tensor:
        """Entity vectors [Q, D] of the given rows, each partition read once."""
        rows = np.empty((len(parts), self.config.entity_dimension(entity)), np.float32)
        used = np.unique(parts)
        jobs = [(self.tables, entity, int(p), offsets[parts == p]) for p in used]
        for part, values in zip(used, self.run(partition_rows, jobs)):
            rows[parts == part] = values
        return self.scorer.entity_vectors(entity, torch.from_numpy(rows))

    # --- queries ----------------------------------------------------------

    def score(self, triples: Union[Triple, Sequence[Triple]]) -> Union[float, np.ndarray]:
        """Scores float32 [T] of (lhs name, relation name, rhs name) triples; the score of
        one triple given alone."""
        if len(triples) == 3 and all(isinstance(name, str) for name in triples):
            return float(self.score([triples])[0])
        out = np.empty(len(triples), np.float32)
        relations = [self.relation(rel) for _, rel, _ in triples]
        for relation in sorted({r for r, _ in relations}):
            rows = [i for i, (r, _) in enumerate(relations) if r == relation]
            rconf = self.config.relations[relation]
            lhs = self._vectors(rconf.lhs, *self._locate(rconf.lhs, [triples[i][0] for i in rows]))
            rhs = self._vectors(rconf.rhs, *self._locate(rconf.rhs, [triples[i][2] for i in rows]))
            rel_ids = torch.tensor([relations[i][1] for i in rows])
            query = self.scorer.queries("rhs", relation, rel_ids, lhs)
            out[rows] = self.scorer.pos(query, self.scorer.candidates("rhs", relation, rhs)).numpy()
        return out

    def top_rhs(self, lhs: str, relation: str, k: int = 10, exclude: Sequence[str] = ()) -> Ranked:
        """The k best rhs entities for (lhs, relation); exclude: edge paths whose edges
        (lhs, relation, x) remove x from the answer."""
        return self.top_k("rhs", [(lhs, relation)], k, exclude)[0]

    def top_lhs(self, relation: str, rhs: str, k: int = 10, exclude: Sequence[str] = ()) -> Ranked:
        """The k best lhs entities for (relation, rhs); exclude as in top_rhs."""
        return self.top_k("lhs", [(rhs, relation)], k, exclude)[0]

    def top_k(self, side: str, queries: Sequence[Tuple[str, str]], k: int = 10,
              exclude: Sequence[str] = ()) -> List[Ranked]:
        """For each query (the other side's entity name, relation name), the k best
        entities of `side` ("lhs" or "rhs"); exclude as in top_rhs. The queries'
        candidates of each type are scored one partition at a time."""
        if side not in ("lhs", "rhs"):
            raise ValueError(f"side must be 'lhs' or 'rhs', not {side!r}")
        exclude = [exclude] if isinstance(exclude, str) else exclude
        other = "lhs" if side == "rhs" else "rhs"
        answers: List[Ranked] = [[] for _ in queries]
        resolved = [self.relation(rel) for _, rel in queries]
        by_type: Dict[Tuple[str, str], List[int]] = {}
        for i, (relation, _) in enumerate(resolved):
            rconf = self.config.relations[relation]
            by_type.setdefault((getattr(rconf, other), getattr(rconf, side)), []).append(i)
        for (other_entity, entity), rows in by_type.items():
            parts, offsets = self._locate(other_entity, [queries[i][0] for i in rows])
            vectors = self._vectors(other_entity, parts, offsets)
            relation = np.array([resolved[i][0] for i in rows], np.int64)
            rel_id = np.array([resolved[i][1] for i in rows], np.int64)
            prepared = torch.empty_like(vectors)
            for r in np.unique(relation):
                pick = torch.from_numpy(np.flatnonzero(relation == r))
                prepared[pick] = self.scorer.queries(side, int(r), torch.from_numpy(rel_id[pick.numpy()]),
                                                     vectors[pick])
            group = _Queries(side, entity, relation, rel_id, parts, offsets, prepared.numpy())
            for i, ranked in zip(rows, self._best(group, k, exclude)):
                answers[i] = ranked
        return answers

    def neighbors(self, name: str, entity_type: Optional[str] = None, k: int = 10) -> Ranked:
        """The k entities of the same type nearest to `name` by the comparator (itself left
        out); entity_type is needed only when the name exists in several types."""
        return self.neighbors_of([name], entity_type, k)[0]

    def neighbors_of(self, names: Sequence[str], entity_type: Optional[str] = None,
                     k: int = 10) -> List[Ranked]:
        """neighbors of each of `names` (all of one type)."""
        if not names:
            return []
        entity = entity_type or self._type_of(names[0])
        parts, offsets = self._locate(entity, names)
        vectors = self.scorer.comparator.prepare(self._vectors(entity, parts, offsets))[0]
        none = np.full(len(names), -1, np.int64)
        return self._best(_Queries("neighbors", entity, none, none, parts, offsets,
                                   vectors.numpy()), k, ())

    def _type_of(self, name: str) -> str:
        found = []
        for entity in self.config.entities:
            try:
                self._locate(entity, [name])
                found.append(entity)
            except PbgRayError:
                pass
        if len(found) != 1:
            hints = [self._suggest(entity, name) for entity in self.config.entities]
            raise PbgRayError(f"entity {name!r} " + (
                f"is in several types {found}; pass entity_type." if found
                else f"is unknown{next((h for h in hints if h), '')}."))
        return found[0]

    def _best(self, queries: _Queries, k: int, exclude: Sequence[str]) -> List[Ranked]:
        """Each query's k highest scores over every partition of its candidates' type, as
        (name, score), best first (ties: the lower partition and offset first), without
        excluded candidates."""
        entity = queries.entity
        nparts = self.config.entities[entity].num_partitions
        jobs = [(self.config, self.params, self.tables, queries, p, k, list(exclude))
                for p in range(nparts)]
        count = len(queries.relation)
        scores = np.full((count, 0), -np.inf, np.float32)
        where = np.zeros((count, 0, 2), np.int64)  # (partition, offset)
        for part, (s, offsets) in enumerate(self.run(partition_top_k, jobs)):
            scores = np.concatenate([scores, s], axis=1)
            where = np.concatenate([where, np.stack([np.full_like(offsets, part), offsets], 2)], 1)
            # Keep the k best so far: the merge holds k per query, not a partition's scores.
            order = np.lexsort((where[:, :, 1], where[:, :, 0], -scores), axis=1)[:, :k]
            scores = np.take_along_axis(scores, order, 1)
            where = np.take_along_axis(where, order[:, :, None], 1)
        kept = scores > -np.inf
        names = np.empty(scores.shape, object)
        for part in np.unique(where[:, :, 0][kept]):  # each partition's names read once
            pick = kept & (where[:, :, 0] == part)
            partition = self._partition_names(entity, int(part))[0]
            names[pick] = [partition[o] for o in where[:, :, 1][pick]]
        return [[(str(n), float(v)) for n, v in zip(names[row][kept[row]], scores[row][kept[row]])]
                for row in range(count)]
