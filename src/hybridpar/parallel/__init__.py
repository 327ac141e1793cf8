"""Thin adapters over PyTorch's own parallel engines."""

from hybridpar.parallel.data import data_parallel

__all__ = ["data_parallel"]
