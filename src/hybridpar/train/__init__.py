"""``hybridpar train``: config, the trainer and its tasks, checkpoints and metrics.

The config (``load``, ``parse``) imports no torch, so that a mistake in it is reported at once; the trainer is
imported on first use of ``train``.
"""

from hybridpar.train.config import Config, load, parse

__all__ = ["Config", "load", "parse", "train"]


def __getattr__(name: str):
    if name == "train":
        from hybridpar.train.trainer import train

        return train
    raise AttributeError(f"module 'hybridpar.train' has no attribute {name!r}")
