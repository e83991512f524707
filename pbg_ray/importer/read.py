"""The read phase: each raw input's names become ids, its edges a spill file of id records.

An input is a file, a directory of shards or a glob, local or a URI (io/raw.py:
input_shards); its shards are read in name order. io/raw.py streams each as batches of
names (RawTable). Here every name gets
an id (name_index.NameIndex: one index per entity type, one of relation names; ids in
order of first appearance) and each edge is written as a compact (lhs, rhs, rel[,
weight]) record to a spill file, which the routing phase reads back into buckets. The
first input learns names; later inputs (valid/test) only look them up, and their edges
with names the first input never mentions are counted and left out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError, did_you_mean
from pbg_ray.importer.name_index import NameIndex
from pbg_ray.io.raw import MAX_EXAMPLES, RawBatch, RawTable, input_shards
from pbg_ray.runtime.budget import GIB

logger = logging.getLogger("pbg_ray")

RELATIONS = -1  # the name type of relation names; an entity type's: its place in EntityTypes.names


def spill_dtype(weighted: bool) -> np.dtype:
    """One edge of a spill file: entity ids within their types, relation id, weight."""
    fields = [("lhs", "<i8"), ("rhs", "<i8"), ("rel", "<i4")]
    return np.dtype(fields + [("weight", "<f4")] if weighted else fields)


@dataclasses.dataclass(frozen=True)
class EntityTypes:
    """The entity type of each side of each relation."""

    names: List[str]  # the types the relations use, in order of first mention
    lhs: np.ndarray  # int64 per relation id: index of its lhs type in `names`
    rhs: np.ndarray  # the same for the rhs
    dynamic: bool  # dynamic_relations: every relation id has relation 0's types

    @classmethod
    def of(cls, config: ConfigSchema) -> "EntityTypes":
        names = list(dict.fromkeys(t for r in config.relations for t in (r.lhs, r.rhs)))
        return cls(names, np.array([names.index(r.lhs) for r in config.relations], np.int64),
                   np.array([names.index(r.rhs) for r in config.relations], np.int64),
                   config.dynamic_relations)

    def of_edges(self, side: str, rel: np.ndarray) -> np.ndarray:
        """Index in `names` of the `side` entity type of edges with relation ids `rel`."""
        types = self.lhs if side == "lhs" else self.rhs
        return types[np.zeros(len(rel), np.int64) if self.dynamic else np.maximum(rel, 0)]


class IdReader:
    """Names -> ids for one import, and its inputs -> spill files."""

    def __init__(self, config: ConfigSchema,
                 shared: Optional[Callable[[int, str], Any]] = None) -> None:
        """`shared(name_type, what)`: the index of a name type (RELATIONS or an entity
        type's), with NameIndex's add and add_later, in place of a NameIndex of this
        process (the Ray engine's, whose names go to its dictionary shards)."""
        self.config = config
        self.settings = config.importer
        self.types = EntityTypes.of(config)
        make = shared or (lambda _, what: NameIndex(what))
        self.entity_index = {t: make(i, f"entity type {t!r}")
                             for i, t in enumerate(self.types.names)}
        # Relation names: learnt, with dynamic_relations; else the config's, found by
        # Arrow's hash lookup (a relation id is the name's place among them).
        self.relation_index = make(RELATIONS, "relation names") if config.dynamic_relations \
            else None
        self.relation_names = pa.array([r.name for r in config.relations], pa.string())
        self.spill_dtype = spill_dtype(self.settings.weight_col is not None)

    def relation_ids(self, batch: RawBatch, learn: bool,
                     counts: Optional[np.ndarray] = None) -> np.ndarray:
        """The relation id of each row (`learn`, with dynamic_relations: new names get new
        ids, each row counted as `counts` occurrences, default 1); -1 where unknown."""
        if batch.rel is None:
            return np.zeros(len(batch), np.int64)
        if self.relation_index is None:
            ids = pc.index_in(batch.rel, value_set=self.relation_names)
            return np.asarray(ids.fill_null(-1), np.int64)
        if learn:
            return self.relation_index.add(batch.rel, counts)
        return self.relation_index.lookup(batch.rel)

    def entity_ids(self, batch: RawBatch, rel: np.ndarray, learn: bool,
                   counts: Optional[np.ndarray] = None,
                   only: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> tuple:
        """(lhs ids, rhs ids), each within its own entity type; -1 where unseen (`learn`:
        new names get new ids, each row's names counted as `counts` occurrences, default 1).
        `only`: masks of the lhs and rhs names to name, the others -1 and not counted."""
        return self.entity_ids_later(batch, rel, learn, counts, only)()

    def entity_ids_later(self, batch: RawBatch, rel: np.ndarray, learn: bool,
                         counts: Optional[np.ndarray] = None,
                         only: Optional[Tuple[np.ndarray, np.ndarray]] = None
                         ) -> Callable[[], tuple]:
        """entity_ids as a call that gives them: the names go to their indexes now
        (`add_later`), the ids are gathered when it is called. The Ray engine's shared
        indexes name them meanwhile, while its read parses the next batch."""
        lhs_types, rhs_types = self.types.of_edges("lhs", rel), self.types.of_edges("rhs", rel)
        sent = []
        for t, name in enumerate(self.types.names):
            index = self.entity_index[name]
            lmask, rmask = lhs_types == t, rhs_types == t
            if only is not None:
                lmask, rmask = lmask & only[0], rmask & only[1]
            lhs = batch.lhs if lmask.all() else batch.lhs.filter(pa.array(lmask))
            rhs = batch.rhs if rmask.all() else batch.rhs.filter(pa.array(rmask))
            if not len(lhs) + len(rhs):
                continue
            both = pa.concat_arrays([lhs, rhs])
            ids = (index.add_later(both, None if counts is None
                                   else np.concatenate([counts[lmask], counts[rmask]]))
                   if learn else functools.partial(index.lookup, both))
            sent.append((lmask, rmask, len(lhs), ids))

        def gather() -> tuple:
            lhs_ids = np.full(len(batch), -1, np.int64)
            rhs_ids = np.full(len(batch), -1, np.int64)
            for lmask, rmask, lhs_count, ids in sent:
                got = ids()
                lhs_ids[lmask] = got[:lhs_count]
                rhs_ids[rmask] = got[lhs_count:]
            return lhs_ids, rhs_ids
        return gather

    def batches(self, table: RawTable, learn: bool) -> Iterator[Tuple[RawBatch, np.ndarray]]:
        """(batch, relation ids) of a raw table; rows naming a relation the config doesn't
        have are refused (skip_bad_rows: left out). With dynamic_relations and not `learn`,
        relations the index doesn't know have id -1."""
        for batch in table.batches():
            rel = self.relation_ids(batch, learn)
            if not self.config.dynamic_relations and (rel < 0).any():
                bad = rel < 0
                name = batch.rel[int(np.argmax(bad))].as_py()
                names = [r.name for r in self.config.relations]
                table.refuse(batch, bad, f"unknown relation name {name!r}"
                             f"{did_you_mean(name, names)}",
                             f"Relation names must be among the config's relations {names} "
                             "(or set dynamic_relations=true).")
                batch, rel = batch.take(~bad), rel[~bad]
            yield batch, rel

    def read(self, number: int, spill_path: Path,
             names_bytes: Optional[int] = None) -> Dict[str, Any]:
        """Input `number` (its shards in name order) into a spill file of id records (the
        first input learns names); returns its stats. Stops in one line where the name
        indexes outgrow `names_bytes` (the local engine's plan, importer/plan.py)."""
        spec = self.settings.inputs[number]
        learn = number == 0
        unseen = 0
        tables = []
        with open(spill_path, "wb") as spill, \
                tqdm(desc=f"import {spec}", unit=" edges", unit_scale=True, disable=None,
                     mininterval=1.0) as progress:
            for shard in input_shards(spec):
                tables.append(RawTable(shard.path, self.settings))
                for batch, rel in self.batches(tables[-1], learn):
                    lhs, rhs = self.entity_ids(batch, rel, learn)
                    known = (lhs >= 0) & (rhs >= 0) & (rel >= 0)
                    unseen += int(len(known) - known.sum())
                    records = np.empty(int(known.sum()), self.spill_dtype)
                    records["lhs"], records["rhs"], records["rel"] = (lhs[known], rhs[known],
                                                                      rel[known])
                    if "weight" in self.spill_dtype.names:
                        records["weight"] = batch.weight[known]
                    records.tofile(spill)
                    progress.update(len(batch))
                    if names_bytes is not None and learn:
                        self._check_names(names_bytes)
        return read_stats(spec, tables, None if learn else unseen, self.settings.inputs[0])

    def _check_names(self, names_bytes: int) -> None:
        indexes = [*self.entity_index.values(), *filter(None, [self.relation_index])]
        held = sum(index.nbytes() for index in indexes)
        if held > names_bytes:
            names = sum(len(index) for index in indexes)
            raise PbgRayError(
                f"the import's names outgrow the local engine's memory: {names:,} names hold "
                f"{held / GIB:.2f} GiB, over the {names_bytes / GIB:.2f} GiB its plan "
                "leaves them (docs/sizing.md, \"Import\"). Set importer.engine=ray: its "
                "dictionary shards spill names to disk; or give the import more memory.")


def read_stats(spec: str, tables: List[RawTable], unseen: Optional[int],
               first_input: str) -> Dict[str, Any]:
    """The stats of one input read as `tables` (its shards), with warnings for what was
    left out; `unseen`: edges of a later input naming what the first input never did."""
    examples = [e for t in tables for e in t.bad_examples][:MAX_EXAMPLES]
    stats = dict(input=spec, format="/".join(sorted({t.format for t in tables})),
                 shards=len(tables), rows=sum(t.num_rows for t in tables),
                 bad_rows=sum(t.bad_rows for t in tables), bad_row_examples=examples)
    if unseen is not None:
        stats["dropped_unseen"] = unseen
        if unseen:
            logger.warning("%s: %d edges name entities or relations the first input (%s) "
                           "never mentions; they are left out.", spec, unseen, first_input)
    if stats["bad_rows"]:
        logger.warning("%s: skipped %d bad rows, e.g. %s", spec, stats["bad_rows"],
                       "; ".join(examples))
    return stats
