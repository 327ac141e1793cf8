"""Where a tensor that a layer reads comes from, besides a layer (``graph.Read.source``): pure constants that the
graph and the rules share."""

INPUT = -1  # the model input
PARAM = -2  # a parameter read by an operation
CONST = -3  # a tensor made of constants (no layer made it)
