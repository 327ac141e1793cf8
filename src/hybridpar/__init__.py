"""hybridpar: hybrid-parallel training of deep networks on PyTorch.

``hybridpar.parallelize(model, plan, mesh, *, loss_fn)`` applies a plan (``hybridpar.plan``) to an ordinary
model; it is imported on first use, so that ``import hybridpar`` stays light.
"""

__version__ = "0.1.0"
__all__ = ["ParallelModel", "parallelize"]


def __getattr__(name: str):
    if name in __all__:
        from hybridpar.parallel import apply

        return getattr(apply, name)
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")
