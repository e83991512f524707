"""Where a pass sits in a run's loop, as PBG's IterationManager counts it: epochs, each
over the edge paths, each edge path in edge chunks; a checkpoint version is written after
every pass, so version N holds the first N passes (iterations 0 to N-1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator


@dataclass(frozen=True)
class Position:
    """One pass of a run: its epoch, edge path and edge chunk (0-based) out of how many."""

    epoch_idx: int
    edge_path_idx: int
    edge_chunk_idx: int
    num_epochs: int
    num_edge_paths: int
    num_edge_chunks: int

    @classmethod
    def of(cls, iteration: int, num_epochs: int, num_edge_paths: int,
           num_edge_chunks: int) -> "Position":
        """The position of pass `iteration` (0-based)."""
        epoch_idx, rest = divmod(iteration, num_edge_paths * num_edge_chunks)
        path_idx, chunk_idx = divmod(rest, num_edge_chunks)
        return cls(epoch_idx, path_idx, chunk_idx, num_epochs, num_edge_paths, num_edge_chunks)

    def at(self, iteration: int) -> "Position":
        """The position of pass `iteration` of the same run."""
        return Position.of(iteration, self.num_epochs, self.num_edge_paths, self.num_edge_chunks)

    @property
    def iteration(self) -> int:
        """The 0-based number of the pass in the run."""
        return ((self.epoch_idx * self.num_edge_paths + self.edge_path_idx)
                * self.num_edge_chunks + self.edge_chunk_idx)

    @property
    def num_passes(self) -> int:
        return self.num_epochs * self.num_edge_paths * self.num_edge_chunks

    @property
    def last_of_epoch(self) -> bool:
        return (self.edge_path_idx == self.num_edge_paths - 1
                and self.edge_chunk_idx == self.num_edge_chunks - 1)

    def passes(self) -> Iterator["Position"]:
        """This pass and those after it, to the run's end."""
        for iteration in range(self.iteration, self.num_passes):
            yield self.at(iteration)

    def of_stats_line(self, line: Dict[str, Any]) -> "Position":
        """The position of a training_stats.json line of the same run."""
        return Position(line["epoch_idx"], line["edge_path_idx"], line["edge_chunk_idx"],
                        self.num_epochs, self.num_edge_paths, self.num_edge_chunks)

    def stats_keys(self) -> Dict[str, int]:
        """Its keys in a training_stats.json line (PBG's)."""
        return {"epoch_idx": self.epoch_idx, "edge_path_idx": self.edge_path_idx,
                "edge_chunk_idx": self.edge_chunk_idx}

    def attributes(self) -> Dict[str, int]:
        """Its attributes in a checkpoint file's metadata (PBG's `iteration/...`)."""
        return {"iteration/num_epochs": self.num_epochs, "iteration/epoch_idx": self.epoch_idx,
                "iteration/num_edge_paths": self.num_edge_paths,
                "iteration/edge_path_idx": self.edge_path_idx,
                "iteration/num_edge_chunks": self.num_edge_chunks,
                "iteration/edge_chunk_idx": self.edge_chunk_idx}

    def __str__(self) -> str:
        return (f"epoch {self.epoch_idx + 1}/{self.num_epochs} path {self.edge_path_idx + 1}/"
                f"{self.num_edge_paths} chunk {self.edge_chunk_idx + 1}/{self.num_edge_chunks}")
