"""Evaluation: filtered ranks equal a brute-force reference (ties included), sampled
metrics equal torchbiggraph_eval's with all_negs, and python -m pbg_ray.eval's outputs."""

import dataclasses
import json

import numpy as np
import psutil
import pytest
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.checkpoints.manager import CheckpointManager
from pbg_ray.checkpoints.sources import CheckpointSource
from pbg_ray.config import ConfigSchema
from pbg_ray.errors import PbgRayError
from pbg_ray.evaluation import filtered
from pbg_ray.evaluation.distributed import (
    RankJob, checkpoint_partitions, evaluate_bucket_task, evaluate_checkpoint, filtered_rank_task,
    gather_rows_task,
    print_report)
from pbg_ray.evaluation.filtered import KnownEdges, rank_counts
from pbg_ray.evaluation.metrics import SampledNegatives
from pbg_ray.evaluation.scoring import Scorer
from pbg_ray.io.edges import read_edges, write_edges
from pbg_ray.io.entities import num_relation_ids
from pbg_ray.model import losses
from pbg_ray.model.params import (
    global_emb_key, operator_key, params_from_checkpoint, partition_keys)
from pbg_ray.training.trainer import Trainer
from pbg_ray.types import Bucket, EdgeList
from tests.util import (
    assert_streams_partitions, config_dict, peak_growth, random_checkpoint, write_random_graph)


def make(tmp_path, **overrides) -> ConfigSchema:
    base = dict(comparator="cos", eval_edge_paths=[str(tmp_path / "test")])
    base.update(overrides)
    return ConfigSchema.from_dict(config_dict(tmp_path, **base))


def write_test_edges(config, num_edges=40, seed=1, counts=None):
    """Test edges in eval_edge_paths[0] (same entities as the training graph)."""
    test = dataclasses.replace(config, edge_paths=config.eval_edge_paths)
    return write_random_graph(test, num_edges=num_edges, seed=seed, counts=counts)


def brute_force_ranks(config, version, edge_path, filter_paths):
    """(relation ids, lhs ranks, rhs ranks) of every edge, bucket by bucket, scoring every
    entity of the type in float64 with the formulas written out (per-relation mode, no
    max_norm, operators none / translation / diagonal, comparators dot / cos)."""
    storage = CheckpointStorage(config.checkpoint_path)
    params, _ = storage.load_model(version)
    nparts = config.num_partitions()

    def table(entity):  # every partition, one after the other, + global embedding
        parts = [storage.load_entity_partition(version, entity, p)[0].astype(np.float64)
                 for p in range(config.entities[entity].num_partitions)]
        starts = np.cumsum([0] + [len(t) for t in parts])
        g = params.get(global_emb_key(entity), 0) if config.global_emb else 0
        return np.concatenate(parts) + g, starts

    def op(rel, x):
        r = config.relations[rel]
        if r.operator == "translation":
            return x + params[operator_key(rel, "rhs", "translation")]
        if r.operator == "diagonal":
            return x * params[operator_key(rel, "rhs", "diagonal")]
        assert r.operator == "none"
        return x

    def cmp(q, k):  # q [D], k [N, D]
        if config.comparator == "cos":
            q, k = q / np.linalg.norm(q), k / np.linalg.norm(k, axis=1, keepdims=True)
        return k @ q

    tables = {e: table(e) for e in config.entities}

    def gid(entity, part, offset):
        p = part if config.entities[entity].num_partitions > 1 else 0
        return tables[entity][1][p] + offset

    known = set()
    for path in filter_paths:
        for l in range(nparts):
            for r in range(nparts):
                e = read_edges(path, Bucket(l, r))
                for a, b, rel in zip(e.lhs, e.rhs, e.rel):
                    rc = config.relations[rel]
                    known.add((gid(rc.lhs, l, a), int(rel), gid(rc.rhs, r, b)))
    rels, lhs_ranks, rhs_ranks = [], [], []
    for l in range(nparts):
        for r in range(nparts):
            e = read_edges(edge_path, Bucket(l, r))
            for a, b, rel in zip(e.lhs, e.rhs, e.rel):
                rc = config.relations[rel]
                (lt, _), (rt, _) = tables[rc.lhs], tables[rc.rhs]
                ga, gb = gid(rc.lhs, l, a), gid(rc.rhs, r, b)
                s_rhs = cmp(lt[ga], op(rel, rt))
                s_lhs = cmp(op(rel, rt[gb]), lt)
                rhs_out = {y for y in range(len(rt)) if (ga, rel, y) in known} | {gb}
                lhs_out = {x for x in range(len(lt)) if (x, rel, gb) in known} | {ga}
                rhs_ranks.append(1 + sum(1 for y in range(len(rt))
                                         if y not in rhs_out and s_rhs[y] >= s_rhs[gb]))
                lhs_ranks.append(1 + sum(1 for x in range(len(lt))
                                         if x not in lhs_out and s_lhs[x] >= s_lhs[ga]))
                rels.append(int(rel))
    return np.array(rels), np.array(lhs_ranks), np.array(rhs_ranks)


