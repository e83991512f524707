"""The math of one bucket: PBG's scoring, losses, negatives and optimizers in PyTorch (on
the CPU: random-row gathers, RowAdagrad steps and the softmax loss in C, rows.py and
losses.py; batched products through numpy's BLAS, blas.py).

Never imports Ray: the engine calls these functions from its tasks, tests call them directly.
"""

from pbg_ray.model.kernel import evaluate_bucket, train_bucket
from pbg_ray.model.params import (
    KnownRows,
    ModelParams,
    PartitionKey,
    init_params,
    init_partition,
    params_from_checkpoint,
    params_to_checkpoint,
)

__all__ = [
    "KnownRows", "ModelParams", "PartitionKey", "evaluate_bucket", "init_params", "init_partition",
    "params_from_checkpoint", "params_to_checkpoint", "train_bucket",
]
