"""Thin adapters over PyTorch's own parallel engines, and what PyTorch lacks (channel-split convolutions)."""

from hybridpar.parallel.channels import channel_parallel, filter_parallel, gather_parameter
from hybridpar.parallel.data import data_parallel

__all__ = ["channel_parallel", "data_parallel", "filter_parallel", "gather_parameter"]
