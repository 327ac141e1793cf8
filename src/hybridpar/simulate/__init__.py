"""Predicted scaling to thousands of devices: the planner's best plan per family of strategies at each
device count (weak or strong scaling), as points for tables and JSON, and as a PNG figure.

Pure but for :func:`plot`, which writes the PNG. ``hybridpar simulate`` is the command line.
"""

from hybridpar.simulate.plot import plot
from hybridpar.simulate.scaling import MODES, Point, default_families, family_name, global_batches, scaling

__all__ = ["MODES", "Point", "default_families", "family_name", "global_batches", "plot", "scaling"]
