def get_torchbiggraph_config():
    return dict(
        entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 1}},
        relations=[
            {"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"},
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "diagonal"},
        ],
        entity_path="data/entities",
        edge_paths=["data/train"],
        checkpoint_path="model",
        dimension=50, comparator="dot", loss_fn="softmax",
        lr=0.1, num_epochs=5, batch_size=1000, num_batch_negs=50, num_uniform_negs=50,
        eval_fraction=0.05,  # held out of each bucket: metrics in training_stats.json
    )
