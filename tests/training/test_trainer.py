"""The engine end to end on a real local Ray."""

import gc
import json
import random
import threading
import time
from typing import List, Set

import h5py
import numpy as np
import pytest
import ray

from pbg_ray.checkpoints.directory import CheckpointStorage, checkpoint_metadata
from pbg_ray.checkpoints.position import Position
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.training.scheduler import (
    bucket_order, partition_reads, partitions_to_keep, parts_by_next_use, reads_lower_bound)
from pbg_ray.training.trainer import Trainer
from pbg_ray.types import Bucket
from tests.fault_injection import (
    FAULTS_DIR, armed, checkpoint_arrays, edges_lost_or_doubled, fired, release)
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph


def small_config(tmp_path, **overrides) -> ConfigSchema:
    base = dict(num_epochs=2, eval_fraction=0.1, eval_num_batch_negs=10, eval_num_uniform_negs=10,
                comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True)
    base.update(overrides)
    return ConfigSchema.from_dict(config_dict(tmp_path, **base))


def test_train_writes_valid_checkpoints_and_resumes(ray_session, tmp_path):
    config = small_config(tmp_path, checkpoint_preservation_interval=1)
    write_random_graph(config, num_edges=300)
    result = Trainer(config).run()
    assert result.version == 2  # one pass per epoch (1 edge path, 1 chunk)
    assert_valid_checkpoint(config, 2)
    # PBG's JSON-lines stats: one line per bucket per pass, with eval before/after.
    lines = [json.loads(l) for l in open(tmp_path / "checkpoints" / "training_stats.json")]
    assert len(lines) == 2 * 4
    assert {(l["lhs_partition"], l["rhs_partition"]) for l in lines} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(l["stats"]["count"] > 0 and "mrr" in l["eval_stats_after"]["metrics"] for l in lines)
    # Per-edge means with their counts, as torchbiggraph writes them (sums would exceed 1).
    assert all(0 < l["eval_stats_after"]["metrics"]["mrr"] <= 1 for l in lines)
    assert (tmp_path / "checkpoints" / "epoch_1" / "model.v1.h5").is_file()
    before = CheckpointStorage(config.checkpoint_path).load_entity_partition(2, "user", 1)[0]

    # The same command with more epochs resumes at version 2 and trains one more pass.
    config3 = small_config(tmp_path, num_epochs=3)
    result = Trainer(config3).run()
    assert result.version == 3 and len(result.bucket_stats) == 4
    assert_valid_checkpoint(config3, 3)
    after = CheckpointStorage(config.checkpoint_path).load_entity_partition(3, "user", 1)[0]
    assert not np.array_equal(before, after)
    # Nothing left to do: no work, same version.
    assert Trainer(config3).run().version == 3


def test_resume_refuses_a_different_graph(ray_session, tmp_path):
    config = small_config(tmp_path, num_epochs=1)
    write_random_graph(config)
    Trainer(config).run()
    other = small_config(tmp_path, dimension=16)
    with pytest.raises(PbgRayError, match="'dimension' differs"):
        Trainer(other)


def test_disk_placement_trains_what_memory_placement_trains(ray_session, tmp_path):
    """One trainer of one thread makes a run deterministic, so a swap that lost or
    reordered an update shows as a difference from the run that kept everything in
    memory."""
    config = small_config(tmp_path, ray={"placement": "disk", "num_trainers": 1,
                                         "cpus_per_trainer": 1})
    write_random_graph(config, num_edges=1000)
    memory = small_config(tmp_path, checkpoint_path=str(tmp_path / "memory"),
                          ray={"placement": "memory", "num_trainers": 1, "cpus_per_trainer": 1})
    on_disk, in_memory = Trainer(config), Trainer(memory)
    assert on_disk.run().version == 2
    in_memory.run()
    # Left null, the buffer holds every partition: this machine has room for them. Each
    # run's files carry its own config, with the buffer it chose.
    assert on_disk.config.ray.partition_buffer == config.num_partitions()
    config, memory = on_disk.config, in_memory.config
    assert_valid_checkpoint(config, 2)
    expected, got = checkpoint_arrays(memory), checkpoint_arrays(config)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # Partition files written as swap files carry the checkpoint's attributes too.
    for storage, run in ((CheckpointStorage(config.checkpoint_path), config),
                         (CheckpointStorage(memory.checkpoint_path), memory)):
        for entity, part in (("user", 1), ("item", 0)):
            with h5py.File(storage.partition_file(2, entity, part), "r") as hf:
                attrs = dict(hf.attrs)
            assert attrs.pop("config/json") == json.dumps(run.to_dict())
            assert attrs == {"format_version": 1, **{k: v for k, v in checkpoint_metadata(
                run, Position.of(1, run.num_epochs, 1, 1)).items() if k != "config/json"}}