@pytest.mark.parametrize("count", ["c", "torch"])
@pytest.mark.parametrize("blocks", [(256, 2048), (3, 4)])
def test_ties_and_block_edges_follow_the_rule(tmp_path, monkeypatch, blocks, count):
    """Integer embeddings, dot: many exact ties; tiny blocks put exclusions on block edges.
    The scores at or above a positive are counted in C, or by torch where C cannot."""
    monkeypatch.setattr(filtered, "QUERY_BLOCK", blocks[0])
    monkeypatch.setattr(filtered, "CANDIDATE_BLOCK", blocks[1])
    if count == "torch":
        monkeypatch.setattr(losses, "count_at_least", lambda *args: False)
    else:
        assert losses._loss is not None, "the C extensions are not built"
    config = make(tmp_path, comparator="dot", global_emb=False,
                  entities={"user": {}, "item": {}, "tag": {}})
    write_random_graph(config, num_edges=60)
    write_test_edges(config)
    random_checkpoint(config, integer=True)
    storage = CheckpointStorage(config.checkpoint_path)
    scorer = Scorer(config, storage.load_model(1)[0])
    tables = {(e, 0): torch.from_numpy(storage.load_entity_partition(1, e, 0)[0])
              for e in config.entities}
    edges = read_edges(config.eval_edge_paths[0], Bucket(0, 0))
    known = KnownEdges(EdgeList.cat([read_edges(p, Bucket(0, 0))
                                     for p in config.edge_paths + config.eval_edge_paths]), 3)
    counts = rank_counts(scorer, Bucket(0, 0), edges, 0, tables, {"lhs": known, "rhs": known})
    rel, lhs, rhs = brute_force_ranks(config, 1, config.eval_edge_paths[0],
                                      config.edge_paths + config.eval_edge_paths)
    np.testing.assert_array_equal(edges.rel, rel)
    np.testing.assert_array_equal(counts["lhs"] + 1, lhs)
    np.testing.assert_array_equal(counts["rhs"] + 1, rhs)
    assert (lhs > 1).any() and (rhs > 1).any()


def test_filtered_ranks_over_partitions_match_brute_force(ray_session, tmp_path):
    config = make(tmp_path)
    write_random_graph(config, num_edges=50)
    write_test_edges(config)
    random_checkpoint(config)
    report = evaluate_checkpoint(config)
    rel, lhs, rhs = brute_force_ranks(config, 1, config.eval_edge_paths[0],
                                      config.edge_paths + config.eval_edge_paths)
    ranks = np.concatenate([lhs, rhs])
    both = np.concatenate([rel, rel])
    for key, mask in [("all", slice(None))] + [(r.name, both == i)
                                               for i, r in enumerate(config.relations)]:
        got = report["metrics"][key]
        assert got["count"] == len(ranks[mask]) // 2
        assert got["filtered"]["mr"] == pytest.approx(ranks[mask].mean())
        assert got["filtered"]["mrr"] == pytest.approx((1 / ranks[mask]).mean())
        assert got["filtered"]["hits@10"] == pytest.approx((ranks[mask] <= 10).mean())
        assert set(got["sampled"]) == {"pos_rank", "mrr", "r1", "r10", "r50", "auc"}
    # Appended as one JSON line per run.
    lines = (tmp_path / "checkpoints" / "eval_stats.json").read_text().splitlines()
    assert json.loads(lines[-1]) == report

    # Unfiltered full ranking: the known edges count again, so ranks can only grow.
    config.eval.filter_paths = []
    config.eval.sampled = False
    raw = evaluate_checkpoint(config)["metrics"]["all"]
    assert "sampled" not in raw and raw["filtered"]["mr"] >= report["metrics"]["all"]["filtered"]["mr"]
    assert len((tmp_path / "checkpoints" / "eval_stats.json").read_text().splitlines()) == 2


