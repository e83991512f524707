# Bad: 'lrr' is not a key (a typo of 'lr').
def get_torchbiggraph_config():
    return dict(entities={"user": {"num_partitions": 2}, "item": {"num_partitions": 1}}, relations=[{"name": "follows", "lhs": "user", "rhs": "user", "operator": "translation"}, {"name": "likes", "lhs": "user", "rhs": "item"}], dimension=16, entity_path="data/entities", edge_paths=["data/edges"], checkpoint_path="model", lrr=0.1)
