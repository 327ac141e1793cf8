"""hybridpar: hybrid-parallel training of deep networks on PyTorch."""

__version__ = "0.1.0"
