"""Position counts passes as PBG's IterationManager does: epochs, each over the edge
paths, each in edge chunks."""

import pytest

from pbg_ray.checkpoints.position import Position


def test_every_iteration_has_one_position_in_pbgs_order():
    start = Position.of(0, num_epochs=2, num_edge_paths=3, num_edge_chunks=2)
    seen = [(p.epoch_idx, p.edge_path_idx, p.edge_chunk_idx) for p in start.passes()]
    assert seen == [(e, p, c) for e in range(2) for p in range(3) for c in range(2)]
    assert [p.iteration for p in start.passes()] == list(range(12))
    assert [p.last_of_epoch for p in start.passes()].count(True) == 2
    assert start.at(7) == Position(1, 0, 1, 2, 3, 2)
    assert str(start.at(7)) == "epoch 2/2 path 1/3 chunk 2/2"


def test_a_resumed_run_trains_the_passes_after_its_version():
    assert [p.iteration for p in Position.of(5, 2, 1, 3).passes()] == [5]


@pytest.mark.parametrize("iteration", [0, 3, 5])
def test_a_stats_line_and_the_checkpoint_attributes_name_the_position(iteration):
    position = Position.of(iteration, 3, 1, 2)
    assert position.of_stats_line(position.stats_keys()) == position
    attributes = position.attributes()
    assert (attributes["iteration/epoch_idx"], attributes["iteration/edge_chunk_idx"]) == (
        position.epoch_idx, position.edge_chunk_idx)
    assert set(attributes) == {f"iteration/{k}" for k in (
        "num_epochs", "epoch_idx", "num_edge_paths", "edge_path_idx", "num_edge_chunks",
        "edge_chunk_idx")}
