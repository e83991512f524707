"""pbg_ray and torchbiggraph 1.0.0 read each other's files."""

import io

import numpy as np
import pytest
import torch
from torchbiggraph.checkpoint_manager import CheckpointManager
from torchbiggraph.config import ConfigSchema as PbgConfigSchema
from torchbiggraph.converters.export_to_tsv import make_tsv
from torchbiggraph.converters.import_from_tsv import convert_input_data
from torchbiggraph.graph_storages import FileEdgeStorage, FileEntityStorage
from torchbiggraph.model import make_model
from torchbiggraph.row_adagrad import RowAdagrad

from pbg_ray.checkpoints.directory import CheckpointStorage, row_adagrad_state, row_adagrad_sums
from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import count_edges, read_edges
from pbg_ray.io.entities import load_entity_count, load_entity_names
from pbg_ray.types import Bucket
from tests.oracle import pbg_config
from tests.util import config_dict, write_random_graph

pytestmark = pytest.mark.oracle


def test_torchbiggraph_reads_our_edges_and_entities(make_config):
    config = make_config()
    written = write_random_graph(config)
    entities = FileEntityStorage(config.entity_path)
    assert entities.load_count("item", 1) == 21
    assert entities.load_names("tag", 0)[:2] == ["tag-0-0", "tag-0-1"]
    storage = FileEdgeStorage(config.edge_paths[0])
    for bucket, edges in written.items():
        assert storage.get_number_of_edges(*bucket) == len(edges)
        theirs = storage.load_chunk_of_edges(bucket.lhs, bucket.rhs, 1, 3)
        ours = read_edges(config.edge_paths[0], bucket, 1, 3)
        np.testing.assert_array_equal(theirs.lhs.to_tensor().numpy(), ours.lhs)
        np.testing.assert_array_equal(theirs.rhs.to_tensor().numpy(), ours.rhs)
        np.testing.assert_array_equal(theirs.rel.numpy(), ours.rel)


def test_we_read_torchbiggraph_import_from_tsv(tmp_path):
    rng = np.random.default_rng(0)
    tsv = tmp_path / "edges.tsv"
    names = [f"n{i}" for i in range(40)]
    rels = ["follows", "likes"]
    lines = [f"{names[rng.integers(40)]}\t{rels[rng.integers(2)]}\t{names[rng.integers(40)]}"
             for _ in range(500)]
    tsv.write_text("\n".join(lines) + "\n")
    data = config_dict(tmp_path, entities={"node": {"num_partitions": 2}},
                       relations=[{"name": r, "lhs": "node", "rhs": "node"} for r in rels])
    pbg = PbgConfigSchema.from_dict({k: v for k, v in data.items()})
    convert_input_data(pbg.entities, pbg.relations, pbg.entity_path, pbg.edge_paths, [tsv],
                       lhs_col=0, rhs_col=2, rel_col=1)

    names_by_part = [load_entity_names(pbg.entity_path, "node", p) for p in range(2)]
    assert [load_entity_count(pbg.entity_path, "node", p) for p in range(2)] == [len(n) for n in names_by_part]
    assert sorted(sum(names_by_part, [])) == sorted(set(n for line in lines for n in line.split("\t")[::2]))
    decoded = []
    for lhs_p in range(2):
        for rhs_p in range(2):
            bucket = Bucket(lhs_p, rhs_p)
            edges = read_edges(pbg.edge_paths[0], bucket)
            assert count_edges(pbg.edge_paths[0], bucket) == len(edges)
            decoded += [f"{names_by_part[lhs_p][l]}\t{rels[r]}\t{names_by_part[rhs_p][h]}"
                        for l, r, h in zip(edges.lhs, edges.rel, edges.rhs)]
    assert sorted(decoded) == sorted(lines)


