"""The engine's train tasks running the device step, on a GPU (`ray.gpus_per_trainer`) and on
the CPU (`ray.device_step`, the GPU's path where no GPU is): partitions kept by version on
the worker's device buffer, copied there only where the worker lacks them, and back at once
in memory placement, when their swap files are written in disk placement, where both
placements write the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import h5py
import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.training.trainer import Trainer
from tests.util import config_dict, write_random_graph

def device_run(tmp_path: Path, placement: str, device: str) -> ConfigSchema:
    on_device = {"device_step": True} if device == "cpu" else {"gpus_per_trainer": 1}
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, checkpoint_path=str(tmp_path / placement), seed=3, num_epochs=3,
        eval_fraction=0.0, ray={"num_trainers": 1, "placement": placement, **on_device}))
    write_random_graph(config, num_edges=400)
    Trainer(config).run()
    return config


def stats_lines(config: ConfigSchema) -> List[Dict]:
    with open(Path(config.checkpoint_path) / "training_stats.json") as f:
        return [json.loads(line) for line in f]


def checkpoint_arrays(config: ConfigSchema) -> Dict[str, np.ndarray]:
    version = CheckpointStorage(config.checkpoint_path).load_version()
    found = {}
    for path in sorted(Path(config.checkpoint_path).glob(f"*.v{version}.h5")):
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: found.__setitem__(f"{path.name}/{name}", obj[()])
                         if isinstance(obj, h5py.Dataset) and obj.dtype.kind == "f" else None)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA device")])])
def test_device_step_runs_keep_partitions_on_the_device(ray_session, tmp_path, device):
    if device == "cuda":
        assert ray_session.cluster_resources().get("GPU", 0) >= 1, "the local Ray sees no GPU"
    memory, disk = device_run(tmp_path, "memory", device), device_run(tmp_path, "disk", device)
    # Memory placement: a bucket copies in the partitions its worker did not train last at
    # that version, and returns (copies back) all of its partitions.
    trained_on: Dict[str, int] = {}
    lines = stats_lines(memory)
    assert len(lines) == 12
    for line in lines:
        keys = [f"{e}{p if e != 'tag' else 0}" for e in ("user", "item", "tag")
                for p in {line["lhs_partition"], line["rhs_partition"]}]
        keys = list(dict.fromkeys(keys))
        pid = line["worker"]["pid"]
        assert line["device_io"]["copies_to_device"] == sum(trained_on.get(k) != pid for k in keys)
        assert line["device_io"]["copies_from_device"] == len(keys)
        trained_on.update(dict.fromkeys(keys, pid))
    # Disk placement writes the same checkpoint (its partitions came back from the device
    # for their swap files and the checkpoint), with fewer copies back. (On a GPU a row's
    # gradients fold by atomic adds, whose order may round them differently.)
    expected, written = checkpoint_arrays(memory), checkpoint_arrays(disk)
    assert expected.keys() == written.keys() and len(expected) > 5
    for name, values in expected.items():
        np.testing.assert_allclose(written[name], values, err_msg=name,
                                   **({} if device == "cpu" else dict(rtol=1e-3, atol=1e-4)))
    back = lambda config: sum(l["device_io"]["copies_from_device"] for l in stats_lines(config))  # noqa: E731
    assert back(disk) < back(memory)


def test_what_the_device_step_does_not_train_is_refused_up_front(tmp_path):
    with pytest.raises(PbgRayError, match=r"entities.user.featurized: featurized entities train "
                                          r"on CPUs only.*ray.device_step=false"):
        ConfigSchema.from_dict(config_dict(
            tmp_path, entities={"user": {"featurized": True}, "item": {}, "tag": {}},
            ray={"device_step": True}))
    with pytest.raises(PbgRayError, match=r"entities.tag.dimension: the device step "
                                          r"\(ray.gpus_per_trainer\) trains entity types of one "
                                          r"dimension.*ray.gpus_per_trainer=0"):
        ConfigSchema.from_dict(config_dict(
            tmp_path, entities={"user": {}, "item": {}, "tag": {"dimension": 4}},
            ray={"gpus_per_trainer": 1}))
