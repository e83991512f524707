"""Faults injected into the real processes of a run (the driver, a partition store,
a store's file writes): nothing lost, nothing applied twice, nothing half-written
made current, and the same command finishes the run."""

import numpy as np
import pytest

from pbg_ray.checkpoints.storage import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.engine.trainer import Trainer
from pbg_ray.errors import PbgRayError
from tests.fault_injection import (
    Fault, driver_kill_trials, edges_lost_or_doubled, kill_actor, limit_file_size)
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph

SETTINGS = dict(eval_fraction=0.0, comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True)


def test_driver_killed_at_random_moments_resumes_and_finishes(ray_session, tmp_path):
    # Disk placement: a killed pass leaves swap files of its version beside the current one.
    # Enough epochs that the runs outlast their kills on a fast machine: the random kills
    # (at most 8 s in) and the kills after a write each take a share of them, and at 16 or
    # 48 the work was done before the last trials, which then found nothing to kill.
    num_epochs = 200
    data = config_dict(tmp_path, num_epochs=num_epochs, **SETTINGS,
                       ray={"cpus_per_trainer": 1, "placement": "disk"})
    write_random_graph(ConfigSchema.from_dict(data), num_edges=1000)
    out = driver_kill_trials(data, tmp_path, trials=10, seed=0, max_delay_s=8.0,
                             address=ray_session.get_runtime_context().gcs_address)
    counts = {k: out[k] for k in ("faults", "ended_before_kill", "during_write", "orphans")}
    assert out["corrupt"] == []
    assert out["faults"] >= 9 and out["faults"] + out["ended_before_kill"] == 10, counts
    assert out["during_write"] >= 3, counts  # every "write" trial, at least
    assert out["orphans"] == 0, "a killed driver's actors or tasks lived on"
    # A second run on the same checkpoint_path was refused while the first held it;
    # the lock of a killed run never blocked the next one.
    second = out["second_run"]
    assert second["first_alive"] and second["rc"] == 2, second
    assert "is in use by another training run" in second["log"]
    assert out["finished"], out["final_log"]
    assert out["summary"]["version"] == num_epochs
    assert out["lost_or_doubled"] == 0


def mean_loss(stats, epoch):
    return np.mean([s["stats"]["metrics"]["loss"] for s in stats if s["epoch_idx"] == epoch])


def test_a_killed_partition_store_comes_back_from_the_checkpoint(ray_session, tmp_path):
    def config(name, placement="memory"):
        return ConfigSchema.from_dict(config_dict(
            tmp_path, num_epochs=4, checkpoint_path=str(tmp_path / name), **SETTINGS,
            ray={"placement": placement, "num_partition_stores": 2}))

    write_random_graph(config("reference"), num_edges=2000)
    reference = Trainer(config("reference")).run()
    # One of the two stores dies in the third pass (the other one survives it); then
    # the parameter server, whose state the same rule restores.
    store, params = (lambda trainer: trainer.stores[0]), (lambda trainer: trainer.params)
    for name, placement, victim in (("store", "memory", store), ("store-disk", "disk", store),
                                    ("params", "memory", params)):
        killed = config(name, placement)
        storage = CheckpointStorage(killed.checkpoint_path)
        trainer = Trainer(killed)
        with Fault(lambda: kill_actor(victim(trainer)),
                   when=lambda: storage.load_version() >= 2) as fault:
            result = trainer.run()
        assert fault.done and result.actor_restarts == 1, name
        assert result.version == 4
        assert_valid_checkpoint(killed, 4)
        assert edges_lost_or_doubled(killed) == 0
        # The pass was trained again from version 2, so the loss stays in line.
        for epoch in range(4):
            assert mean_loss(result.bucket_stats, epoch) == pytest.approx(
                mean_loss(reference.bucket_stats, epoch), rel=0.01)


@pytest.mark.parametrize("placement", ["memory", "disk"])
def test_a_failing_checkpoint_write_leaves_the_last_version_current(ray_session, tmp_path,
                                                                     placement):
    config = ConfigSchema.from_dict(config_dict(tmp_path, num_epochs=2, **SETTINGS,
                                                ray={"placement": placement}))
    write_random_graph(config)
    storage = CheckpointStorage(config.checkpoint_path)
    trainer = Trainer(config)
    # Once version 1 is current, the stores can write no file past 1 KiB (as if the
    # disk were full): version 2's first embeddings file fails.
    with Fault(lambda: limit_file_size(trainer.stores, 1024),
               when=lambda: storage.load_version() >= 1) as fault:
        with pytest.raises(PbgRayError, match=r"writing '.*embeddings_\w+_\d\.v2\.h5' failed: "
                                              "File too large"):
            trainer.run()
    assert fault.done
    assert_valid_checkpoint(config, 1, clean=False)
    assert not list(storage.path.glob(".*tmp*")), "a partial file was left behind"
    # Written elsewhere (a fresh store), the same command finishes.
    assert Trainer(config).run().version == 2
    assert_valid_checkpoint(config, 2)