def write_checkpoint(config: ConfigSchema, rng) -> dict:
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    storage.save_config(config)
    arrays = {}
    for entity, econf in config.entities.items():
        for part in range(econf.num_partitions):
            n = 5 + part
            embs = rng.standard_normal((n, config.dimension)).astype(np.float32)
            sums = rng.random(n).astype(np.float32)
            storage.save_entity_partition(1, entity, part, embs, row_adagrad_state(sums, config.lr))
            arrays[entity, part] = embs, sums
    params = {"relations/0/operator/rhs/translation": rng.standard_normal(8).astype(np.float32),
              "relations/1/operator/rhs/diagonal": rng.standard_normal(8).astype(np.float32)}
    params.update({f"entities/{e}/global_embedding": rng.standard_normal(8).astype(np.float32)
                   for e in config.entities})
    storage.save_model(1, params, None)
    storage.save_version(1)
    return {"partitions": arrays, "params": params}


def test_torchbiggraph_loads_our_checkpoint_and_exports_it(make_config, tmp_path):
    config = make_config()
    write_random_graph(config)
    expected = write_checkpoint(config, np.random.default_rng(0))

    manager = CheckpointManager(config.checkpoint_path)
    assert manager.checkpoint_version == 1
    embs, optim_state = manager.read("item", 1)
    np.testing.assert_array_equal(embs.numpy(), expected["partitions"]["item", 1][0])
    optimizer = RowAdagrad([torch.nn.Parameter(embs)], lr=config.lr)
    optimizer.load_state_dict(optim_state)  # PBG resumes with our optimizer state
    np.testing.assert_array_equal(next(iter(optimizer.state.values()))["sum"].numpy(),
                                  expected["partitions"]["item", 1][1])

    state_dict, _ = manager.read_model()
    model = make_model(pbg_config(config))
    model.load_state_dict(state_dict, strict=False)
    np.testing.assert_array_equal(model.rhs_operators[1].diagonal.detach().numpy(),
                                  expected["params"]["relations/1/operator/rhs/diagonal"])
    np.testing.assert_array_equal(model.global_embs["emb_user"].detach().numpy(),
                                  expected["params"]["entities/user/global_embedding"])

    entities_tsv, relations_tsv = io.StringIO(), io.StringIO()
    make_tsv(pbg_config(config), entities_tsv, relations_tsv)
    rows = {line.split("\t")[0]: np.array(line.split("\t")[1:], dtype=np.float32)
            for line in entities_tsv.getvalue().splitlines()}
    np.testing.assert_allclose(
        rows["user-1-3"], expected["partitions"]["user", 1][0][3]
        + expected["params"]["entities/user/global_embedding"], rtol=1e-6)
    assert len(rows) == sum(5 + p for e in config.entities.values() for p in range(e.num_partitions))
    assert "follows\trhs\ttranslation\ttranslation\t8" in relations_tsv.getvalue()


def test_we_load_a_torchbiggraph_checkpoint(make_config):
    config = make_config()
    manager = CheckpointManager(config.checkpoint_path)
    embs = torch.randn(6, 8)
    optimizer = RowAdagrad([torch.nn.Parameter(embs)], lr=0.1)
    optimizer.state[optimizer.param_groups[0]["params"][0]]["sum"] += 0.5
    manager.write("user", 1, embs, optimizer.state_dict())
    model = make_model(pbg_config(config))
    with torch.no_grad():
        model.rhs_operators[0].translation.fill_(0.25)
    manager.write_model({k: v for k, v in model.state_dict().items()
                         if not k.startswith(("lhs_embs", "rhs_embs"))}, None)
    manager.write_new_version(pbg_config(config))
    manager.switch_to_new_version()

    storage = CheckpointStorage(config.checkpoint_path)
    assert storage.load_version() == 1
    loaded, state = storage.load_entity_partition(1, "user", 1)
    np.testing.assert_array_equal(loaded, embs.numpy())
    np.testing.assert_array_equal(row_adagrad_sums(state, 6, "x"), np.full(6, 0.5, np.float32))
    params, _ = storage.load_model(1)
    np.testing.assert_array_equal(params["relations/0/operator/rhs/translation"], np.full(8, 0.25))
    assert "entities/item/global_embedding" in params
