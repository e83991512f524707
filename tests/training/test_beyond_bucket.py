"""Negatives from beyond the bucket on a real local Ray: a bucket's task gets rows of every
partition of its types (read-only copies), in disk placement less those a task in flight
took over from the one before it (their newest values are on no file); it changes what is
trained; the rows' gradients come back and are applied once each, by the next task that
trains their partition (never one that follows a task in flight on it) or at the pass's
end, so no bucket writes a partition another one trains; a killed trainer and a resumed
run end where an undisturbed run does, as without it; the device step refuses it up
front."""

import numpy as np
import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.io.entities import load_entity_counts
import ray

from pbg_ray.training import pass_run
from pbg_ray.training.trainer import Trainer
from tests.fault_injection import armed, checkpoint_arrays, edges_lost_or_doubled
from tests.training.test_trainer import small_config
from tests.util import write_random_graph

# One trainer of one thread: a run repeats bit for bit.
SETTINGS = dict(num_epochs=2, eval_fraction=0.0, beyond_bucket_negs=40,
                ray={"num_trainers": 1, "cpus_per_trainer": 1})


def test_each_bucket_draws_from_every_partition_and_the_run_differs(ray_session, tmp_path,
                                                                     monkeypatch):
    drawn, given, returned, left = [], [], [], []
    beyond, launch, submit = pass_run.PassRun.beyond, pass_run.PassRun.launch, \
        pass_run.submit_bucket
    apply_pending = pass_run.PassRun.apply_pending

    def recorded(self, bucket, keys):
        taken_over = {k for k, task in self.in_flight.items() if k in task.taken_over}
        got = beyond(self, bucket, keys)
        drawn.append((bucket, keys, got, taken_over))
        return got

    def launched(self, bucket, previous=None):
        in_flight = set(self.in_flight)
        task = launch(self, bucket, previous)
        assert not set(task.given) & in_flight  # none follows a task in flight on it
        assert set(task.given) <= set(task.keys)
        return task

    def submitted(*args, **kwargs):
        refs = submit(*args, **kwargs)
        given.extend((k, g) for k, gs in (args[-1] or {}).items() for g in gs)
        returned.append(refs.drawn)
        return refs

    def applied_at_the_end(self):
        left.extend((k, g) for k, gs in self.pending.items() for g in gs)
        apply_pending(self)

    monkeypatch.setattr(pass_run.PassRun, "beyond", recorded)
    monkeypatch.setattr(pass_run.PassRun, "launch", launched)
    monkeypatch.setattr(pass_run, "submit_bucket", submitted)
    monkeypatch.setattr(pass_run.PassRun, "apply_pending", applied_at_the_end)
    # Two trainers at once, in disk placement: the rows come from the stores' files.
    config = small_config(tmp_path, checkpoint_path=str(tmp_path / "on"),
                          **{**SETTINGS, "ray": {"num_trainers": 2, "placement": "disk"}})
    write_random_graph(config, num_edges=400)
    Trainer(config).run()
    assert len(drawn) == 2 * 4
    for bucket, keys, got, taken_over in drawn:
        assert set(got) <= {"user", "item"}  # the partitioned types; tag has one partition
        for entity, d in got.items():
            assert d.rows.shape == (min(40, sum(d.sizes.values())), config.dimension)
            # Only the partitions whose newest values are on a file, each at its size.
            assert d.sizes == {p: n for p, n in enumerate(load_entity_counts(config)[entity])
                               if (entity, p) not in taken_over}
            assert not {(entity, int(p)) for p in d.partitions} & taken_over
    # Over the run every partition of each type was reached, in about its share of rows.
    for entity in ("user", "item"):
        parts = np.concatenate([got[entity].partitions for *_, got, _ in drawn
                                if entity in got])
        expected = sum(len(got[entity].rows) * np.array([got[entity].sizes.get(p, 0)
                                                         for p in range(2)])
                       / sum(got[entity].sizes.values()) for *_, got, _ in drawn if entity in got)
        share = np.bincount(parts, minlength=2) / len(parts)
        assert np.all(share > 0) and np.all(np.abs(share - expected / len(parts)) < 0.1)
    # Every partition's drawn rows' gradients are applied once: by a later task, or at
    # the end of the pass.
    def print_of(key, gradients):
        return key, gradients.offsets.tobytes(), gradients.grads.tobytes()

    came_back = sorted(print_of(k, g) for refs in returned for k, g in ray.get(refs).items())
    assert came_back and given and left
    assert sorted(print_of(k, g) for k, g in given + left) == came_back
    off = small_config(tmp_path, checkpoint_path=str(tmp_path / "off"),
                       **{**SETTINGS, "beyond_bucket_negs": 0})
    Trainer(off).run()
    on_arrays, off_arrays = checkpoint_arrays(config), checkpoint_arrays(off)
    assert any(not np.array_equal(on_arrays[k], off_arrays[k]) for k in on_arrays)


def test_one_trainer_on_disk_draws_around_the_partitions_its_next_task_took_over(
        ray_session, tmp_path, monkeypatch):
    """One trainer in disk placement: each bucket's task is submitted behind the one
    before, and takes over the partitions they share from its worker's buffer, unwritten.
    A draw leaves those out (their store could not read them before that task ends) and
    the run finishes."""
    left_out = []
    beyond = pass_run.PassRun.beyond

    def recorded(self, bucket, keys):
        got = beyond(self, bucket, keys)
        taken_over = {k for k, task in self.in_flight.items() if k in task.taken_over}
        left_out.append(taken_over)
        assert not {(e, int(p)) for e, d in got.items() for p in d.partitions} & taken_over
        return got

    monkeypatch.setattr(pass_run.PassRun, "beyond", recorded)
    config = small_config(tmp_path, **{**SETTINGS, "ray": {"num_trainers": 1,
                                                            "placement": "disk"}})
    write_random_graph(config, num_edges=400)
    assert Trainer(config).run().version == 2
    assert len(left_out) == 2 * 4 and any(left_out)


@pytest.mark.faults
def test_a_killed_trainer_and_a_resumed_run_end_as_an_undisturbed_one(ray_session, tmp_path):
    undisturbed = small_config(tmp_path, checkpoint_path=str(tmp_path / "undisturbed"),
                               **SETTINGS)
    write_random_graph(undisturbed, num_edges=400)
    Trainer(undisturbed).run()
    expected = checkpoint_arrays(undisturbed)

    killed = small_config(tmp_path, checkpoint_path=str(tmp_path / "killed"), **SETTINGS)
    with armed("train_task.after_read", 3) as fired:
        assert Trainer(killed).run().version == 2
    assert fired()
    assert edges_lost_or_doubled(killed) == 0

    resumed = small_config(tmp_path, checkpoint_path=str(tmp_path / "resumed"),
                           **{**SETTINGS, "num_epochs": 1})
    Trainer(resumed).run()
    resumed = small_config(tmp_path, checkpoint_path=str(tmp_path / "resumed"), **SETTINGS)
    assert Trainer(resumed).run().version == 2
    for config in (killed, resumed):
        got = checkpoint_arrays(config)
        assert got.keys() == expected.keys()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_the_device_step_refuses_it_naming_the_key(tmp_path):
    with pytest.raises(PbgRayError, match="beyond_bucket_negs"):
        small_config(tmp_path, beyond_bucket_negs=10, ray={"device_step": True})
