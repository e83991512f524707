"""CheckpointManager: a run's resume, session and commit, and finding versions to read."""

import dataclasses

import pytest

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.errors import PbgRayError
from tests.util import commit_random_version, random_checkpoint, write_random_graph


@pytest.fixture
def config(make_config):
    config = make_config()
    write_random_graph(config)
    return config


def stats(epoch, n=2):
    return [{"epoch_idx": epoch, "edge_path_idx": 0, "edge_chunk_idx": 0, "index": i}
            for i in range(n)]


def test_resume_of_a_new_directory_is_version_0(config):
    assert CheckpointManager(config.checkpoint_path).resume(config) == 0


def test_resume_returns_the_current_version_and_refuses_another_model(config):
    random_checkpoint(config, version=3)
    manager = CheckpointManager(config.checkpoint_path)
    assert manager.resume(config) == 3
    with pytest.raises(PbgRayError, match="holds a run whose 'dimension' differs"):
        manager.resume(dataclasses.replace(config, dimension=16))


def test_resume_refuses_a_version_whose_files_are_missing(config):
    random_checkpoint(config, version=1)
    manager = CheckpointManager(config.checkpoint_path)
    manager.partition_file(1, "user", 1).unlink()
    with pytest.raises(PbgRayError, match="embeddings_user_1.v1.h5 is missing"):
        manager.resume(config)


def test_commit_switches_preserves_and_drops_the_superseded_version(config):
    random_checkpoint(config, version=1)
    manager = CheckpointManager(config.checkpoint_path)
    random_checkpoint(config, version=2)  # writes version 2's files and switches to it
    manager.switch_to(1)
    released = []
    manager.commit(2, stats(0), config, preserve_as_epoch=1, release=released.append)
    assert manager.version() == 2 and released == [1]
    assert not manager.has_model(1) and not manager.has_partition(1, "user", 0)
    snapshot, version = manager.locate(config, 2, "eval.version")
    assert version == 2 and snapshot.path == manager.path
    assert CheckpointManager(manager.path / "epoch_1").version() == 2
    assert [s["index"] for s in manager.read_stats()] == [0, 1]


def test_commit_makes_the_version_current_only_after_its_stats_and_before_dropping(
        config, monkeypatch):
    random_checkpoint(config, version=1)
    random_checkpoint(config, version=2)
    manager = CheckpointManager(config.checkpoint_path)
    manager.switch_to(1)
    calls = []

    def recorded(name):
        method = getattr(manager.storage, name)

        def call(*args):
            calls.append(name)
            return method(*args)
        return call

    for name in ("append_stats", "save_config", "save_version", "preserve_version",
                 "drop_version"):
        monkeypatch.setattr(manager.storage, name, recorded(name))
    manager.commit(2, stats(0), config, preserve_as_epoch=1,
                   release=lambda superseded: calls.append(f"release {superseded}"))
    # The snapshot's own version file is written last in epoch_1/ too.
    assert calls == ["append_stats", "save_config", "save_version", "preserve_version",
                     "save_config", "save_version", "release 1", "drop_version"]


def test_locate_finds_an_older_version_in_its_epoch_snapshot(config):
    random_checkpoint(config, version=1)
    manager = CheckpointManager(config.checkpoint_path)
    manager.commit(1, [], config, preserve_as_epoch=1)
    random_checkpoint(config, version=2)
    manager.commit(2, [], config)
    older, version = manager.locate(config, 1, "eval.version")
    assert version == 1 and older.path == manager.path / "epoch_1"
    with pytest.raises(PbgRayError, match=r"version 5 is not in .*\(versions there: \[1, 2\]\)"):
        manager.locate(config, 5, "eval.version")


def test_readers_default_to_the_best_version_whose_files_may_be_in_best_alone(config):
    """Version 1 best on validation, version 2 not: readers that follow the best take 1,
    whose files training dropped from the checkpoint when it committed 2."""
    manager = CheckpointManager(config.checkpoint_path)
    commit_random_version(config, 1, best=True)
    commit_random_version(config, 2)
    assert (manager.version(), manager.best_version()) == (2, 1)
    assert (manager.default_version(), manager.default_version(best=False)) == (1, 2)
    assert not manager.has_model(1)
    assert manager.holding(1).path == manager.path / "best"
    assert manager.holding(2).path == manager.path
    located, version = manager.locate(config, None, "eval.version")
    assert (located.path, version) == (manager.path / "best", 1)
    commit_random_version(config, 3, best=True)
    assert manager.default_version() == 3 and not manager.holding(1).has_model(1)


def test_session_locks_removes_leftovers_and_stats_of_unfinished_passes(config):
    random_checkpoint(config, version=1)
    manager = CheckpointManager(config.checkpoint_path)
    manager.commit(1, stats(0), config)
    random_checkpoint(config, version=2)  # an interrupted run's next version...
    manager.switch_to(1)
    manager.storage.append_stats(stats(1))  # ...and the stats of its pass
    with manager.session(1, lambda s: s["epoch_idx"] < 1) as kept:
        assert kept == 2
        assert not manager.has_model(2)
        with pytest.raises(PbgRayError, match="in use by another training run"):
            with CheckpointManager(config.checkpoint_path).session(1, lambda s: True):
                pass
        random_checkpoint(config, version=2)
        manager.switch_to(1)
    # The run ended without committing version 2: its files are gone.
    assert manager.version() == 1 and not manager.has_model(2) and manager.has_model(1)
