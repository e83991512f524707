"""Model bundles (pbg_ray.checkpoints.bundle): written by python -m pbg_ray.export export.format=bundle,
read back to the same arrays, shared by reference between tags, refused with a clear
error when damaged; int8 keeps filtered MRR; usable as init_path and by the prediction API."""

import dataclasses
import json
import zipfile

import numpy as np
import pytest

from pbg_ray.checkpoints import bundle
from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_state
from pbg_ray.checkpoints.exporter import export_checkpoint
from pbg_ray.checkpoints.legacy import resolve_init_path
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation.distributed import evaluate_checkpoint
from pbg_ray.evaluation.predictor import Predictor
from pbg_ray.export import run as export_run
from pbg_ray.io.entities import num_relation_ids
from pbg_ray.model.params import ModelParams, params_from_checkpoint, params_to_checkpoint
from pbg_ray.predict import main as predict_main
from pbg_ray.training.trainer import Trainer
from tests.util import config_dict, random_checkpoint, write_random_graph


def checkpoint_with_optimizer(config, version, seed):
    """random_checkpoint plus row-Adagrad and Adagrad states (random accumulators)."""
    rng = np.random.default_rng(seed)
    random_checkpoint(config, version=version, seed=seed)
    storage = CheckpointStorage(config.checkpoint_path)
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            embs, _ = storage.load_entity_partition(version, entity, part)
            storage.save_entity_partition(version, entity, part, embs,
                                          row_adagrad_state(rng.random(len(embs)), config.lr))
    arrays, _ = storage.load_model(version)
    sums = {k: rng.random(v.shape).astype(np.float32) for k, v in arrays.items()}
    storage.save_model(version, arrays, params_to_checkpoint(config, ModelParams(arrays, sums))[1])


@pytest.fixture
def two_versions(tmp_path):
    """A checkpoint with versions 1 (kept in epoch_0/) and 2, optimizer states included."""
    config = ConfigSchema.from_dict(config_dict(tmp_path, comparator="dot", dimension=32))
    write_random_graph(config, num_edges=50, counts={"user": 300, "item": 200, "tag": 20})
    storage = CheckpointStorage(config.checkpoint_path)
    checkpoint_with_optimizer(config, 1, seed=1)
    storage.preserve_version(1, storage.snapshot_path(0), config)
    storage.drop_version(1, config)
    checkpoint_with_optimizer(config, 2, seed=2)
    return config


def export(config, variants, versions=None):
    config = dataclasses.replace(config, export=dataclasses.replace(
        config.export, format="bundle", variants=variants, versions=versions))
    return export_checkpoint(config)


