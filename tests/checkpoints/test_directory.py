"""CheckpointStorage (pbg_ray.checkpoints.directory): the v1 files round-trip, are written
atomically (a failed write keeps the previous file), and damaged ones are refused by name."""

import io
import subprocess
import sys
import tracemalloc

import h5py
import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.directory import (
    CheckpointStorage, deserialize_optim_state, row_adagrad_state, row_adagrad_sums,
    serialize_optim_state, state_dict_key)
from pbg_ray.errors import PbgRayError


@pytest.fixture
def storage(make_config):
    config = make_config()
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    return config, storage


def write_version(storage, config, version, value=1.0):
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            embs = np.full((3 + part, config.dimension), value, np.float32)
            storage.save_entity_partition(version, entity, part, embs,
                                          row_adagrad_state(np.arange(3 + part, dtype=np.float32), 0.1),
                                          {"iteration/epoch_idx": version})
    storage.save_model(version, {"relations/0/operator/rhs/translation": np.full(8, value, np.float32)},
                       None)


def test_state_dict_keys_are_pbgs():
    assert state_dict_key("relations/2/operator/rhs/linear_transformation") == "rhs_operators.2.linear_transformation"
    assert state_dict_key("entities/user/global_embedding") == "global_embs.emb_user"
    with pytest.raises(ValueError):
        state_dict_key("something/else")


def test_partition_round_trip(storage):
    config, storage = storage
    embs = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    sums = np.arange(5, dtype=np.float32)
    storage.save_entity_partition(1, "user", 1, embs, row_adagrad_state(sums, 0.1), {"config/json": "{}"})
    path = storage.path / "embeddings_user_1.v1.h5"
    with h5py.File(path) as hf:
        assert hf.attrs["format_version"] == 1 and hf.attrs["config/json"] == "{}"
        assert hf["embeddings"].dtype == np.float32
    loaded, state = storage.load_entity_partition(1, "user", 1)
    np.testing.assert_array_equal(loaded, embs)
    np.testing.assert_array_equal(row_adagrad_sums(state, 5, "x"), sums)
    assert state["param_groups"][0]["lr"] == 0.1


