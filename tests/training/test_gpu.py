"""Train tasks on a GPU (`ray.gpus_per_trainer`): the engine, with partitions moving between
host and device in memory and disk placement, writes the checkpoint the CPU writes for the
same seed, within float tolerance. Needs a CUDA device that the local Ray sees."""

from pathlib import Path
from typing import Dict

import h5py
import numpy as np
import pytest
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.training.trainer import Trainer
from tests.util import config_dict, write_random_graph

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def seeded_config(tmp_path, name: str, placement: str, gpus: float) -> ConfigSchema:
    return ConfigSchema.from_dict(config_dict(
        tmp_path, checkpoint_path=str(tmp_path / name), seed=3, num_epochs=2,
        comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True,
        ray={"num_trainers": 1, "cpus_per_trainer": 1, "gpus_per_trainer": gpus,
             "placement": placement}))


def float_datasets(config: ConfigSchema) -> Dict[str, np.ndarray]:
    """Every float dataset of the newest version's embeddings and model files."""
    version = CheckpointStorage(config.checkpoint_path).load_version()
    found: Dict[str, np.ndarray] = {}
    for path in sorted(Path(config.checkpoint_path).glob(f"*.v{version}.h5")):
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: found.__setitem__(f"{path.name}/{name}", obj[()])
                         if isinstance(obj, h5py.Dataset) and obj.dtype.kind == "f" else None)
    return found


@pytest.mark.parametrize("placement", ["memory", "disk"])
def test_a_gpu_run_writes_the_checkpoint_of_the_cpu_run(ray_session, tmp_path, placement):
    assert ray_session.cluster_resources().get("GPU", 0) >= 1, "the local Ray sees no GPU"
    cpu = seeded_config(tmp_path, "cpu", placement, gpus=0)
    gpu = seeded_config(tmp_path, "gpu", placement, gpus=1)
    write_random_graph(cpu, num_edges=300)
    for config in (cpu, gpu):
        Trainer(config).run()
    on_cpu, on_gpu = float_datasets(cpu), float_datasets(gpu)
    assert on_cpu.keys() == on_gpu.keys()
    assert len([n for n in on_cpu if n.startswith("embeddings_")]) == 5
    for name, expected in on_cpu.items():
        difference = np.abs(on_gpu[name] - expected).max()
        assert difference < 1e-3, f"{name}: largest difference {difference:.3g}"
