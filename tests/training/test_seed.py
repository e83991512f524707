"""The `seed` key: one train task of one thread writes the same checkpoint on every run,
and the seed decides it; each bucket's draws follow the pass."""

from pathlib import Path
from typing import Dict

import h5py
import numpy as np

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.training.bucket_task import task_seed
from pbg_ray.training.trainer import Trainer
from pbg_ray.types import Bucket
from tests.util import config_dict, write_random_graph


def seeded_config(tmp_path, name: str, seed: int) -> ConfigSchema:
    return ConfigSchema.from_dict(config_dict(
        tmp_path, checkpoint_path=str(tmp_path / name), seed=seed, num_epochs=1,
        bucket_order="random", eval_fraction=0.1, eval_num_batch_negs=5, eval_num_uniform_negs=5,
        comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True,
        ray={"num_trainers": 1, "cpus_per_trainer": 1}))


def hdf5_datasets(config: ConfigSchema) -> Dict[str, bytes]:
    """The bytes of every dataset of the current version's embeddings and model files."""
    version = CheckpointStorage(config.checkpoint_path).load_version()
    datasets: Dict[str, bytes] = {}
    for path in sorted(Path(config.checkpoint_path).glob(f"*.v{version}.h5")):
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: datasets.__setitem__(
                f"{path.name}/{name}", np.asarray(obj[()]).tobytes())
                if isinstance(obj, h5py.Dataset) else None)
    return datasets


def test_one_thread_runs_of_one_seed_write_identical_checkpoints(ray_session, tmp_path):
    first = seeded_config(tmp_path, "first", seed=5)
    write_random_graph(first, num_edges=150)
    runs = {}
    for config in (first, seeded_config(tmp_path, "again", 5), seeded_config(tmp_path, "other", 6)):
        Trainer(config).run()
        runs[Path(config.checkpoint_path).name] = hdf5_datasets(config)
    assert any(name.startswith("model.") for name in runs["first"])
    assert len([n for n in runs["first"] if n.startswith("embeddings_")]) >= 5 * 2
    assert runs["again"] == runs["first"]
    differ = [n for n in runs["first"] if n.startswith("embeddings_")
              and runs["other"][n] != runs["first"][n]]
    assert len(differ) == len([n for n in runs["first"] if n.startswith("embeddings_")])


def test_each_pass_and_bucket_draws_from_its_own_seed(tmp_path):
    config = seeded_config(tmp_path, "c", seed=5)
    seeds = {task_seed(config, i, b) for i in range(3) for b in (Bucket(0, 1), Bucket(1, 0))}
    assert len(seeds) == 6 and task_seed(config, 2, Bucket(1, 0)) in seeds
    assert task_seed(seeded_config(tmp_path, "c", seed=6), 0, Bucket(0, 1)) not in seeds
