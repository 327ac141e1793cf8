"""The workload models, plain ``nn.Module``s; ``hybridpar.spatial.parallelize`` makes them spatially parallel.

``MODELS`` maps a config's ``model.name`` to its factory.
"""

from hybridpar.models.cosmoflow import CosmoFlow, cosmoflow
from hybridpar.models.unet3d import UNet3D, unet3d

MODELS = {"cosmoflow": cosmoflow, "unet3d": unet3d}

__all__ = ["CosmoFlow", "MODELS", "UNet3D", "cosmoflow", "unet3d"]