def test_edges_naming_some_of_their_buckets_types_rank_as_brute_force(ray_session, tmp_path):
    """Test edges of one relation (user -> user) in buckets whose partitions also hold
    items and tags: each ranking task gets the rows of the partitions its edges name."""
    config = make(tmp_path)
    write_random_graph(config, num_edges=50)
    for bucket, edges in write_test_edges(config).items():
        write_edges(config.eval_edge_paths[0], bucket, edges[np.flatnonzero(edges.rel == 0)])
    random_checkpoint(config)
    report = evaluate_checkpoint(dataclasses.replace(config, eval=dataclasses.replace(
        config.eval, sampled=False)))
    rel, lhs, rhs = brute_force_ranks(config, 1, config.eval_edge_paths[0],
                                      config.edge_paths + config.eval_edge_paths)
    ranks = np.concatenate([lhs, rhs])
    assert report["metrics"]["all"]["count"] == len(rel) > 0 and set(rel) == {0}
    assert report["metrics"]["all"]["filtered"]["mrr"] == pytest.approx((1 / ranks).mean())


def test_disk_placement_evaluates_out_of_core_to_the_same_metrics(ray_session, tmp_path):
    config = make(tmp_path)
    write_random_graph(config, num_edges=50)
    write_test_edges(config)
    random_checkpoint(config)
    in_memory = evaluate_checkpoint(config)["metrics"]
    config.ray.placement = "disk"
    checkpoint = CheckpointManager(config.checkpoint_path)
    given, _ = checkpoint_partitions(config, checkpoint, 1, num_relation_ids(config))
    # No partition goes through the driver or the object store: each task reads its own.
    assert given and all(isinstance(p, CheckpointSource) for p in given.values())
    assert evaluate_checkpoint(config)["metrics"] == in_memory


def test_an_eval_task_scores_alike_whatever_threads_its_worker_kept(tmp_path):
    """A Ray worker keeps the torch and BLAS thread counts that its last task set (a train
    task of ray.cpus_per_trainer=2, say), and they change the rounding of scores, which
    decides ties between a positive and a uniform negative of the same entity (1000 drawn
    from ~30 entities: many; products large enough for BLAS to use its threads). A task
    sets its own, so its figures follow its config."""
    from threadpoolctl import threadpool_limits

    config = make(tmp_path, batch_size=1000, num_batch_negs=1000, num_uniform_negs=1000)
    write_random_graph(config, num_edges=50)
    write_test_edges(config)
    random_checkpoint(config)
    checkpoint = CheckpointManager(config.checkpoint_path)
    num_rel = num_relation_ids(config)
    params = params_from_checkpoint(config, num_rel, *checkpoint.read_model(1))
    bucket = Bucket(0, 0)
    keys = partition_keys(config, bucket)
    on_disk = CheckpointSource(config.checkpoint_path, 1)
    kept = torch.get_num_threads()
    results = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            with threadpool_limits(threads, "blas"):
                results.append(evaluate_bucket_task._function(
                    config, bucket, config.eval_edge_paths[0], num_rel, keys, params,
                    *[on_disk] * len(keys), negatives=SampledNegatives.of_edge_paths(config),
                    per_relation=True))
    finally:
        torch.set_num_threads(kept)
    assert results[0] == results[1]


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("negatives,counts", [
    ({"all_negs": True}, None),
    # Batch negatives only: no draw, so the chunks alone decide the ranks (eval_num_* are
    # PBG's training-time evaluation's, which torchbiggraph_eval does not use). Entities
    # many enough that no chunk holds one twice: a negative that is the positive's own
    # entity ties with it, and the two implementations' rounding breaks such ties apart.
    ({"all_negs": False, "num_batch_negs": 5, "num_uniform_negs": 0, "batch_size": 10,
      "eval_num_batch_negs": 1000, "eval_num_uniform_negs": 1000},
     {"user": 5000, "item": 5000, "tag": 5000})])