@pytest.mark.parametrize("with_state", [True, False])  # HDF5 lays the two out differently
@pytest.mark.parametrize("rows", [0, 1, 40_000])
def test_partition_embeddings_go_straight_from_the_array_into_a_plain_hdf5_dataset(
        storage, rows, with_state):
    """The embeddings' bytes are written from the array after the HDF5 structure built in
    memory, never copied (nor their range filled) there; the file reads back as one
    contiguous dataset like h5py's own."""
    config, storage = storage
    embs = np.random.default_rng(rows).standard_normal((rows, 32)).astype(np.float32)
    sums = np.arange(rows, dtype=np.float32)
    tracemalloc.start()
    try:
        storage.save_entity_partition(1, "user", 0, embs,
                                      row_adagrad_state(sums, 0.1) if with_state else None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024 + 4 * sums.nbytes  # the structure and the optimizer state's blob
    path = storage.partition_file(1, "user", 0)
    with h5py.File(path) as hf:
        assert hf["embeddings"].shape == (rows, 32) and hf["embeddings"].chunks is None
        np.testing.assert_array_equal(hf["embeddings"][...], embs)
    assert path.stat().st_size < embs.nbytes + 64 * 1024 + 2 * sums.nbytes  # one copy of the data
    loaded, state = storage.load_entity_partition(1, "user", 0)
    np.testing.assert_array_equal(loaded, embs)
    if with_state:
        np.testing.assert_array_equal(row_adagrad_sums(state, rows, "x"), sums)
    else:
        assert state is None


def test_a_swap_file_is_written_over_its_own_bytes(storage):
    config, storage = storage
    path = storage.swap_file("test", 0)
    big = np.ones((1000, 8), np.float32)
    CheckpointStorage.write_entity_partition(path, big, None, in_place=True)
    inode = path.stat().st_ino
    small = np.full((10, 8), 2.0, np.float32)  # shorter: the rest of the old file is cut off
    CheckpointStorage.write_entity_partition(path, small, row_adagrad_state(np.ones(10, np.float32), 0.1),
                                             in_place=True)
    assert path.stat().st_ino == inode and path.stat().st_size < big.nbytes
    loaded, state = CheckpointStorage.read_entity_partition(path)
    np.testing.assert_array_equal(loaded, small)
    assert storage.swap_files("test") == [path]
    storage.remove_leftovers(1)  # a swap file is a leftover once its run is gone
    assert not path.exists()


def test_rows_are_read_alone_in_any_order_with_repeats(storage):
    config, storage = storage
    embs = np.random.default_rng(0).normal(size=(1000, 8)).astype(np.float32)
    path = storage.partition_file(1, "user", 0)
    CheckpointStorage.write_entity_partition(path, embs, row_adagrad_state(np.ones(1000, np.float32), 0.1))
    offsets = np.array([999, 3, 4, 5, 500, 3, 0])  # runs, a repeat, both ends
    np.testing.assert_array_equal(CheckpointStorage.read_entity_rows(path, offsets), embs[offsets])
    assert CheckpointStorage.read_entity_rows(path, np.empty(0, np.int64)).shape == (0, 8)
    with pytest.raises(PbgRayError, match="holds 1000 rows; row 1000 was asked for"):
        CheckpointStorage.read_entity_rows(path, np.array([2, 1000]))


def test_optimizer_state_of_a_read_only_array_is_a_blob_torch_reads():
    # Partition stores hand over read-only views of Ray's object store.
    sums = np.arange(4, dtype=np.float32)
    sums.flags.writeable = False
    blob = serialize_optim_state(row_adagrad_state(sums, 0.1, step=3))
    state = torch.load(io.BytesIO(blob), weights_only=True)
    assert state["state"][0]["step"] == 3
    assert torch.equal(state["state"][0]["sum"], torch.arange(4, dtype=torch.float32))
    np.testing.assert_array_equal(row_adagrad_sums(deserialize_optim_state(blob, "here"), 4, "here"),
                                  sums)


def test_model_round_trip_keeps_order_and_keys(storage):
    config, storage = storage
    params = {"relations/1/operator/rhs/diagonal": np.ones(8, np.float32),
              "relations/0/operator/rhs/translation": np.zeros(8, np.float32),
              "entities/user/global_embedding": np.arange(8, dtype=np.float32)}
    optim = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}
    storage.save_model(4, params, optim)
    with h5py.File(storage.model_file(4)) as hf:
        keys = []
        hf["model"].visititems(lambda n, o: keys.append((n, o.attrs["state_dict_key"]))
                               if isinstance(o, h5py.Dataset) else None)
    assert ("relations/1/operator/rhs/diagonal", "rhs_operators.1.diagonal") in keys
    loaded, loaded_optim = storage.load_model(4)
    assert list(loaded) == sorted(params, key=list(loaded).index)
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert loaded_optim == optim


def test_version_lifecycle(storage):
    config, storage = storage
    assert storage.load_version() == 0
    write_version(storage, config, 1)
    storage.save_version(1)
    assert storage.version_file().read_text() == "1\n"
    storage.check_version(1, config)
    write_version(storage, config, 2, value=2.0)
    storage.preserve_version(1, storage.snapshot_path(1), config)
    storage.save_version(2)
    storage.drop_version(1, config)
    assert not storage.model_file(1).exists()
    # The preserved snapshot survives dropping the originals (hard links).
    snap = CheckpointStorage(storage.snapshot_path(1))
    assert snap.load_version() == 1
    snap.check_version(1, config)
    assert snap.load_entity_partition(1, "tag", 0)[0][0, 0] == 1.0
    assert storage.load_entity_partition(2, "tag", 0)[0][0, 0] == 2.0


def test_version_naming_missing_files_is_refused(storage):
    config, storage = storage
    write_version(storage, config, 1)
    storage.save_version(1)
    (storage.path / "embeddings_item_1.v1.h5").unlink()
    with pytest.raises(PbgRayError, match=r"names version 1, but embeddings_item_1.v1.h5 is missing"):
        storage.check_version(1, config)


@pytest.mark.parametrize("text", ["x\n", "1.0", "-1"])
def test_bad_version_file(storage, text):
    _, storage = storage
    storage.version_file().write_text(text)
    with pytest.raises(PbgRayError, match="checkpoint_version.txt"):
        storage.load_version()


def test_failed_write_keeps_previous_file(storage, monkeypatch):
    config, storage = storage
    storage.save_entity_partition(1, "tag", 0, np.ones((3, 8), np.float32), None)
    before = storage.partition_file(1, "tag", 0).read_bytes()

    class Exploding(dict):
        def items(self):
            raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        storage.save_entity_partition(1, "tag", 0, np.zeros((3, 8), np.float32), None, Exploding())
    assert storage.partition_file(1, "tag", 0).read_bytes() == before
    assert sorted(p.name for p in storage.path.iterdir()) == ["embeddings_tag_0.v1.h5"]


