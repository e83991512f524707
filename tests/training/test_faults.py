"""Faults injected into the real processes of a run at named points of the engine
(pbg_ray.runtime.faults): the driver, a partition store, the parameter server, a store's
file writes. Nothing lost, nothing applied twice, nothing half-written made current, and
the same command finishes the run."""

import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.runtime.faults import EXIT_STATUS, FAULTS_DIR_ENV, FaultInjected, fault_point
from pbg_ray.training.trainer import Trainer
from tests.fault_injection import (
    PROCESSES_GONE_TIMEOUT_S, armed, driver_kill_trials, edges_lost_or_doubled, hits_per_pass,
    limit_file_size)
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph

pytestmark = pytest.mark.faults

SETTINGS = dict(eval_fraction=0.0, comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True)


def test_an_armed_point_fires_once_at_its_hit_or_from_it_on_and_only_where_armed():
    with armed("test.point", hits=2, action="raise") as fired:
        fault_point("test.point")
        fault_point("test.other")
        assert not fired()
        with pytest.raises(FaultInjected, match="at test.point"):
            fault_point("test.point")
        fault_point("test.point")  # fired, so disarmed
    assert fired() == 1
    with armed("test.point", hits=2, action="raise", repeat=True) as fired:
        fault_point("test.point")
        for _ in range(3):  # the 2nd hit and every one after
            with pytest.raises(FaultInjected):
                fault_point("test.point")
        assert fired() == 3
    fault_point("test.point")  # disarmed after the block
    reach = [sys.executable, "-c",
             "from pbg_ray.runtime.faults import fault_point; fault_point('test.point'); "
             "print('went on')"]
    unarmed = {k: v for k, v in os.environ.items() if k != FAULTS_DIR_ENV}
    for action, env, status in (("kill", os.environ, -signal.SIGKILL),
                                ("exit", os.environ, EXIT_STATUS), ("kill", unarmed, 0)):
        with armed("test.point", action=action):
            run = subprocess.run(reach, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == status, (action, run.stderr)
        assert ("went on" in run.stdout) == (status == 0)


@pytest.mark.slow  # several runs, each killed and resumed
def test_driver_killed_at_each_driver_point_resumes_and_finishes(ray_session, tmp_path):
    # Disk placement: a killed pass leaves swap files of its version beside the current one.
    # One trial per driver point, each killed within its first two passes, so every one
    # has a pass to die in.
    trials = 5
    num_epochs = 2 * trials + 2
    data = config_dict(tmp_path, num_epochs=num_epochs, **SETTINGS,
                       ray={"cpus_per_trainer": 1, "placement": "disk"})
    write_random_graph(ConfigSchema.from_dict(data), num_edges=1000)
    out = driver_kill_trials(data, tmp_path, trials=trials, seed=0,
                             address=ray_session.get_runtime_context().gcs_address)
    counts = {k: out[k] for k in ("faults", "ended_before_kill", "during_write", "points")}
    assert out["corrupt"] == []
    assert out["faults"] == trials, counts
    assert out["during_write"] >= 1, counts  # the driver.version_written trial, at least
    # Nothing of a killed driver's run lives on: its actors, tasks, nor processes.
    assert out["left_running"] == []
    # A run on a checkpoint_path that another process holds is refused; the lock of a
    # killed run never blocked the next one.
    second = out["second_run"]
    assert second["rc"] == 2, second
    assert "is in use by another training run" in second["log"]
    assert out["finished"], out["final_log"]
    assert out["summary"]["version"] == num_epochs
    assert out["lost_or_doubled"] == 0


def test_a_driver_failing_between_writing_a_version_and_naming_it_keeps_the_last(
        ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, num_epochs=2, **SETTINGS,
                                                ray={"placement": "disk"}))
    write_random_graph(config)
    with armed("driver.version_written", hits=2, action="raise") as fired:
        with pytest.raises(FaultInjected):
            Trainer(config).run()
    assert fired()
    assert_valid_checkpoint(config, 1)  # version 2's files and the swap files are gone
    assert Trainer(config).run().version == 2
    assert_valid_checkpoint(config, 2)
    assert edges_lost_or_doubled(config) == 0


def test_a_trainer_ends_its_actors_even_where_their_exit_would_hang(ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, num_epochs=1, **SETTINGS))
    write_random_graph(config)
    trainer = Trainer(config)
    trainer.run()

    def hang_the_exit(actor):
        # A thread that never ends: Python's exit waits for it, so an actor left to
        # Ray's exit for an actor whose handles are gone would never end (and, its
        # core worker shut down, never see its raylet die).
        import os
        import threading
        threading.Thread(target=threading.Event().wait).start()
        return os.getpid()

    processes = [psutil.Process(pid) for pid in ray_session.get(
        [actor.__ray_call__.remote(hang_the_exit) for actor in trainer.actors])]
    assert len(processes) == 3  # a partition store (one node), parameter server, scheduler
    del trainer
    _, alive = psutil.wait_procs(processes, timeout=PROCESSES_GONE_TIMEOUT_S)
    for process in alive:
        process.kill()
    assert alive == []


def mean_loss(stats, epoch):
    return np.mean([s["stats"]["metrics"]["loss"] for s in stats if s["epoch_idx"] == epoch])


@pytest.mark.slow  # several runs, each killed and resumed
def test_a_killed_actor_comes_back_from_the_checkpoint(ray_session, tmp_path):
    def config(name, placement="memory"):
        return ConfigSchema.from_dict(config_dict(
            tmp_path, num_epochs=4, checkpoint_path=str(tmp_path / name), **SETTINGS,
            ray={"placement": placement, "num_partition_stores": 2}))

    write_random_graph(config("reference"), num_edges=2000)
    reference = Trainer(config("reference")).run()
    # In the third pass: one of the two stores dies adopting a bucket's result, or writing
    # version 3 (the other one survives it); then the parameter server exits while adding
    # a bucket's change, and the same rule restores its state.
    for name, placement, point, action in (
            ("store", "memory", "partition_store.update", "kill"),
            ("store-disk", "disk", "partition_store.save", "kill"),
            ("params", "memory", "parameter_server.update", "exit")):
        killed = config(name, placement)
        with armed(point, hits=2 * hits_per_pass(killed, point) + 2, action=action) as fired:
            result = Trainer(killed).run()
        assert fired() and result.actor_restarts == 1, name
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
    limited = []

    def fill_the_disk(epoch_idx):
        # Once version 1 is current, the stores can write no file past 1 KiB (as if the
        # disk were full): version 2's first embeddings file fails.
        limited.extend(limit_file_size(trainer.stores, 1024))

    with pytest.raises(PbgRayError, match=r"writing '.*embeddings_\w+_\d\.v2\.h5' failed: "
                                          "File too large"):
        trainer.run(on_epoch_end=fill_the_disk)
    assert limited
    assert_valid_checkpoint(config, 1, clean=False)
    assert not list(storage.path.glob(".*tmp*")), "a partial file was left behind"
    # Written elsewhere (a fresh store), the same command finishes.
    assert Trainer(config).run().version == 2
    assert_valid_checkpoint(config, 2)
