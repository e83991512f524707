"""training_stats.json lines (per-edge means with counts, PBG's and pbg_ray's) into figures."""

import pytest

from pbg_ray.training.stats import HELD_OUT, TRAIN, bucket_means, epoch_means


def line(epoch, index, count, loss, mrr):
    return {"epoch_idx": epoch, "edge_path_idx": 0, "edge_chunk_idx": 0, "lhs_partition": 0,
            "rhs_partition": index % 2, "index": index,
            "stats": {"count": count, "metrics": {"loss": loss, "reg": 0.0}},
            HELD_OUT: {"count": count // 10, "metrics": {"mrr": mrr}}}


def test_bucket_and_epoch_means_are_per_edge():
    lines = [line(0, 0, 100, 2.0, 0.5), line(0, 1, 300, 1.0, 0.1), line(1, 2, 100, 0.5, 0.9)]
    assert bucket_means(lines, TRAIN) == [(0, {"loss": 2.0, "reg": 0.0}),
                                          (1, {"loss": 1.0, "reg": 0.0}),
                                          (2, {"loss": 0.5, "reg": 0.0})]
    epochs = epoch_means(lines, TRAIN)
    assert list(epochs) == [0, 1]
    assert epochs[0]["loss"] == pytest.approx((2.0 * 100 + 1.0 * 300) / 400)  # edge-weighted
    assert epoch_means(lines, HELD_OUT)[0]["mrr"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)


def test_lines_without_stats_are_left_out():
    lines = [line(0, 0, 100, 2.0, 0.5), {"epoch_idx": 0, "index": 1, "stats": {"count": 0, "metrics": {}}}]
    assert [i for i, _ in bucket_means(lines, TRAIN)] == [0]
    assert epoch_means([{"epoch_idx": 0, "index": 0}], HELD_OUT) == {}
