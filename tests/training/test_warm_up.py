"""PBG's Hogwild warm-up (hogwild_delay): in the first epoch, only the buckets that bring a
partition in are warmed up (training.warm_up.HogwildWarmUp), on a real local Ray."""

from typing import Any, Dict, List, Set

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.model.params import partition_keys
from pbg_ray.training.trainer import Trainer
from pbg_ray.training.warm_up import HogwildWarmUp
from pbg_ray.types import Bucket
from tests.fault_injection import armed
from tests.util import config_dict, write_random_graph

DELAY = 3600.0  # the waiting thread joins when the bucket's batches run out: no test waits


def one_type_config(tmp_path, **overrides: Any) -> ConfigSchema:
    """One entity type in 4 partitions, inside_out, one train task of 2 Hogwild threads
    at a time (the stats lines are in training order), 2 epochs of 2 edge chunks."""
    settings = dict(
        entities={"user": {"num_partitions": 4}},
        relations=[{"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"}],
        bucket_order="inside_out", num_epochs=2, num_edge_chunks=2, hogwild_delay=DELAY,
        ray={"num_trainers": 1, "cpus_per_trainer": 2})
    settings.update(overrides)
    return ConfigSchema.from_dict(config_dict(tmp_path, **settings))


def warmed_up(lines: List[Dict[str, Any]], epoch: int, chunk: int) -> List[Bucket]:
    """The buckets of one pass that were warmed up, in the order of the lines."""
    return [Bucket(l["lhs_partition"], l["rhs_partition"]) for l in lines
            if (l["epoch_idx"], l["edge_chunk_idx"]) == (epoch, chunk)
            and l["timing"]["warmup_s"] > 0]


def bringing_partitions_in(config: ConfigSchema, lines: List[Dict[str, Any]]) -> List[Bucket]:
    """The buckets of the lines (one trainer: in training order) that hold a partition no
    earlier line holds."""
    seen: Set = set()
    found = []
    for l in lines:
        bucket = Bucket(l["lhs_partition"], l["rhs_partition"])
        keys = set(partition_keys(config, bucket))
        if not keys <= seen:
            found.append(bucket)
        seen |= keys
    return found


def test_a_bucket_is_warmed_up_in_the_first_epoch_when_it_brings_a_partition_in(tmp_path):
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, edge_paths=[str(tmp_path / "a"), str(tmp_path / "b")], hogwild_delay=1.5))
    warm_up = HogwildWarmUp(config, num_chunks=2)  # the first epoch is passes 0 to 3
    first, second = [("user", 0), ("tag", 0)], [("user", 1), ("tag", 0)]
    assert warm_up.seconds(0, first) == 1.5
    assert warm_up.seconds(0, first) == 1.5  # launched, not trained yet: still new
    warm_up.trained(first)
    assert warm_up.seconds(0, first) == 0.0
    assert warm_up.seconds(3, second) == 1.5  # ("user", 1) is new
    assert warm_up.seconds(3, second, before=[("user", 1)]) == 0.0  # behind its trainer
    assert warm_up.seconds(4, second) == 0.0  # the second epoch: never
    assert HogwildWarmUp(config, num_chunks=2).seconds(3, first) == 1.5  # a new run's


@pytest.mark.parametrize("placement", ["memory", "disk"])
def test_only_the_buckets_bringing_a_partition_in_are_warmed_up(ray_session, tmp_path,
                                                                 placement):
    """Disk placement submits a trainer's next task behind its current one: a bucket
    trained behind the one that brought its partitions in is not warmed up either."""
    config = one_type_config(tmp_path, ray={"num_trainers": 1, "cpus_per_trainer": 2,
                                            "placement": placement})
    write_random_graph(config, num_edges=120)
    lines = Trainer(config).run().bucket_stats
    first_pass = [l for l in lines if (l["epoch_idx"], l["edge_chunk_idx"]) == (0, 0)]
    assert len(first_pass) == 16
    # inside_out: layer i (min(lhs, rhs) == i) brings partition i in with its first bucket.
    layer_starts = bringing_partitions_in(config, first_pass)
    assert [min(b) for b in layer_starts] == [3, 2, 1, 0]
    assert warmed_up(lines, 0, 0) == layer_starts
    assert {l["timing"]["warmup_s"] for l in first_pass} == {0.0, DELAY}
    # The first epoch's second chunk and the second epoch train trained partitions only.
    assert warmed_up(lines, 0, 1) == warmed_up(lines, 1, 0) == warmed_up(lines, 1, 1) == []
    # 4 of the 64 lines (PBG warms up the 32 of epoch 0).
    assert sum(l["timing"]["warmup_s"] > 0 for l in lines) == 4


def test_concurrent_trainers_warm_up_each_partition_once(ray_session, tmp_path):
    """Two trainers at once, two entity types partitioned and one not: every partition is
    in a bucket that was warmed up, and a bucket whose partitions another trained is not."""
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, num_epochs=1, bucket_order="random", hogwild_delay=DELAY,
        ray={"num_trainers": 2, "cpus_per_trainer": 1}))
    write_random_graph(config, num_edges=120)
    lines = Trainer(config).run().bucket_stats
    warm = warmed_up(lines, 0, 0)
    buckets = [Bucket(l, r) for l in range(2) for r in range(2)]
    keys = {key for b in buckets for key in partition_keys(config, b)}
    assert {key for b in warm for key in partition_keys(config, b)} == keys
    # Two buckets trained at once share no partition index: at most two bring any in, and
    # at least one of the four does not.
    assert 1 <= len(warm) <= 2


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize("point, hits", [("train_task.after_read", 1),
                                         ("partition_store.update", 2)])
def test_a_failure_leaves_the_partitions_it_brought_in_new(ray_session, tmp_path, point, hits):
    """The first bucket's trainer killed (the bucket goes out again), or a partition store
    killed adopting the second bucket's result (the pass is trained again from version 0,
    the partitions from their random start): the buckets trained again are warmed up as
    in an undisturbed run."""
    config = one_type_config(tmp_path, num_epochs=1, num_edge_chunks=1,
                             ray={"num_trainers": 1, "cpus_per_trainer": 2,
                                  "num_partition_stores": 2})
    write_random_graph(config, num_edges=120)
    with armed(point, hits) as fired:
        result = Trainer(config).run()
    assert fired()
    assert result.actor_restarts == (point == "partition_store.update")
    lines = result.bucket_stats
    assert len(lines) == 16
    assert warmed_up(lines, 0, 0) == bringing_partitions_in(config, lines)
    assert [min(b) for b in warmed_up(lines, 0, 0)] == [3, 2, 1, 0]
