"""Use a trained checkpoint by names: score edges, top-k tails or heads, nearest neighbours.

    from pbg_ray import Predictor
    model = Predictor.load("model/checkpoints")          # the newest version
    model = Predictor.load("export/bundle.zip", tag="v10-int8")  # or a model bundle's tag
    model.score([("alice", "follows", "bob")])            # -> float32 [1]
    model.top_rhs("alice", "follows", k=10, exclude=["data/edges/train"])
    model.top_lhs("follows", "bob", k=10)
    model.neighbors("alice", k=10)
    model.top_k("rhs", [("alice", "follows"), ("bob", "likes")], k=10)   # many queries at once

Questions are resolved and answered by pbg_ray.evaluation.questions, as the predict command
and the service answer them. Scores are the model's (pbg_ray.evaluation.scoring): `score` and `top_rhs` rank by the rhs
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

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from pbg_ray.checkpoints import bundle
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.per_partition import MapPartitions, in_process
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.entity_names import EntityNames, Located, Recent
from pbg_ray.evaluation.filtered import KnownEdges
from pbg_ray.evaluation.questions import (
    Answer, Best, Exclusion, ModelByNames, NeighborQuery, Ranked, Triple, by_key,
    edge_scores, exact_top_k, first_error, left_out, neighbor_queries, prepared_queries)
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.edges import read_edges
from pbg_ray.io.entities import num_relation_ids


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

    def read_rows(self, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        """float32 [len(offsets), D]: the given rows of an entity partition; a checkpoint's
        are read alone, not with the rest of the partition."""
        if self.tag is not None:
            return self.read(entity, part)[offsets]
        return CheckpointManager(self.path).read_partition_rows(self.version, entity, part, offsets)


class _Cached:
    """An EmbeddingSource keeping the `size` partitions read last."""

    def __init__(self, source: EmbeddingSource, size: int) -> None:
        self.source = source
        self._kept = Recent(size)

    def read(self, entity: str, part: int) -> np.ndarray:
        return self._kept.get((entity, part), lambda: self.source.read(entity, part))

    def read_rows(self, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
        if (entity, part) in self._kept:
            return self._kept[entity, part][offsets]
        return self.source.read_rows(entity, part, offsets)


@dataclasses.dataclass(frozen=True)
class PartitionQueries:
    """Prepared queries [Q, D] against every partition of one candidate type: per query the
    relation (index into config.relations; -1 for neighbours), the known edges left out, and
    for neighbours each query's own entity (partition, offset) [Q, 2], left out too."""

    side: str  # the side ranked ("lhs", "rhs"), "neighbors" for same-type neighbours
    entity: str  # the candidates' type
    relations: np.ndarray
    vectors: np.ndarray
    exclusion: Optional[Exclusion] = None
    own: Optional[np.ndarray] = None