def test_bad_checkpoint_files(storage):
    config, storage = storage
    with pytest.raises(PbgRayError, match="embeddings_user_0.v7.h5' is missing"):
        storage.load_entity_partition(7, "user", 0)
    with h5py.File(storage.partition_file(1, "user", 0), "w") as hf:
        hf.attrs["format_version"] = 1
        hf.create_dataset("embeddings", data=np.zeros(4, np.float32))
    with pytest.raises(PbgRayError, match="must be a 2-D float array"):
        storage.load_entity_partition(1, "user", 0)
    with h5py.File(storage.partition_file(1, "user", 0), "w") as hf:
        hf.attrs["format_version"] = 1
        hf.create_dataset("embeddings", data=np.zeros((4, 2), np.float32))
        hf.create_dataset("optimizer/state_dict", data=np.frombuffer(b"garbage", dtype="V1"))
    with pytest.raises(PbgRayError, match="optimizer state blob can't be read"):
        storage.load_entity_partition(1, "user", 0)
    with pytest.raises(PbgRayError, match="expected \\(3,\\)"):
        row_adagrad_sums(row_adagrad_state(np.zeros(4, np.float32), 0.1), 3, "x")


def test_config_and_stats(storage):
    config, storage = storage
    storage.save_config(config)
    assert storage.load_config() == config
    storage.append_stats([{"epoch_idx": 0, "stats": {"count": 3}}])
    storage.append_stats([{"epoch_idx": 1}])
    assert list(storage.load_stats()) == [{"epoch_idx": 0, "stats": {"count": 3}}, {"epoch_idx": 1}]
    (storage.path / "config.json").write_text("{oops")
    with pytest.raises(PbgRayError, match="config.json' is not valid JSON"):
        storage.load_config()


# Run in a child process whose writes past 1 KiB fail with EFBIG, as on a full disk.
FULL_DISK_WRITES = """
import resource, sys
import numpy as np
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.checkpoints.directory import CheckpointStorage
storage = CheckpointStorage(sys.argv[1])
config = storage.load_config()
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
for write in (lambda: storage.save_entity_partition(1, "user", 0, np.zeros((500, 8), np.float32), None),
              lambda: storage.save_config(config),
              lambda: storage.append_stats([{"epoch_idx": 1, "padding": "x" * 2000}]),
              lambda: CheckpointStorage.write_entity_partition(
                  storage.swap_file("t", 0), np.zeros((500, 8), np.float32), None,
                  in_place=True)):
    try:
        write()
        print("written")
    except PbgRayError as err:
        print(err)
"""


def test_writes_on_a_full_disk_fail_naming_the_file_and_change_nothing(storage):
    config, storage = storage
    storage.save_config(config)
    storage.save_entity_partition(1, "user", 0, np.ones((3, 8), np.float32), None)
    storage.append_stats([{"epoch_idx": 0}])
    before = {p.name: p.read_bytes() for p in storage.path.iterdir() if p.name != "training_stats.json"}
    child = subprocess.run([sys.executable, "-c", FULL_DISK_WRITES, str(storage.path)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    lines = child.stdout.strip().splitlines()
    assert len(lines) == 4
    for line, name in zip(lines, ["embeddings_user_0.v1.h5", "config.json", "training_stats.json",
                                  ".partition.h5.tmp-swap-t-0"]):
        assert f"{name}' failed: File too large" in line, line
    # Nothing replaced, no temporary file left; a swap file is never atomic (the partition
    # store takes only those of tasks that succeeded), and the next save removes it.
    after = {p.name: p.read_bytes() for p in storage.path.iterdir()
             if p.name != "training_stats.json" and p not in storage.swap_files("t")}
    assert after == before
    # The append was cut short: the torn last line is what a killed run leaves, and is left out.
    assert not storage.stats_file().read_text().endswith("\n")
    assert list(storage.load_stats()) == [{"epoch_idx": 0}]


def test_a_damaged_stats_line_is_named(storage):
    _, storage = storage
    storage.stats_file().write_text('{"epoch_idx": 0}\n{oops\n{"epoch_idx": 1}\n')
    with pytest.raises(PbgRayError, match=r"training_stats.json', line 2: not a JSON object"):
        list(storage.load_stats())
