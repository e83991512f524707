"""FB15k (Freebase, 14,951 entities, 1,345 relations, 483,142 training edges) with
ComplEx, as PyTorch-BigGraph's fb15k example trains it (its fb15k_config.py), plus
the pbg_ray sections that import and evaluate it. One module serves every step:

    python -m pbg_ray.import_edges examples/fb15k/config.py
    python -m pbg_ray.train examples/fb15k/config.py
    python -m pbg_ray.eval examples/fb15k/config.py

Data lives in $PBG_RAY_DATA (default: examples/fb15k/data), where download.sh puts it.
"""

import os

DATA = os.environ.get("PBG_RAY_DATA") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "data")
RAW = os.path.join(DATA, "FB15k")


def get_torchbiggraph_config():
    return dict(
        # I/O data: the importer writes entity_path and one edge path per input file.
        entity_path=f"{DATA}/graph/entities",
        edge_paths=[f"{DATA}/graph/train"],
        eval_edge_paths=[f"{DATA}/graph/valid", f"{DATA}/graph/test"],
        checkpoint_path=f"{DATA}/model",
        # Graph structure: one entity type, relation types read from the data.
        entities={"all": {"num_partitions": 1}},
        relations=[{"name": "all_edges", "lhs": "all", "rhs": "all",
                    "operator": "complex_diagonal"}],
        dynamic_relations=True,
        # Scoring model
        dimension=400,
        global_emb=False,
        comparator="dot",
        # Training
        num_epochs=50,
        num_uniform_negs=1000,
        loss_fn="softmax",
        lr=0.1,
        eval_fraction=0,  # PBG: every training edge is used to reproduce the results
        # pbg_ray: the raw files (lhs, relation, rhs; tab-separated), in the order
        # edge_paths then eval_edge_paths.
        importer={"inputs": [f"{RAW}/freebase_mtr100_mte100-{split}.txt"
                             for split in ("train", "valid", "test")],
                  "lhs_col": 0, "rel_col": 1, "rhs_col": 2},
        # pbg_ray: filtered ranking of the test edges against every entity, on both sides,
        # the edges of train, valid and test left out of the candidates.
        eval={"edge_paths": [f"{DATA}/graph/test"]},
    )
