# Bad: a PBG config module must define get_torchbiggraph_config().
config = dict(dimension=16)
