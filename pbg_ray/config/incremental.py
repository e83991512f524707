"""The `incremental` section of the config: training a grown graph from init_path."""

from __future__ import annotations

from dataclasses import dataclass

NEW_ROWS_INITS = ("random", "neighbors")


@dataclass
class IncrementalConfig:
    """How a run that starts from init_path treats what init_path already trained.

    Rows of a partition beyond those init_path holds are new entities (appended by
    `importer.previous_entity_path`); relation ids beyond its model's are new relations.
    """

    # How new rows start: "random" (N(0, init_scale), as in a fresh run) or "neighbors":
    # the mean of their already-trained neighbours' embeddings over edge_paths (random
    # for a new entity without a known neighbour).
    new_rows_init: str = "random"
    # Learning-rate multiplier of what init_path trained: known entity rows and carried-over
    # relation parameters. 0 freezes them (values and optimizer state stay bit-identical);
    # new rows and new relations always train at lr / relation_lr.
    known_lr_scale: float = 1.0
    # Train only the edges with at least one new entity (a fast daily update of new edges).
    new_entity_edges_only: bool = False
