"""The model IR: what the planner and the runtime share about a model, analysed once.

- ``graph``: the layer graph from one trace of the model on the meta device (pure records);
- ``rules``: what runs exactly (views, slabs, splits, regions, cuts), read by the analysis, the search,
  ``validate``, the runtime's check and the runtime itself;
- ``types``: the ``Plan`` (and its ``Prediction``), the one contract between planner and runtime;
- ``check``: every rule of a plan against a graph, in one function (``check(plan, graph)``);
- ``analysis`` (with ``trace``, ``calls`` and ``meta``): the one part that uses torch, imported on first use.

The IR imports no module of the planner's search and no runtime module.
"""

from hybridpar.ir.graph import CONST, INPUT, PARAM, BlockArg, BlockCall, Layer, ModelGraph, Read
from hybridpar.ir.types import Plan, Prediction

LAZY = ("analyse", "blocks", "graph_of", "input_dtype_of")  # the analysis imports torch: loaded on first use


def __getattr__(name: str):
    if name in LAZY:
        from hybridpar.ir import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module 'hybridpar.ir' has no attribute {name!r}")


__all__ = ["CONST", "INPUT", "PARAM", "BlockArg", "BlockCall", "Layer", "ModelGraph", "Plan", "Prediction", "Read",
           *LAZY]
