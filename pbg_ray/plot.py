"""python -m pbg_ray.plot [CHECKPOINT_PATH] [--output PNG]

Draws a run's training_stats.json (pbg_ray's or torchbiggraph's) into a PNG: per epoch,
the mean training loss and the held-out metrics (PBG's sampled MRR and hits@1/10/50 on
each bucket's eval_fraction edges); per bucket, the same over the run's buckets in
training order, with the epochs' boundaries. Without CHECKPOINT_PATH: the demo's. Default
output: <checkpoint_path>/training_stats.png. Needs matplotlib (pip install "pbg-ray[plot]").
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.cli import command_parser, report_errors
from pbg_ray.errors import PbgRayError
from pbg_ray.importer.demo import demo_checkpoint_path
from pbg_ray.io.files import atomic_path
from pbg_ray.training.stats import HELD_OUT, TRAIN, bucket_means, epoch_means

RANK_METRICS = ("mrr", "r1", "r10", "r50")  # held-out, all in [0, 1]: one axis
EXAMPLES = (
    "python -m pbg_ray.plot                        # the demo's run",
    "python -m pbg_ray.plot model -o model.png",
)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PbgRayError("python -m pbg_ray.plot needs matplotlib. Install it with "
                          "pip install \"pbg-ray[plot]\" (or pip install matplotlib).") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    return plt, MaxNLocator


def plot_stats(lines: List[Dict[str, Any]], output: str, title: str) -> None:
    """Write the PNG of training_stats.json's `lines` to `output`."""
    plt, MaxNLocator = _pyplot()
    fig, ((loss_epoch, held_epoch), (loss_bucket, held_bucket)) = plt.subplots(
        2, 2, figsize=(12, 8), constrained_layout=True)
    fig.suptitle(title)
    train = epoch_means(lines, TRAIN)
    held_out = epoch_means(lines, HELD_OUT)
    epochs = [e + 1 for e in train]
    loss_epoch.plot(epochs, [m.get("loss") for m in train.values()], "o-")
    loss_epoch.set(title="training loss per epoch", xlabel="epoch", ylabel="loss per edge")
    _metric_lines(held_epoch, [e + 1 for e in held_out], list(held_out.values()), "o-")
    held_epoch.set(title="held-out metrics per epoch", xlabel="epoch")
    for axis in (loss_epoch, held_epoch):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))

    buckets = bucket_means(lines, TRAIN)
    loss_bucket.plot([i for i, _ in buckets], [m.get("loss") for _, m in buckets], ".-", lw=0.8)
    loss_bucket.set(title="training loss per bucket", xlabel="bucket (training order)",
                    ylabel="loss per edge")
    held_buckets = bucket_means(lines, HELD_OUT)
    _metric_lines(held_bucket, [i for i, _ in held_buckets], [m for _, m in held_buckets], ".-")
    held_bucket.set(title="held-out metrics per bucket", xlabel="bucket (training order)")
    for axis in (loss_bucket, held_bucket):  # where each epoch starts
        for index in _epoch_starts(lines)[1:]:
            axis.axvline(index - 0.5, color="grey", lw=0.5, ls=":")
    with atomic_path(output) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def _metric_lines(axis, xs: List[int], metrics: List[Dict[str, float]], style: str) -> None:
    if not metrics:
        axis.text(0.5, 0.5, "no held-out edges (eval_fraction=0)", ha="center",
                  transform=axis.transAxes)
        return
    for name in RANK_METRICS:
        if name in metrics[0]:
            axis.plot(xs, [m[name] for m in metrics], style, label=name)
    axis.set_ylim(0, 1)
    axis.legend()


def _epoch_starts(lines: List[Dict[str, Any]]) -> List[int]:
    first: Dict[int, int] = {}
    for line in lines:
        first[line["epoch_idx"]] = min(first.get(line["epoch_idx"], line["index"]), line["index"])
    return sorted(first.values())


@report_errors
def main(argv: Optional[List[str]] = None) -> None:
    parser = command_parser(__doc__, EXAMPLES, reference=(
        "training_stats.json's lines: docs/formats.md; TensorBoard instead: tensorboard_dir=DIR"))
    parser.add_argument("checkpoint_path", nargs="?", default=demo_checkpoint_path(),
                        help="a checkpoint directory holding training_stats.json "
                             "(default: the demo's)")
    parser.add_argument("--output", "-o", help="PNG to write (default: "
                        "<checkpoint_path>/training_stats.png)")
    args = parser.parse_args(argv)
    checkpoint = CheckpointManager(args.checkpoint_path)
    lines = [line for line in checkpoint.read_stats() if "index" in line]
    if not lines:
        raise PbgRayError(f"{str(checkpoint.stats_file())!r} is missing or holds no bucket stats: "
                          "nothing to plot. Point at the checkpoint_path of a run that trained.")
    output = args.output or str(checkpoint.path / "training_stats.png")
    plot_stats(lines, output, f"{checkpoint.path}")
    print(output)


if __name__ == "__main__":
    main()
