"""Models by name for the planner and its commands: a built-in workload, a GPT preset or ``pkg.module:factory``,
built on the meta device (no memory) with an example input of the shape given."""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from hybridpar.errors import HybridparError
from hybridpar.ir.analysis import input_dtype_of
from hybridpar.models.cosmoflow import cosmoflow
from hybridpar.models.gpt import GPT_PRESETS, gpt
from hybridpar.models.unet3d import unet3d

VOLUME_MODELS = ("cosmoflow", "unet3d")


def known_names() -> list[str]:
    return [*VOLUME_MODELS, *GPT_PRESETS]


def build_for_planning(name: str, input_shape: tuple[int, ...], input_dtype: str = "auto",
                       device: str = "meta") -> tuple[nn.Module, torch.Tensor]:
    """A meta-device model (or one on ``device``, with its weights: ``hybridpar plan --verify``) and an example input
    of ``input_shape`` (batch first).

    ``cosmoflow`` takes its edge and channels from ``(N, C, S, S, S)``; ``unet3d`` its channels; a GPT preset
    takes token ids ``(B, T)``; ``pkg.module:factory`` is called with no arguments and gets an input of
    ``input_dtype``: ``auto`` gives token ids (zeros) to a model whose first module is an ``nn.Embedding``
    (``hybridpar.ir.analysis.input_dtype_of``), a float volume or sequence to any other.
    """
    with torch.device(device):
        if name == "cosmoflow":
            _check_volume(name, input_shape)
            return cosmoflow(size=input_shape[2], in_channels=input_shape[1]), torch.empty(input_shape)
        if name == "unet3d":
            _check_volume(name, input_shape)
            return unet3d(in_channels=input_shape[1]), torch.empty(input_shape)
        if name in GPT_PRESETS:
            if len(input_shape) != 2:
                raise HybridparError(f"model {name!r} takes token ids of shape BxT, "
                                     f"e.g. 1x{GPT_PRESETS[name].seq_len}; "
                                     f"got {'x'.join(map(str, input_shape))}")
            return gpt(preset=name), torch.zeros(input_shape, dtype=torch.long)
        if ":" in name:
            model = _factory(name)()
            dtype = input_dtype_of(model) if input_dtype == "auto" else getattr(torch, input_dtype)
            return model, torch.zeros(input_shape, dtype=dtype)  # on the meta device: the analysis gives it zeros
    raise HybridparError(f"model {name!r}: use one of {', '.join(known_names())}, or pkg.module:factory "
                         "for a function that returns an nn.Module")


def _check_volume(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 5 or len(set(shape[2:])) != 1:
        raise HybridparError(f"model {name!r} takes a cubic volume NxCxSxSxS, e.g. 1x4x128x128x128; "
                             f"got {'x'.join(map(str, shape))}")


def _factory(spec: str):
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise HybridparError(f"model {spec!r}: cannot import {module_name!r} ({err}); check the name and that it "
                             "is on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise HybridparError(f"model {spec!r}: {module_name!r} has no function {attr!r}")
    return factory