def written_back(plan: List[Bucket], buffer: int) -> List[int]:
    """Partition writes per bucket of one trainer's pass with a write-back buffer: each
    bucket writes those of its partitions that the buffer does not keep for the next
    one, as it ends; those it keeps are written once the buffer drops them, as a later
    bucket starts, or as the last one ends."""
    held: Set[int] = set()
    unwritten: Set[int] = set()
    writes = []
    for i, bucket in enumerate(plan):
        own = {bucket.lhs, bucket.rhs}
        upcoming = parts_by_next_use(plan[i + 1:])
        kept = partitions_to_keep(held, own, upcoming, buffer)
        count = len(unwritten - kept)
        held, unwritten = kept | own, unwritten & kept
        if i + 1 < len(plan):
            stays = partitions_to_keep(held, {plan[i + 1].lhs, plan[i + 1].rhs}, upcoming, buffer)
            count += len(own - stays)
            unwritten = (unwritten - own) | (own & stays)
        else:
            count += len(unwritten | own)
        writes.append(count)
    return writes


@pytest.mark.slow  # two passes of 16 buckets
def test_beta_order_reads_what_its_buffer_plan_reads(ray_session, tmp_path):
    """Disk placement with bucket_order=beta: every bucket line counts its partition reads
    and writes; a pass never reads fewer than BETA's lower bound, and a pass trained by
    one worker reads exactly what the scheduler's simulation of its buffer says
    (read-ahead and kept partitions included) and writes as its write-back plan says.
    (Ray may start a pass's next task in another worker process, even a new one, when
    the worker's lease comes back after the next task asked for one: the new worker reads
    what the old one held, and the old one writes it when the new one asks for it, or
    when its wait runs out, counted in the stats of its own next task.)"""
    config = small_config(
        tmp_path, entities={"user": {"num_partitions": 4}},
        relations=[{"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"}],
        bucket_order="beta", eval_fraction=0.0,
        ray={"placement": "disk", "num_trainers": 1, "cpus_per_trainer": 1,
             "partition_buffer": 3})
    write_random_graph(config, num_edges=800, counts={"user": 40})
    result = Trainer(config).run()
    assert result.version == 2
    assert_valid_checkpoint(config, 2)
    lines = [json.loads(l) for l in open(tmp_path / "checkpoints" / "training_stats.json")]
    for iteration in range(2):
        buckets = [l for l in lines if l["epoch_idx"] == iteration]
        reads = sum(l["partition_io"]["reads"] for l in buckets)
        plan = bucket_order("beta", 4, 4, random.Random(f"{config.seed}/{iteration}"), 3)
        assert [(l["lhs_partition"], l["rhs_partition"]) for l in buckets] == [tuple(b) for b in plan]
        assert reads >= reads_lower_bound(4, 3)
        if len({l["worker"]["pid"] for l in buckets}) == 1:
            assert reads == partition_reads(plan, 3)
            # Write-back: a partition trained since it was read is written once the
            # buffer drops it, or at the end of the pass; until then the worker's next
            # tasks train it on unwritten. A task that came later than HAND_OVER_WAIT_S
            # (a loaded machine) found its partition written at the wait's end too.
            writes = [l["partition_io"]["writes"] for l in buckets]
            late = [l["partition_io"]["late_writes"] for l in buckets]
            if any(late):
                assert sum(writes) == sum(written_back(plan, 3)) + sum(late)
            else:
                assert writes == written_back(plan, 3)
                assert sum(writes) < sum(len({b.lhs, b.rhs}) for b in plan)


def test_init_path_starts_from_given_embeddings(ray_session, tmp_path):
    first = small_config(tmp_path, num_epochs=1)
    write_random_graph(first)
    Trainer(first).run()
    # lr=0 trains without moving anything: the result is the initial values.
    second = small_config(tmp_path, num_epochs=1, lr=0.0, checkpoint_path=str(tmp_path / "second"),
                          init_path=first.checkpoint_path)
    Trainer(second).run()
    a = CheckpointStorage(first.checkpoint_path).load_entity_partition(1, "item", 0)[0]
    b = CheckpointStorage(second.checkpoint_path).load_entity_partition(1, "item", 0)[0]
    np.testing.assert_array_equal(a, b)


