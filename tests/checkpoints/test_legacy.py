"""Pre-1.0 PyTorch-BigGraph runs (spec 001), built with torch.save as the document says:
python -m pbg_ray.migrate turns them into v1 checkpoints torchbiggraph 1.0.0 loads, and
such a directory serves as init_path."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage, state_dict_key
from pbg_ray.checkpoints.legacy import migrate_run, resolve_init_path
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.io.entities import load_entity_count, num_relation_ids
from pbg_ray.migrate import main as migrate_main
from pbg_ray.model.params import ModelParams, param_layout, params_to_checkpoint
from pbg_ray.training.trainer import Trainer
from tests.util import (
    as_torch, assert_streams_partitions, assert_valid_checkpoint, config_dict, peak_growth,
    write_random_graph)


def camel_case(data):
    """A config dict as pre-1.0 PBG saved it: camelCase keys, outdir, loadPath."""
    renamed = {"checkpoint_path": "outdir", "init_path": "loadPath"}
    camel = lambda k: renamed.get(k) or re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k)  # noqa: E731
    data = {camel(k): v for k, v in data.items()}
    data["entities"] = {n: {camel(k): v for k, v in e.items()} for n, e in data["entities"].items()}
    data["relations"] = [{camel(k): v for k, v in r.items()} for r in data["relations"]]
    return data


def pbg_row_adagrad_state(sums):
    """A partition's optimizer state as torchbiggraph's RowAdagrad.state_dict() gives it."""
    return {"state": {0: {"step": 0, "sum": torch.from_numpy(sums)}},
            "param_groups": [{"lr": 0.1, "lr_decay": 0, "weight_decay": 0, "params": [0]}]}


def write_legacy_run(tmp_path, base=1, version=3, parameter=True):
    """A pre-1.0 run of conftest's graph: entity counts, metadata of versions 2 and 3 (the
    older one's embeddings deleted, as PBG did), embeddings of the newest version.
    Returns (old outdir, {(type, part): (embeddings, sums)}, {public name: array})."""
    rng = np.random.default_rng(1)
    data = config_dict(tmp_path / "old", lr=0.1, num_epochs=3, loss_fn="softmax", comparator="dot")
    config = ConfigSchema.from_dict(data)
    write_random_graph(config)  # v1 files under old/: only the counts are used
    outdir = tmp_path / "old" / "checkpoints"
    outdir.mkdir(parents=True)
    (outdir / "CHECKPOINT_VERSION").write_text(str(version))
    ext = f".{version}" if version else ""
    arrays = {}
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            count = load_entity_count(config.entity_path, entity, part)
            torch.save(count, tmp_path / "old" / "entities" / f"entity_count_{entity}_{part + base}.pt")
            embs = rng.standard_normal((count, 8)).astype(np.float32)
            sums = rng.random(count).astype(np.float32)
            tensor = torch.from_numpy(embs)
            torch.save((torch.nn.Parameter(tensor) if parameter else tensor,
                        pbg_row_adagrad_state(sums)), outdir / f"{entity}_{part + base}.pt{ext}")
            arrays[entity, part] = embs, sums
    layout = param_layout(config, num_relation_ids(config))
    params = ModelParams({k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in layout},
                         {k: rng.random(v.shape).astype(np.float32) for k, v in layout})
    _, optim_state = params_to_checkpoint(config, params)
    state = {state_dict_key(k): torch.nn.Parameter(torch.from_numpy(v)) for k, v in params.arrays.items()}
    for v in (version - 1, version):
        torch.save((camel_case(config.to_dict()), 0, v, state, as_torch(optim_state)),
                   outdir / f"METADATA_{base}.pt.{v}" if v else outdir / f"METADATA_{base}.pt")
    return outdir, arrays, params


@pytest.mark.parametrize("base", [1, 0])
def test_migrate_writes_a_v1_run_torchbiggraph_loads(tmp_path, capsys, base):
    old, arrays, params = write_legacy_run(tmp_path, base=base)
    new = tmp_path / "new"
    migrate_main([str(old), str(new)])
    assert json.loads(capsys.readouterr().out)["version"] == 3
    storage = CheckpointStorage(new)
    config = storage.load_config()
    assert config.checkpoint_path == str(new) and config.entity_path == str(new / "entities")
    assert config.num_epochs == 3 and config.batch_size == 20 and config.entities["user"].num_partitions == 2
    assert_valid_checkpoint(config, 3)  # torchbiggraph 1.0.0 reads embeddings, model, optimizer
    for (entity, part), (embs, sums) in arrays.items():
        ours, state = storage.load_entity_partition(3, entity, part)
        np.testing.assert_array_equal(ours, embs)
        np.testing.assert_array_equal(state["state"][0]["sum"], sums)
        assert load_entity_count(config.entity_path, entity, part) == len(embs)
    model, optim_state = storage.load_model(3)
    assert model.keys() == params.arrays.keys()
    for name, value in params.arrays.items():
        np.testing.assert_array_equal(model[name], value)
    assert len(optim_state["state"]) == len(params.arrays)
    assert not list(tmp_path.glob(".new.*"))


def test_migrate_refuses_bad_runs_and_leaves_nothing(tmp_path, capsys):
    old, _, _ = write_legacy_run(tmp_path)
    new = tmp_path / "new"

    def refused(match, *extra):
        with pytest.raises(SystemExit) as exit_info:
            migrate_main([str(old), str(new), *extra])
        assert exit_info.value.code == 2
        assert re.search(match, capsys.readouterr().err)
        assert not new.exists() and not list(tmp_path.glob(".new.*"))

    (tmp_path / "counts").mkdir()
    torch.save(99, tmp_path / "counts" / "entity_count_item_2.pt")
    refused(r"entity_count_item_2.pt' says 99 entities but the checkpoint has 21", "--entity-path",
            str(tmp_path / "counts"))
    (old / "tag_1.pt.3").write_bytes(b"not a torch file")
    refused(r"tag_1.pt.3' is not a readable torch.save file")
    (old / "tag_1.pt.3").unlink()
    refused(r"1 embeddings file\(s\) of version 3 named by the config are missing, e.g. .*tag_1.pt.3")
    (old / "CHECKPOINT_VERSION").write_text("4")
    refused(r"no pre-1.0 checkpoint file of version 4 .*versions found: \[2, 3\]")
    (old / "CHECKPOINT_VERSION").write_text("3")
    state = torch.load(old / "METADATA_1.pt.3", weights_only=True)
    torch.save(state[:4], old / "METADATA_1.pt.3")
    refused(r"METADATA_1.pt.3' must hold a tuple \(config dict, int, int")
    new.mkdir()
    (new / "x").write_text("")
    with pytest.raises(PbgRayError, match="already exists and is not empty"):
        migrate_run(old, new)


def test_unknown_state_dict_entries_and_config_keys_are_named(tmp_path):
    old, _, _ = write_legacy_run(tmp_path)
    config, a, b, state, optim = torch.load(old / "METADATA_1.pt.3", weights_only=True)
    torch.save((config, a, b, {**state, "lhs_embs.emb_user": torch.zeros(2)}, optim),
               old / "METADATA_1.pt.3")
    with pytest.raises(PbgRayError, match="entry 'lhs_embs.emb_user' is not a relation operator"):
        migrate_run(old, tmp_path / "new")
    torch.save(({**config, "numEpoch": 3}, a, b, state, optim), old / "METADATA_1.pt.3")
    with pytest.raises(PbgRayError, match=r"METADATA_1.pt.3: config: unknown key 'num_epoch' "
                                          r"\(did you mean 'num_epochs'\?\)"):
        migrate_run(old, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_an_init_directory_converts_to_v1(tmp_path):
    """loadPath style: no metadata, no version file, no suffix, no optimizer state."""
    old, arrays, _ = write_legacy_run(tmp_path, version=0, parameter=False)
    for path in old.glob("METADATA_*"):
        path.unlink()
    (old / "CHECKPOINT_VERSION").unlink()
    for path in old.glob("*.pt"):
        embs, _ = torch.load(path, weights_only=True)
        torch.save((embs, None), path)
    resolved = resolve_init_path(str(old), tmp_path / "run" / ".init")
    storage = CheckpointStorage(resolved)
    assert storage.load_version() == 1 and not storage.model_file(1).exists()
    embs, state = storage.load_entity_partition(1, "item", 1)
    np.testing.assert_array_equal(embs, arrays["item", 1][0])
    assert state is None
    # A v1 directory is used as it is.
    assert resolve_init_path(resolved, tmp_path / "elsewhere") == resolved


def test_a_pre_1_0_run_is_an_init_path(ray_session, tmp_path):
    old, arrays, _ = write_legacy_run(tmp_path)
    data = config_dict(tmp_path / "new", comparator="dot", loss_fn="softmax", num_epochs=1, lr=0.0,
                       init_path=str(old))
    config = ConfigSchema.from_dict(data)
    write_random_graph(config)  # the same counts as the old run's
    Trainer(config).run()
    # lr=0: the trained values are the initial ones.
    embs, _ = CheckpointStorage(config.checkpoint_path).load_entity_partition(1, "user", 1)
    np.testing.assert_array_equal(embs, arrays["user", 1][0])
    # The conversion is read until version 1 exists, then removed.
    assert not (Path(config.checkpoint_path) / ".init").exists()


def migrate_in_process(old_dir, new_dir):
    """Run by peak_memory."""
    assert migrate_run(old_dir, new_dir)["partitions"] >= 1


@pytest.mark.slow
def test_migrate_memory_follows_the_partition_not_the_table(tmp_path):
    def legacy_copy(config, name):
        """The v1 checkpoint of `config` written as a pre-1.0 run (version 1, partitions from 1)."""
        outdir = tmp_path / "legacy" / name
        outdir.mkdir(parents=True)
        storage = CheckpointStorage(config.checkpoint_path)
        for part in range(config.entities["node"].num_partitions):
            embs, _ = storage.load_entity_partition(1, "node", part)
            torch.save((torch.from_numpy(embs), pbg_row_adagrad_state(np.ones(len(embs), np.float32))),
                       outdir / f"node_{part + 1}.pt.1")
        arrays, _ = storage.load_model(1)
        state = {state_dict_key(k): torch.from_numpy(v) for k, v in arrays.items()}
        data = dict(config.to_dict(), entity_path=str(Path(config.entity_path)))
        torch.save((camel_case(data), 0, 1, state, None), outdir / "METADATA_1.pt.1")
        (outdir / "CHECKPOINT_VERSION").write_text("1")
        return [str(outdir), str(tmp_path / "migrated" / name)]

    assert_streams_partitions(*peak_growth(
        tmp_path, "tests.checkpoints.test_legacy:migrate_in_process", legacy_copy))
