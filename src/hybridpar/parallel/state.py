"""The parallel model's tensors under the original model's names: through DDP, FSDP and checkpoint wrappers,
DTensors gathered whole, channel-split convolutions reassembled (``full_state_dict``, checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from hybridpar.parallel.channels import _SplitConv, gather_parameter

WRAPPER_PARTS = ("_checkpoint_wrapped_module.",)


def local_tensors(module: nn.Module, buffers: bool = True):
    """``(original name, tensor, split conv or None, its parameter name)`` for each parameter (and persistent
    buffer) of a parallel ``module``, under each of its names (a tied weight, a module registered twice): through
    DDP and checkpoint wrappers, a channel-split conv's shards under the original conv's names."""
    module = module.module if isinstance(module, DistributedDataParallel) else module
    inner = {id(m.conv) for m in module.modules() if isinstance(m, _SplitConv)}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in inner:
            continue  # its shards are named as the _SplitConv's
        split = sub if isinstance(sub, _SplitConv) else None
        tensors = sub.local_parameters() if split else dict(sub.named_parameters(recurse=False))
        if buffers:
            tensors.update((n, b) for n, b in sub.named_buffers(recurse=False)
                           if n not in sub._non_persistent_buffers_set)
        for name, tensor in tensors.items():
            if tensor is not None:
                yield original_name(f"{prefix}.{name}" if prefix else name), tensor, split, name


def whole_tensors(module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Whole parameters (or their gradients) and buffers of ``module``, by their original names: DTensors
    gathered, channel-split convolutions reassembled. Collective over the tp and dp ranks."""
    out = {}
    for key, tensor, split, name in local_tensors(module, buffers=not grads):
        value = tensor.grad if grads else tensor.detach()
        if value is None:
            continue
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = gather_parameter(value, split, name) if split else value
    return out


def original_name(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
