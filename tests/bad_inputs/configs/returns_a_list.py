# Bad: get_torchbiggraph_config() must return a dict.
def get_torchbiggraph_config():
    return [("dimension", 16)]