def test_an_init_path_of_another_model_stops_the_run_with_its_file_named(ray_session, tmp_path):
    first = small_config(tmp_path, num_epochs=1)
    write_random_graph(first)
    Trainer(first).run()
    data = config_dict(tmp_path, num_epochs=1, checkpoint_path=str(tmp_path / "second"),
                       init_path=first.checkpoint_path)
    data["relations"][0]["operator"] = "linear"  # was translation
    trainer = Trainer(ConfigSchema.from_dict(data))
    with pytest.raises(PbgRayError, match=r"model\.v1\.h5: checkpoint parameter "
                                          r"'relations/0/operator/rhs/translation' does not belong"):
        trainer.run()
    assert trainer.actor_restarts == 0  # a bad file is not a dead actor: no retries
    assert CheckpointStorage(data["checkpoint_path"]).load_version() == 0


def test_bad_edges_stop_the_run_with_the_file_named(ray_session, tmp_path):
    config = small_config(tmp_path, num_epochs=1)
    write_random_graph(config, counts={"user": 30, "item": 20, "tag": 7})
    (tmp_path / "entities" / "entity_count_item_0.txt").write_text("3\n")  # too small now
    with pytest.raises(PbgRayError, match=r"edges_\d_\d.h5.*outside partition 0 of entity type 'item'"):
        Trainer(config).run()
    assert CheckpointStorage(config.checkpoint_path).load_version() == 0
    # A run that fails before its first version leaves no config.json behind.
    assert not (tmp_path / "checkpoints" / "config.json").exists()


def test_train_tasks_at_once_are_bounded_by_the_partitions_and_take_the_cpus(
        ray_session, tmp_path, caplog, capsys):
    """An unpartitioned graph trains one bucket a pass: one train task (and one worker
    started for it), however many CPUs. With ray.cpus_per_trainer null (the default) it
    takes them all, and says so first; set to fewer, the CPUs it leaves idle are pointed
    out with the key and value that would use them."""
    one = {"user": {"num_partitions": 1}, "item": {"num_partitions": 1},
           "tag": {"num_partitions": 1}}
    unpartitioned = small_config(tmp_path, entities=one, num_epochs=1)
    write_random_graph(unpartitioned, num_edges=100)
    cpus = int(ray.cluster_resources()["CPU"])
    assert cpus >= 2  # the session's local Ray
    trainer = Trainer(unpartitioned)
    assert trainer.max_trainers() == 1
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="pbg_ray"):
        assert trainer.run().version == 1
    assert caplog.text == "" and trainer.config.ray.cpus_per_trainer == cpus
    assert capsys.readouterr().err.splitlines()[0] == (
        f"training 1 bucket(s) at a time (1 partition(s)), each on {cpus} CPUs ({cpus} "
        f"Hogwild threads): ray.cpus_per_trainer=null shares out the {cpus} CPUs there are")
    narrow = Trainer(small_config(tmp_path, entities=one, ray={"cpus_per_trainer": 1.0}))
    with caplog.at_level("WARNING", logger="pbg_ray"):
        narrow.take_cpus()
    assert f"ray.cpus_per_trainer={cpus} (or null) " in caplog.text
    assert narrow.config.ray.cpus_per_trainer == 1
    # Partitioned: the CPUs bound them (a CPU each here); ray.num_trainers is taken as it is.
    partitioned = small_config(tmp_path / "partitioned")
    write_random_graph(partitioned, num_edges=100)
    spread = Trainer(partitioned)
    assert spread.max_trainers() == min(cpus, 2)
    spread.take_cpus()
    assert spread.config.ray.cpus_per_trainer == cpus // min(cpus, 2)
    assert Trainer(small_config(tmp_path, entities=one, ray={"num_trainers": 2})).max_trainers() == 2


@pytest.mark.faults
@pytest.mark.slow
def test_a_killed_trainer_is_handed_out_again(ray_session, tmp_path, monkeypatch):
    """A train task's worker SIGKILLed mid-bucket (having read its partitions; or in disk
    placement having trained, or while writing a swap file behind its task, which may
    have returned: then the pass is trained again): the bucket is trained again, and the
    checkpoint equals an undisturbed run's bit for bit (one trainer of one thread at a
    time makes a run deterministic; disk placement trains what memory placement trains), so no update
    was lost or applied twice. The death is handled: Ray logs none of its returns as an
    unhandled error."""
    settings = dict(num_epochs=2, eval_fraction=0.0)
    undisturbed = small_config(tmp_path, checkpoint_path=str(tmp_path / "undisturbed"),
                               ray={"num_trainers": 1, "cpus_per_trainer": 1}, **settings)
    write_random_graph(undisturbed, num_edges=3000)
    Trainer(undisturbed).run()
    expected = checkpoint_arrays(undisturbed)
    unhandled = []  # what Ray would log as "Unhandled error"
    monkeypatch.setattr(ray._private.worker, "_unhandled_error_handler", unhandled.append)
    # The third bucket of the first pass; the second of the second pass.
    for point, hits, placement in (("train_task.after_read", 3, "memory"),
                                   ("train_task.before_return", 6, "disk"),
                                   ("train_task.write_behind", 6, "disk")):
        config = small_config(tmp_path, checkpoint_path=str(tmp_path / point),
                              ray={"num_trainers": 1, "cpus_per_trainer": 1,
                                   "placement": placement}, **settings)
        with armed(point, hits) as fired:
            result = Trainer(config).run()
        assert fired(), point
        assert result.version == 2
        gc.collect()  # the refs of the run are gone
        assert not unhandled, (point, unhandled)
        assert_valid_checkpoint(config, 2)
        # Each bucket trained exactly once per pass in the recorded stats, all its edges
        # counted.
        assert edges_lost_or_doubled(config) == 0
        got = checkpoint_arrays(config)
        assert expected.keys() == got.keys()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{point}: {name}")