def partition_top_k(config: ConfigSchema, params: Dict[str, np.ndarray], tables: Any,
                    queries: PartitionQueries, part: int, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """exact_top_k's (scores, offsets) [Q, min(k, partition size)] of each query in
    partition `part` of its candidates' type. tables: what reads the partition
    (EmbeddingSource)."""
    with warnings.catch_warnings():  # arrays from Ray's object store: read-only, never written
        warnings.simplefilter("ignore", UserWarning)
        scorer = Scorer(config, params)
        q_all = torch.from_numpy(queries.vectors)
    vectors = scorer.entity_vectors(queries.entity, torch.from_numpy(
        tables.read(queries.entity, part)))
    num_rel = num_relation_ids(config) if queries.exclusion is not None else 0
    banned = left_out(lambda path, bucket: KnownEdges(read_edges(path, bucket), num_rel), part,
                      len(q_all), queries.exclusion, queries.own)
    kk = min(k, len(vectors))
    scores = np.full((len(q_all), kk), -np.inf, np.float32)
    offsets = np.full((len(q_all), kk), -1, np.int64)
    # The queries of every relation whose candidates are the relation-free ones are scored
    # together against one prepared set; a relation-specific set is prepared for its own.
    sets = np.array([int(r) if queries.side != "neighbors"
                     and scorer.relation_specific(queries.side, int(r)) else -1
                     for r in queries.relations], np.int64)
    for relation in np.unique(sets):
        rows = np.flatnonzero(sets == relation)
        cands = (scorer.comparator.prepare(vectors)[0] if relation < 0
                 else scorer.candidates(queries.side, int(relation), vectors))
        scores[rows], offsets[rows] = exact_top_k(
            scorer, q_all[torch.from_numpy(rows)], cands, k, [banned[i] for i in rows])
    return scores, offsets


def partition_rows(tables: Any, entity: str, part: int, offsets: np.ndarray) -> np.ndarray:
    """float32 [len(offsets), D]: the given rows of one partition."""
    return tables.read_rows(entity, part, offsets)


class Predictor(ModelByNames):
    """A checkpoint version (or a bundle's tag) with its entity and relation names."""

    def __init__(self, config: ConfigSchema, arrays: Dict[str, np.ndarray],
                 source: EmbeddingSource, where: str, run: Optional[MapPartitions] = None,
                 cache_partitions: int = 2) -> None:
        """arrays: the model's parameters by public name; source: where the entity
        partitions are; where: what it is, for messages; run: how per-partition work runs
        (None: in this process, keeping the `cache_partitions` partitions read last, as
        their names are kept)."""
        super().__init__(config, arrays, where, EntityNames(config, keep=cache_partitions))
        self.embedding_source = source
        self.cache_partitions = cache_partitions
        self.use(run)

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
        bundle file (pbg_ray.checkpoints.bundle); version None: the best on validation
        (best/) where training kept one, else the newest; tag (bundles) None: the newest;
        entity_path: where the names are, if not where training found them; run,
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

    def names(self, entity: str) -> List[List[str]]:
        """The names of an entity type, per partition (all of them: mind the table's size)."""
        return self.entity_names.names(entity)

    def _vectors(self, entity: str, rows: Sequence[Located]) -> Tensor:
        """Entity vectors [Q, D] of (partition, offset) rows, each partition read once."""
        parts = np.array([p for p, _ in rows], np.int64)
        offsets = np.array([o for _, o in rows], np.int64)
        out = np.empty((len(rows), self.config.entity_dimension(entity)), np.float32)
        used = np.unique(parts)
        jobs = [(self.tables, entity, int(p), offsets[parts == p]) for p in used]
        for part, values in zip(used, self.run(partition_rows, jobs)):
            out[parts == part] = values
        return self.scorer.entity_vectors(entity, torch.from_numpy(out))

    # --- questions --------------------------------------------------------

    def score(self, triples: Union[Triple, Sequence[Triple]]) -> Union[float, np.ndarray]:
        """Scores float32 [T] of (lhs name, relation name, rhs name) triples; the score of
        one triple given alone."""
        if len(triples) == 3 and all(isinstance(name, str) for name in triples):
            return float(self.score([triples])[0])
        return np.array(first_error(self.score_each(triples)), np.float32)

    def score_each(self, triples: Sequence[Triple]) -> List[Answer]:
        """Each triple's score, or the error of a triple naming what the model lacks."""
        answers: List[Answer] = list(self.questions.edges(triples))
        for relation, idx in by_key(answers, lambda q: q.relation):
            edges = [answers[i] for i in idx]
            rconf = self.config.relations[relation]
            scores = edge_scores(self.scorer, relation, torch.tensor([q.rel_id for q in edges]),
                                 self._vectors(rconf.lhs, [q.lhs for q in edges]),
                                 self._vectors(rconf.rhs, [q.rhs for q in edges]))
            for i, value in zip(idx, scores.tolist()):
                answers[i] = value
        return answers

    def top_rhs(self, lhs: str, relation: str, k: int = 10, exclude: Sequence[str] = ()) -> Ranked:
        """The k best rhs entities for (lhs, relation), as Hit(name, score), best first;
        exclude: edge paths whose edges (lhs, relation, x) remove x from the answer."""
        return self.top_k("rhs", [(lhs, relation)], k, exclude)[0]

    def top_lhs(self, relation: str, rhs: str, k: int = 10, exclude: Sequence[str] = ()) -> Ranked:
        """The k best lhs entities for (relation, rhs); exclude as in top_rhs."""
        return self.top_k("lhs", [(rhs, relation)], k, exclude)[0]

    def top_k(self, side: str, queries: Sequence[Tuple[str, str]], k: int = 10,
              exclude: Union[str, Sequence[str]] = ()) -> List[Ranked]:
        """For each query (the other side's entity name, relation name), the k best
        entities of `side` ("lhs" or "rhs"); exclude as in top_rhs (one path or several)."""
        return first_error(self.top_k_each(side, queries, k, exclude))

    def top_k_each(self, side: str, queries: Sequence[Tuple[str, str]], k: int = 10,
                   exclude: Union[str, Sequence[str]] = ()) -> List[Answer]:
        """top_k's answer of each query, or the error of a query naming what the model
        lacks. The candidates of each type are scored one partition at a time."""
        paths = (exclude,) if isinstance(exclude, str) else tuple(exclude)
        answers: List[Answer] = list(self.questions.top(side, queries))
        by_types = lambda q: (q.other_entity, getattr(self.config.relations[q.relation], side))
        for (other_entity, entity), idx in by_key(answers, by_types):
            group = [answers[i] for i in idx]
            relations = np.array([q.relation for q in group], np.int64)
            rel_ids = np.array([q.rel_id for q in group], np.int64)
            vectors = prepared_queries(self.scorer, side, relations, rel_ids,
                                       self._vectors(other_entity, [q.other for q in group]))
            rows = np.array([q.other for q in group], np.int64)
            exclusion = Exclusion(paths, side, rows[:, 0], rows[:, 1], rel_ids) if paths else None
            found = self._best(PartitionQueries(side, entity, relations, vectors.numpy(),
                                                exclusion), k)
            for i, ranked in zip(idx, found):
                answers[i] = ranked
        return answers

    def neighbors(self, entity: str, entity_type: Optional[str] = None, k: int = 10) -> Ranked:
        """The k entities of the same type nearest to `entity` (a name) by the comparator
        (itself left out), as Hit(name, score), best first; entity_type is needed only when
        the name exists in several types."""
        return self.neighbors_of([entity], entity_type, k)[0]

    def neighbors_of(self, entities: Sequence[str], entity_type: Optional[str] = None,
                     k: int = 10) -> List[Ranked]:
        """neighbors of each of `entities` (names)."""
        return first_error(self.neighbors_each([NeighborQuery(e, entity_type)
                                                for e in entities], k))

    def neighbors_each(self, queries: Sequence[NeighborQuery], k: int = 10) -> List[Answer]:
        """The k entities nearest to each query's entity (itself left out) or vector, or the
        error of a query wrong on its own."""
        answers: List[Answer] = list(self.questions.neighbors(queries))
        for entity, idx in by_key(answers, lambda q: q.entity):
            group = [answers[i] for i in idx]
            by_name = [q.row for q in group if q.row is not None]
            prepared, own = neighbor_queries(self.scorer, entity, group,
                                             self._vectors(entity, by_name) if by_name else None)
            found = self._best(PartitionQueries("neighbors", entity, np.full(len(group), -1),
                                                prepared, own=own), k)
            for i, ranked in zip(idx, found):
                answers[i] = ranked
        return answers

    def _best(self, queries: PartitionQueries, k: int) -> List[Ranked]:
        """Each query's k best over every partition of its candidates' type (Best)."""
        parts = range(self.config.entities[queries.entity].num_partitions)
        jobs = [(self.config, self.params, self.tables, queries, p, k) for p in parts]
        best = Best.none(len(queries.relations))
        for part, (scores, offsets) in zip(parts, self.run(partition_top_k, jobs)):
            best = best.merge([(part, scores, offsets)], k)
        return best.ranked(self.entity_names, queries.entity)
