"""Small shared types: sides of an edge, buckets, partitions, lists of edges."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

EntityName = str
Partition = int
SIDES = ("lhs", "rhs")  # an edge's sides, by their names in configs and edge files


class Side(enum.Enum):
    LHS = 0
    RHS = 1

    def pick(self, lhs: T, rhs: T) -> T:
        return lhs if self is Side.LHS else rhs


class Bucket(NamedTuple):
    """The edges whose lhs entities are in partition `lhs` and rhs in `rhs`."""

    lhs: Partition
    rhs: Partition

    def get_partition(self, side: Side) -> Partition:
        return side.pick(self.lhs, self.rhs)

    def __str__(self) -> str:
        return f"( {self.lhs} , {self.rhs} )"

@dataclasses.dataclass
class FeatureList:
    """Variable-length feature ids per edge: edge i has data[offsets[i]:offsets[i+1]].

    offsets: int64 [E + 1], starting at 0; data: int64 [F].
    """

    offsets: np.ndarray
    data: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index) -> "FeatureList":
        """A slice, or an int64 array of edge positions."""
        if isinstance(index, slice):
            start, stop, _ = index.indices(len(self))
            offsets = self.offsets[start:stop + 1]
            return FeatureList(offsets - offsets[0], self.data[offsets[0]:offsets[-1]])
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return FeatureList(offsets, self.data[gather])

@dataclasses.dataclass
class EdgeList:
    """A list of edges. lhs, rhs, rel: int64 [E]; weight: float32 [E] or None;
    lhs_features / rhs_features: FeatureList for featurized entity types."""

    lhs: np.ndarray
    rhs: np.ndarray
    rel: np.ndarray
    weight: Optional[np.ndarray] = None
    lhs_features: Optional[FeatureList] = None
    rhs_features: Optional[FeatureList] = None

    def __len__(self) -> int:
        return len(self.rel)

    def __getitem__(self, index) -> "EdgeList":
        """A slice, or an int64 array of edge positions."""
        return EdgeList(
            self.lhs[index], self.rhs[index], self.rel[index],
            None if self.weight is None else self.weight[index],
            None if self.lhs_features is None else self.lhs_features[index],
            None if self.rhs_features is None else self.rhs_features[index],
        )

    @staticmethod
    def cat(lists: Sequence["EdgeList"]) -> "EdgeList":
        def cat_features(side: str) -> Optional[FeatureList]:
            parts = [getattr(e, side) for e in lists]
            if all(p is None for p in parts):
                return None
            parts = [p if p is not None else FeatureList(np.zeros(len(e) + 1, np.int64),
                                                         np.empty(0, np.int64))
                     for p, e in zip(parts, lists)]
            starts = np.cumsum([0] + [len(p.data) for p in parts[:-1]])
            offsets = np.concatenate([parts[0].offsets[:1]]
                                     + [p.offsets[1:] + s for p, s in zip(parts, starts)])
            return FeatureList(offsets, np.concatenate([p.data for p in parts]))

        weights = [e.weight for e in lists]
        if any(w is not None for w in weights):
            weights = [np.ones(len(e), np.float32) if w is None else w for e, w in zip(lists, weights)]
            weight = np.concatenate(weights)
        else:
            weight = None
        return EdgeList(
            np.concatenate([e.lhs for e in lists]), np.concatenate([e.rhs for e in lists]),
            np.concatenate([e.rel for e in lists]), weight,
            cat_features("lhs_features"), cat_features("rhs_features"))
