"""LiveJournal (SNAP soc-LiveJournal1: 4.8M users, 69M follow edges), as
PyTorch-BigGraph's livejournal example trains it (its livejournal_config.py), plus
the pbg_ray sections that import and evaluate it. One module serves every step:

    python -m pbg_ray.import_edges examples/livejournal/config.py
    python -m pbg_ray.train examples/livejournal/config.py
    python -m pbg_ray.eval examples/livejournal/config.py

Data lives in $PBG_RAY_DATA (default: examples/livejournal/data), where download.sh
and split.py put it. One partition (PBG's setting) holds 4.8M x 1024 float32
embeddings, about 20 GB; PBG_RAY_PARTITIONS=8 (set for the import and every later
step) splits them so that ray.placement=disk trains on a smaller machine.
"""

import os

DATA = os.environ.get("PBG_RAY_DATA") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "data")
NUM_PARTITIONS = int(os.environ.get("PBG_RAY_PARTITIONS", "1"))


def get_torchbiggraph_config():
    return dict(
        # I/O data: the importer writes entity_path and one edge path per input file.
        entity_path=f"{DATA}/graph/entities",
        edge_paths=[f"{DATA}/graph/train"],
        eval_edge_paths=[f"{DATA}/graph/test"],
        checkpoint_path=f"{DATA}/model",
        # Graph structure
        entities={"user_id": {"num_partitions": NUM_PARTITIONS}},
        relations=[{"name": "follow", "lhs": "user_id", "rhs": "user_id", "operator": "none"}],
        # Scoring model
        dimension=1024,
        global_emb=False,
        # Training
        num_epochs=30,
        lr=0.001,
        # pbg_ray: split.py's 75% / 25% split of the edges (follower, followed).
        importer={"inputs": [f"{DATA}/train.parquet", f"{DATA}/test.parquet"],
                  "lhs_col": "src", "rel_col": None, "rhs_col": "dst"},
        # pbg_ray: PBG's script evaluates the test edges with its sampled ranking (1000
        # batch + 1000 uniform negatives); filtered ranking against all 4.8M users is
        # far too slow for a graph this size.
        eval={"filtered": False},
    )
