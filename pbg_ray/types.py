"""Small shared types: sides of an edge, buckets, partitions."""

from __future__ import annotations

import enum
from typing import NamedTuple, TypeVar

T = TypeVar("T")

EntityName = str
Partition = int


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
