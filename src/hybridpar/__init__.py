"""hybridpar: hybrid-parallel training of deep networks on PyTorch.

``hybridpar.parallelize(model, plan, mesh, *, loss_fn)`` applies a plan (``hybridpar.plan``) to an ordinary
model; ``hybridpar.verify(model, plan, batch, loss_fn=...)`` proves a plan on a model against one process (one
float64 step). Both are imported on first use, so that ``import hybridpar`` stays light.
"""

__version__ = "0.1.0"
__all__ = ["ParallelModel", "parallelize", "verify"]


def __getattr__(name: str):
    if name == "verify":
        from hybridpar.verification import verify

        return verify
    if name in __all__:
        from hybridpar.parallel import apply

        return getattr(apply, name)
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")
