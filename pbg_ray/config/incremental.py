"""The `incremental` section of the config: training a grown graph from init_path."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List

from pbg_ray.config.options import Bounds, one_of, option

NEW_ROWS_INITS = ("random", "neighbors")


@dataclass
class IncrementalConfig:
    """How a run that starts from init_path treats what init_path already trained.

    Rows of a partition beyond those init_path holds are new entities (appended by
    `importer.previous_entity_path`); relation ids beyond its model's are new relations.
    """

    new_rows_init: str = option("random", check=one_of(NEW_ROWS_INITS), help=
        'How new rows start: "random" (N(0, init_scale), as in a fresh run) or "neighbors": '
        "the mean of their already-trained neighbours' embeddings over edge_paths (random for "
        "a new entity without a known neighbour).")
    known_lr_scale: float = option(1.0, check=Bounds(
        "must be in [0, 1]", "Use 0 to freeze what init_path trained, e.g. 0.1 to move it "
        "slowly, 1 for no change.", low=0, high=1), help=
        "Learning-rate multiplier of what init_path trained: known entity rows and carried- "
        "over relation parameters. 0 freezes them (values and optimizer state stay bit- "
        "identical); new rows and new relations always train at lr / relation_lr.")
    new_entity_edges_only: bool = option(False, help=
        "Train only the edges with at least one new entity (a fast daily update of new "
        "edges).")

    def keys_needing_init_path(self) -> List[str]:
        """The keys set to something other than their default: they all need init_path."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