def test_round_trip_tags_and_shared_parameters(two_versions, tmp_path):
    config = two_versions
    result = export(config, ["fp32", "fp16", "int8"], versions=[2, 1])
    path = result["file"]
    with bundle.load(path) as model:
        # Oldest first; per version the reduced variants first, so the default is v2 at fp32.
        assert model.tags == ["v1-fp16", "v1-int8", "v1", "v2-fp16", "v2-int8", "v2"]
        assert model.tag == "v2"
        restored = model.to_checkpoint(tmp_path / "restored")
    storage = CheckpointStorage(config.checkpoint_path)
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            embs, state = storage.load_entity_partition(2, entity, part)
            ours, our_state = restored.read_partition(1, entity, part)
            np.testing.assert_array_equal(ours, embs)
            np.testing.assert_array_equal(our_state["state"][0]["sum"], state["state"][0]["sum"])
    arrays, optim_state = storage.load_model(2)
    ours, our_optim = restored.read_model(1)
    num_rel = num_relation_ids(config)
    expected = params_from_checkpoint(config, num_rel, arrays, optim_state)
    got = params_from_checkpoint(config, num_rel, ours, our_optim)
    for name in expected.arrays:
        np.testing.assert_array_equal(got.arrays[name], expected.arrays[name])
        np.testing.assert_array_equal(got.sums[name], expected.sums[name])
    assert restored.read_config().entities == config.entities

    # Reduced tags: embeddings close to fp32 (int8 within half a step of its row's scale);
    # everything else the same values, stored once and referenced.
    old_embs, _ = CheckpointStorage(storage.snapshot_path(0)).load_entity_partition(1, "user", 1)
    with bundle.load(path, "V1-INT8") as int8, bundle.load(path, "v1-fp16") as fp16:
        step = np.abs(old_embs).max(axis=1, keepdims=True) / 127
        assert (np.abs(int8.embeddings("user", 1) - old_embs) <= step / 2 + 1e-7).all()
        np.testing.assert_allclose(fp16.embeddings("user", 1), old_embs, rtol=1e-3, atol=1e-4)
        assert int8.updater("embeddings/user/1") is None
        for name, value in fp16.model_arrays().items():
            np.testing.assert_array_equal(int8.model_arrays()[name], value)
    with zipfile.ZipFile(path) as zf:
        listing = zf.read("v1-int8/params.txt").decode().splitlines()
        shared = [line for line in listing if line.split(" ")[1].startswith("v1-fp16/")]
        assert len(shared) == len(expected.arrays)  # relation parameters: fp16's, by reference
        # Its own members: an int8 array and a scale per entity partition, nothing else.
        assert len([n for n in zf.namelist() if n.startswith("v1-int8/params/")]) == 2 * 5
    sizes = {t["tag"]: t["bytes"] for t in result["tags"]}
    assert 3 < sizes["v2"] / sizes["v2-int8"] < 4.2
    assert 1.8 < sizes["v2"] / sizes["v2-fp16"] <= 2


def test_members_are_read_when_asked_for(two_versions):
    path = export(two_versions, ["fp32"])["file"]
    with bundle.load(path) as model:
        opened = []
        real_open = model._zip.open
        model._zip.open = lambda name, *a, **k: opened.append(name) or real_open(name, *a, **k)
        assert model.embeddings("item", 1).shape == (201, 32)
        assert opened == [model._params["embeddings/item/1"].member]