def test_sampled_metrics_equal_torchbiggraph_eval(ray_session, tmp_path, monkeypatch, negatives,
                                                  counts):
    negatives = dict(negatives)
    all_negs = negatives.pop("all_negs")
    config = make(tmp_path, comparator="dot", num_epochs=1, eval_fraction=0.0, relations=[
        {"name": n, "lhs": l, "rhs": r, "operator": op, "all_negs": all_negs}
        for n, l, r, op in [("follows", "user", "user", "translation"),
                            ("likes", "user", "item", "diagonal"),
                            ("tagged", "item", "tag", "complex_diagonal")]], **negatives)
    write_random_graph(config, num_edges=80, counts=counts)
    test_edges = write_test_edges(config, num_edges=30, counts=counts)
    if counts:  # the guard of the comment above: every bucket's entities differ per side
        assert all(len(set(getattr(e, side))) == len(e) for e in test_edges.values()
                   for side in ("lhs", "rhs"))
    Trainer(config).run()  # a real checkpoint, trained by the engine
    config.eval.filtered = False
    report = evaluate_checkpoint(config)
    assert SampledNegatives.of_report(report["sampled_negatives"]).describe() == (
        "every entity of the partition (all_negs)" if all_negs else
        "5 batch + 0 uniform negatives (num_batch_negs, num_uniform_negs)")
    ours = report["metrics"]["all"]["sampled"]
    from tests.oracle import torchbiggraph_eval_metrics

    theirs = torchbiggraph_eval_metrics(config, monkeypatch)
    for key in ("pos_rank", "mrr", "r1", "r10", "r50"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-4), key
    assert ours["auc"] == pytest.approx(theirs["auc"], abs=0.2)  # both draw random pairs


def test_the_report_names_the_edge_paths_and_warns_of_training_edges(ray_session, tmp_path,
                                                                     caplog, capsys):
    config = ConfigSchema.from_dict(config_dict(tmp_path))  # no eval_edge_paths
    write_random_graph(config, num_edges=50)
    random_checkpoint(config)
    config.eval.filtered = False
    with caplog.at_level("WARNING", logger="pbg_ray"):
        report = evaluate_checkpoint(config)
    assert report["edge_paths"] == report["training_edge_paths"] == config.edge_paths
    assert "eval scores edges the model was trained on" in caplog.text
    assert "neither eval.edge_paths nor eval_edge_paths is set" in caplog.text
    print_report(report)
    assert f"edge paths {config.edge_paths[0]} (trained on: {config.edge_paths[0]})" in \
        capsys.readouterr().out
    write_test_edges(dataclasses.replace(config, eval_edge_paths=[str(tmp_path / "test")]))
    caplog.clear()
    config.eval.edge_paths = [str(tmp_path / "test")]
    with caplog.at_level("WARNING", logger="pbg_ray"):
        report = evaluate_checkpoint(config)
    assert report["edge_paths"] == config.eval.edge_paths and report["training_edge_paths"] == []
    assert "trained on" not in caplog.text


def test_the_model_is_the_checkpoints_and_another_graph_is_refused(ray_session, tmp_path,
                                                                    caplog):
    """A checkpoint of another model of the config's graph (a Ray Tune trial's sampled
    dimension, say) is evaluated with the model it was trained with, each key that differs
    from the config's named; a checkpoint of another graph is refused in one line."""
    config = make(tmp_path)
    write_random_graph(config, num_edges=50)
    write_test_edges(config)
    trained = dataclasses.replace(config, dimension=12, comparator="dot", relations=[
        dataclasses.replace(config.relations[0], operator="diagonal"), *config.relations[1:]])
    random_checkpoint(trained)
    with caplog.at_level("WARNING", logger="pbg_ray"):
        report = evaluate_checkpoint(config)
    assert report["metrics"] == evaluate_checkpoint(trained)["metrics"]
    assert (f"version 1 of {config.checkpoint_path!r} was trained with dimension=12 (this "
            "config: 8), comparator=dot (this config: cos), relations.0.operator=diagonal "
            "(this config: translation): the model's keys are taken from its config.json"
            ) in caplog.text
    regrouped = dataclasses.replace(config, entities={
        **config.entities, "tag": dataclasses.replace(config.entities["tag"], num_partitions=2)})
    with pytest.raises(PbgRayError, match=r"holds a model of another graph: its entity types "
                                          r"differ from this config's \(.*'tag': "
                                          r"\{'num_partitions': 1.* there, .*'tag': "
                                          r"\{'num_partitions': 2.* here\)"):
        evaluate_checkpoint(regrouped)


