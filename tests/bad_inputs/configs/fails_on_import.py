# Bad: the module fails while it is imported (a name that is never defined).
DIMENSION = dimension * 2
