"""A worker node that holds a partition store and runs train tasks goes away mid-epoch on a
three-node cluster: the run finishes on the nodes left, every bucket of every pass is
trained once in the checkpoint's stats, the checkpoints are complete, and the final loss
and filtered MRR are within the run-to-run spread of undisturbed runs, in memory and in
disk placement."""

from pathlib import Path

import pytest

from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.distributed import evaluate_checkpoint
from pbg_ray.evaluation.metrics import ALL
from pbg_ray.training.trainer import Trainer
from tests.fault_injection import (
    edges_lost_or_doubled, epoch_losses, left_behind, lose_nodes, own_processes)
from tests.util import assert_valid_checkpoint, config_dict, write_random_graph

pytestmark = [pytest.mark.multinode, pytest.mark.faults, pytest.mark.slow]

EPOCHS = 2
PLACEMENTS = ("memory", "disk")
PARTITIONS = {"user": {"num_partitions": 4}, "item": {"num_partitions": 4},
              "tag": {"num_partitions": 1}}


SEEDS = (0, 1, 2, 3)  # of the undisturbed runs; the runs that lose a node have the first


def graph_config(root, name, seed=SEEDS[0], **overrides):
    return config_dict(root, checkpoint_path=str(root / name), num_epochs=EPOCHS,
                       eval_fraction=0.0, entities=PARTITIONS, seed=seed, **overrides)


def final_mrr(config: ConfigSchema) -> float:
    """The filtered MRR of the final checkpoint, on the training edges."""
    return evaluate_checkpoint(config)["metrics"][ALL]["filtered"]["mrr"]


@pytest.fixture(scope="module")
def graph(tmp_path_factory, ray_session):
    """The graph, and per placement the (final loss, filtered MRR) of undisturbed runs of
    it on the session's Ray, one per seed of SEEDS. (Placements train the same buckets in
    different orders when trainers run side by side: disk placement takes each trainer's
    next bucket early, to read it ahead.)"""
    root = tmp_path_factory.mktemp("node_loss")
    undisturbed = {placement: [] for placement in PLACEMENTS}
    for placement in PLACEMENTS:
        for seed in SEEDS:
            config = ConfigSchema.from_dict(graph_config(
                root, f"undisturbed-{placement}-{seed}", seed,
                ray={"num_trainers": 2, "placement": placement}))
            if not (root / "edges").exists():
                write_random_graph(config, num_edges=1000)
            losses = epoch_losses(Trainer(config).run().bucket_stats, EPOCHS)
            undisturbed[placement].append((losses[-1], final_mrr(config)))
    return root, undisturbed


@pytest.fixture(scope="module")
def lost(graph):
    """Placement -> (config dict, summary) of a run on a three-node cluster that lost a
    worker node at the 6th of the first pass's 16 buckets (some applied, some in flight);
    both placements on one cluster, one after the other. "left running": the processes
    of the cluster (the lost nodes' too) alive once its driver ended (left_behind)."""
    root, _ = graph
    runs = {placement: graph_config(root, placement,
                                    ray={"num_trainers": 2, "placement": placement})
            for placement in PLACEMENTS}
    before = {proc.pid for proc in own_processes()}
    summaries = lose_nodes([(data, 6) for data in runs.values()])
    lost = {placement: (runs[placement], summary)
            for placement, summary in zip(runs, summaries)}
    lost["left running"] = left_behind(before, [Path(s["session_dir"]) for s in summaries])
    return lost


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_node_lost_mid_epoch_costs_nothing_of_the_result(graph, lost, placement):
    _, undisturbed = graph
    data, summary = lost[placement]
    assert summary["node_removed"] and summary.get("node_ran_the_task"), summary
    # Its partition store died with it: the actors came back from the last version.
    assert summary["actor_restarts"] >= 1
    assert summary["nodes_alive"] == 2 and summary["version"] == EPOCHS
    config = ConfigSchema.from_dict(data)
    assert_valid_checkpoint(config, EPOCHS)
    assert edges_lost_or_doubled(config) == 0
    # Buckets train in another order after the loss, so the result is not the undisturbed
    # run's, but no further from the undisturbed runs than they are from each other.
    results = [(summary["epoch_losses"][-1], "loss"), (final_mrr(config), "filtered MRR")]
    for i, (got, name) in enumerate(results):
        runs = [run[i] for run in undisturbed[placement]]
        spread = max(runs) - min(runs)
        assert min(runs) - spread <= got <= max(runs) + spread, (name, got, runs)


def test_a_lost_node_leaves_no_process_running(lost):
    # The lost nodes' actors and tasks went with them, and the cluster's other processes
    # with its end.
    assert lost["left running"] == []
