"""tensorboard_dir: the trainer logs loss and held-out metrics per bucket and per epoch."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pbg_ray.config import ConfigSchema
from pbg_ray.training.trainer import Trainer
from tests.util import config_dict, write_random_graph


def test_trainer_writes_tensorboard_scalars(ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(
        tmp_path, num_epochs=2, eval_fraction=0.2, eval_num_batch_negs=10,
        eval_num_uniform_negs=10, tensorboard_dir=str(tmp_path / "tb")))
    write_random_graph(config, num_edges=200)
    result = Trainer(config).run()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"bucket/loss", "bucket/held_out_mrr", "bucket/held_out_r10", "epoch/loss",
            "epoch/held_out_mrr", "epoch/held_out_auc"} <= tags
    # One point per bucket (4 buckets x 2 epochs), at its index in training_stats.json.
    bucket_loss = events.Scalars("bucket/loss")
    assert [e.step for e in bucket_loss] == sorted(s["index"] for s in result.bucket_stats)
    assert [e.step for e in events.Scalars("epoch/held_out_mrr")] == [1, 2]
    assert all(0 < e.value <= 1 for e in events.Scalars("epoch/held_out_mrr"))
    last = [s for s in result.bucket_stats if s["index"] == bucket_loss[-1].step][0]
    assert bucket_loss[-1].value == pytest.approx(last["stats"]["metrics"]["loss"], rel=1e-5)


def test_no_tensorboard_dir_writes_no_events(ray_session, tmp_path):
    config = ConfigSchema.from_dict(config_dict(tmp_path, num_epochs=1))
    write_random_graph(config, num_edges=50)
    Trainer(config).run()
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