def test_the_negatives_of_sampled_figures_are_named_as_they_were_drawn(ray_session, tmp_path,
                                                                       capsys):
    """The same label for the same negatives, in eval's report and train's held-out lines:
    the counts and the keys that set them, except for the relations with all_negs, which
    rank against every entity of the partition whatever the counts say."""
    config = make(tmp_path, relations=[dict(r, all_negs=True) for r in config_dict(
        tmp_path)["relations"]], eval={"filtered": False})
    write_random_graph(config, num_edges=50)
    write_test_edges(config)
    random_checkpoint(config)
    every = "every entity of the partition (all_negs)"
    print_report(evaluate_checkpoint(config))
    assert f"s. = PBG's sampled metrics, as torchbiggraph_eval's: each edge against {every}\n" \
        in capsys.readouterr().out
    assert SampledNegatives.of_held_out(config).describe() == every
    mixed = dataclasses.replace(config, relations=[
        dataclasses.replace(r, all_negs=r.name == "likes") for r in config.relations])
    assert SampledNegatives.of_edge_paths(mixed).describe() == (
        f"5 batch + 5 uniform negatives (num_batch_negs, num_uniform_negs); relations likes: "
        f"{every}")
    assert SampledNegatives.of_held_out(mixed).describe().startswith(
        "10 batch + 10 uniform negatives (eval_num_batch_negs, eval_num_uniform_negs); ")


def test_user_mistakes_get_one_clear_error(ray_session, tmp_path):
    config = make(tmp_path)
    write_random_graph(config)
    with pytest.raises(PbgRayError, match="holds no checkpoint"):
        evaluate_checkpoint(config)
    random_checkpoint(config)
    config.eval.version = 7
    with pytest.raises(PbgRayError, match=r"version 7 is not in .*\[1\]\). Set eval.version"):
        evaluate_checkpoint(config)
    with pytest.raises(PbgRayError, match="eval.hits_at"):
        ConfigSchema.from_dict(config_dict(tmp_path, eval={"hits_at": [0]}))
    featurized = make(tmp_path, entities={"user": {"num_partitions": 2, "featurized": True},
                                          "item": {"num_partitions": 2}, "tag": {}})
    with pytest.raises(PbgRayError, match="featurized"):
        evaluate_checkpoint(featurized)


def eval_tasks_in_process(checkpoint_path):
    """Run by peak_memory: in disk placement, the sampled task of bucket (0, last) and its
    filtered task against the last candidate partition, each reading its partitions."""
    checkpoint = CheckpointManager(checkpoint_path)
    config = checkpoint.read_config()
    config.ray.placement = "disk"
    num_rel = num_relation_ids(config)
    params = params_from_checkpoint(config, num_rel, *checkpoint.read_model(1))
    last = config.entities["node"].num_partitions - 1
    bucket, path = Bucket(0, last), config.edge_paths[0]
    keys = partition_keys(config, bucket)
    on_disk = CheckpointSource(checkpoint_path, 1)
    assert evaluate_bucket_task._function(config, bucket, path, num_rel, keys, params,
                                          *[on_disk] * len(keys),
                                          negatives=SampledNegatives.of_edge_paths(config))
    lhs_rows = gather_rows_task._function(config, ("node", 0),
                                          np.unique(read_edges(path, bucket).lhs), on_disk)
    filtered_rank_task._function(config, [RankJob(bucket, path, 0, 1, last, (path,))], num_rel,
                                 [("node", last)], [("node", 0)], params, on_disk, lhs_rows)


@pytest.mark.slow
def test_eval_task_memory_follows_the_partition_not_the_table(tmp_path):
    assert_streams_partitions(*peak_growth(
        tmp_path, "tests.evaluation.test_evaluation:eval_tasks_in_process",
        lambda config, name: [config.checkpoint_path]))


def test_an_eval_after_training_starts_no_worker_process(ray_session, tmp_path):
    """Eval tasks and partition loads run in train tasks' kind of Ray worker: after a run,
    they take its idle workers, and no new process starts and imports torch again."""
    config = make(tmp_path, num_epochs=1)
    write_random_graph(config)
    write_test_edges(config)
    stats = Trainer(config).run().bucket_stats
    raylet = psutil.Process(stats[0]["worker"]["pid"]).parent()
    before = {p.pid for p in raylet.children()}
    evaluate_checkpoint(config)
    assert {p.pid for p in raylet.children()} <= before