def rewrite(src, dst, changes):
    """A copy of the zip `src` at `dst` with members replaced (bytes) or dropped (None)."""
    changes = dict(changes)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = changes.pop(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
        for name, data in changes.items():
            zout.writestr(name, data)
    return dst


def test_damaged_or_inconsistent_bundles_are_refused(two_versions, tmp_path):
    path = export(two_versions, ["fp32", "int8"])["file"]
    bad = tmp_path / "bad.zip"
    cases = [
        ({"v2/params/0.npy": None}, r"member 'v2/params/0.npy' \(listed in v2/params.txt\) is missing"),
        ({"tags.txt": b"v2-int8\nV2-INT8\nv2\n"}, r"tag 'V2-INT8' is listed twice"),
        ({"tags.txt": b"v2\n"}, r"member 'v2/params.txt': refers to tag 'v2-int8', which is not in tags.txt"),
        ({"tags.txt": None}, r"member 'tags.txt' is missing"),
        ({"tags.txt": b"v2/x\n"}, r"tag 'v2/x' is not a valid file name"),
        ({"v2/params.txt": b"a 1 2 3\n"}, r"line 'a 1 2 3' is malformed"),
        ({"v2/config.json": None}, r"member 'v2/config.json' is missing"),
    ]
    for changes, message in cases:
        with pytest.raises(PbgRayError, match=message):
            bundle.load(rewrite(path, bad, changes))
    with pytest.raises(PbgRayError, match=r"has no tag 'v2-int9' \(did you mean 'v2-int8'\?\)"):
        bundle.load(path, "v2-int9")
    bad.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(PbgRayError, match="is not a readable zip file"):
        bundle.load(bad)
    # A member whose stored bytes changed fails its CRC when it is read (not before).
    member = "v2/params/0.npy"
    with zipfile.ZipFile(path) as zf:
        data = zf.read(member)
    raw = bytearray(open(path, "rb").read())
    raw[raw.index(data) + len(data) - 1] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with bundle.load(bad) as model:
        name = next(n for n, e in model._params.items() if e.member == member)
        with pytest.raises(PbgRayError, match=r"member 'v2/params/0.npy' can't be read"):
            model.array(name)


def test_export_settings_are_checked(two_versions):
    with pytest.raises(PbgRayError, match=r"export.variants: unknown value 'int4' \(did you mean 'int8'\?\)"):
        export(two_versions, ["fp32", "int4"])
    with pytest.raises(PbgRayError, match="apply to export.format=bundle"):
        export_checkpoint(dataclasses.replace(two_versions, export=dataclasses.replace(
            two_versions.export, variants=["int8"])))


def test_predictor_opens_a_bundle(two_versions, capsys):
    config = two_versions
    path = export(config, ["fp32", "int8"])["file"]
    checkpoint = Predictor.load(config.checkpoint_path)
    full = Predictor.load(path)
    assert full.top_rhs("user-1-3", "likes", k=5) == checkpoint.top_rhs("user-1-3", "likes", k=5)
    int8 = Predictor.load(path, tag="v2-int8")
    assert [n for n, _ in int8.top_rhs("user-1-3", "likes", k=3)] == \
        [n for n, _ in checkpoint.top_rhs("user-1-3", "likes", k=3)]
    predict_main([path, "--tag", "v2-int8", "score", "user-1-3", "likes", "item-0-2"])
    score = json.loads(capsys.readouterr().out)["score"]
    assert score == pytest.approx(float(checkpoint.score([("user-1-3", "likes", "item-0-2")])[0]),
                                  abs=0.05)
    with pytest.raises(PbgRayError, match="is a model bundle: pick one of its tags"):
        Predictor.load(path, version=2)


def test_a_bundle_is_an_init_path(two_versions, tmp_path):
    """init_path=<bundle>: its newest tag becomes a v1 checkpoint the trainer starts from
    (the trainer's side of resolve_init_path: tests/checkpoints/test_legacy.py)."""
    path = export(two_versions, ["int8", "fp32"])["file"]
    stale = tmp_path / "run" / "..init.staging-1"  # what a killed conversion left
    stale.mkdir(parents=True)
    resolved = CheckpointStorage(resolve_init_path(path, tmp_path / "run" / ".init"))
    assert not stale.exists()
    assert resolved.path == tmp_path / "run" / ".init" and resolved.load_version() == 1
    embs, state = resolved.load_entity_partition(1, "item", 1)
    ours, our_state = CheckpointStorage(two_versions.checkpoint_path).load_entity_partition(2, "item", 1)
    np.testing.assert_array_equal(embs, ours)
    np.testing.assert_array_equal(state["state"][0]["sum"], our_state["state"][0]["sum"])


def test_int8_keeps_filtered_mrr(ray_session, tmp_path, capsys):
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, num_epochs=2, dimension=32, comparator="dot", loss_fn="softmax", lr=0.1,
        eval_fraction=0.0, eval={"sampled": False, "per_relation": False}))
    write_random_graph(config, num_edges=300)
    Trainer(config).run()
    export_config = dataclasses.replace(config, export=dataclasses.replace(
        config.export, format="bundle", variants=["fp32", "int8"]))
    export_run(export_config)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tag v2-int8: ") and "x smaller than v2 (" in lines[0]
    path = json.loads(lines[-1])["file"]
    mrr = {}
    for tag in ("v2", "v2-int8"):
        with bundle.load(path, tag) as model:
            storage = model.to_checkpoint(tmp_path / tag)
        report = evaluate_checkpoint(dataclasses.replace(config, checkpoint_path=str(storage.path)))
        mrr[tag] = report["metrics"]["all"]["filtered"]["mrr"]
    assert mrr["v2"] > 0.1 and abs(mrr["v2"] - mrr["v2-int8"]) < 0.01
