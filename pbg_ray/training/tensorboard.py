"""TensorBoard scalars of a training run (opt-in: the config's tensorboard_dir).

Tags: `bucket/loss` and `bucket/held_out_<metric>` per bucket (step: the bucket's index in
training_stats.json, so a resumed run continues the curve), `epoch/loss` and
`epoch/held_out_<metric>` per epoch (step: epochs done). Held-out metrics are PBG's
sampled ones on each bucket's eval_fraction edges. Only the driver writes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pbg_ray.training.stats import HELD_OUT, TRAIN, bucket_means, epoch_means


class TensorBoardLog:
    """A context manager; does nothing when `log_dir` is None."""

    def __init__(self, log_dir: Optional[str]) -> None:
        self.writer = None
        if log_dir is not None:
            from tensorboardX import SummaryWriter  # imported only when asked for

            self.writer = SummaryWriter(log_dir)

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.writer is not None:
            self.writer.close()

    def _scalars(self, prefix: str, step: int, train: Dict[str, float],
                 held_out: Optional[Dict[str, float]]) -> None:
        if "loss" in train:
            self.writer.add_scalar(f"{prefix}/loss", train["loss"], step)
        for name, value in (held_out or {}).items():
            self.writer.add_scalar(f"{prefix}/held_out_{name}", value, step)

    def log_buckets(self, lines: List[Dict[str, Any]]) -> None:
        """One point per bucket line (training_stats.json's layout)."""
        if self.writer is None:
            return
        held_out = dict(bucket_means(lines, HELD_OUT))
        for index, train in bucket_means(lines, TRAIN):
            self._scalars("bucket", index, train, held_out.get(index))
        self.writer.flush()

    def log_epoch(self, epoch_idx: int, lines: List[Dict[str, Any]]) -> None:
        """One point for the epoch from all of its bucket lines."""
        if self.writer is None:
            return
        train = epoch_means(lines, TRAIN).get(epoch_idx, {})
        self._scalars("epoch", epoch_idx + 1, train, epoch_means(lines, HELD_OUT).get(epoch_idx))
        self.writer.flush()
