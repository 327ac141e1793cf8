"""The workload models, plain ``nn.Module``s; ``hybridpar.spatial.parallelize`` makes the volumetric ones
(CosmoFlow, UNet3D) spatially parallel, and GPT is meant for tensor and pipeline parallelism.

``MODELS`` maps a config's ``model.name`` to its factory.
"""

from hybridpar.models.cosmoflow import CosmoFlow, cosmoflow
from hybridpar.models.gpt import GPT, GPT_PRESETS, GPTConfig, gpt, gpt_config
from hybridpar.models.unet3d import UNet3D, unet3d

MODELS = {"cosmoflow": cosmoflow, "unet3d": unet3d, "gpt": gpt}

__all__ = ["GPT", "GPT_PRESETS", "CosmoFlow", "GPTConfig", "MODELS", "UNet3D", "cosmoflow", "gpt", "gpt_config",
           "unet3d"]
