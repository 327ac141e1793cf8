"""``hybridpar train``: config, training loop, checkpoints and metrics."""

from hybridpar.train.config import Config, load, parse
from hybridpar.train.loop import train

__all__ = ["Config", "load", "parse", "train"]