@pytest.mark.faults
def test_a_trainers_next_task_starts_before_the_driver_takes_the_current_results(
        ray_session, tmp_path):
    """Disk placement: the next bucket's task is submitted while the current one trains,
    behind it, so it starts as the current one ends, before the driver has looked at the
    current one's results: with the driver held where it takes the first bucket's results
    (driver.before_apply), the second bucket's task reaches train_task.after_read (armed
    to count its hits, never to fire). The pass then trains every bucket once."""
    config = small_config(tmp_path, num_epochs=1, ray={"placement": "disk", "num_trainers": 1})
    write_random_graph(config, num_edges=400)
    second_read = FAULTS_DIR / "train_task.after_read.hit-2"
    seen = []

    def release_when_the_second_task_has_read() -> None:
        while not fired("driver.before_apply"):
            time.sleep(0.01)
        deadline = time.monotonic() + 120  # a hang guard: without the overlap it never comes
        while not second_read.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(second_read.exists())
        release("driver.before_apply")

    with armed("driver.before_apply", action="hold"), armed("train_task.after_read", 10**6):
        thread = threading.Thread(target=release_when_the_second_task_has_read, daemon=True)
        thread.start()
        result = Trainer(config).run()
        thread.join()
    assert seen == [True]
    assert result.version == 1
    assert edges_lost_or_doubled(config) == 0


def test_second_run_on_the_same_checkpoint_path_is_refused(ray_session, tmp_path):
    config = small_config(tmp_path, num_epochs=1)
    write_random_graph(config)
    with CheckpointStorage(config.checkpoint_path).lock():
        with pytest.raises(PbgRayError, match="in use by another training run"):
            Trainer(config).run()
    assert Trainer(config).run().version == 1  # the lock went with its holder


def test_resume_cleans_what_an_interrupted_run_left(ray_session, tmp_path):
    config = small_config(tmp_path, num_epochs=1)
    write_random_graph(config)
    Trainer(config).run()
    ckpt = tmp_path / "checkpoints"
    # An interrupted pass 2: part of version 2, a temporary file, its stats line.
    (ckpt / "embeddings_user_0.v2.h5").write_bytes((ckpt / "embeddings_user_0.v1.h5").read_bytes())
    (ckpt / ".model.v2.h5.tmp-999").write_bytes(b"partial")
    with open(ckpt / "training_stats.json", "a") as f:
        f.write(json.dumps({"epoch_idx": 1, "edge_path_idx": 0, "edge_chunk_idx": 0}) + "\n")
    result = Trainer(small_config(tmp_path, num_epochs=2)).run()
    assert result.version == 2
    lines = [json.loads(l) for l in open(ckpt / "training_stats.json")]
    assert [l["epoch_idx"] for l in lines] == [0] * 4 + [1] * 4
    assert [l["index"] for l in lines] == list(range(8))
    assert not list(ckpt.glob(".*tmp*")) and not list(ckpt.glob("*.v1.h5"))


def test_nan_loss_stops_naming_epoch_and_bucket(ray_session, tmp_path):
    config = small_config(tmp_path, num_epochs=1)
    write_random_graph(config)
    Trainer(config).run()
    storage = CheckpointStorage(config.checkpoint_path)
    embs, state = storage.load_entity_partition(1, "user", 0)
    storage.save_entity_partition(1, "user", 0, np.full_like(embs, np.nan), state)
    with pytest.raises(PbgRayError, match=r"loss is nan in epoch 2/2, bucket \(0, \d\)"):
        Trainer(small_config(tmp_path, num_epochs=2)).run()
    assert storage.load_version() == 1
    storage.check_version(1, config)
