"""Filter and channel parallelism for convolutions (Dryden et al., SC'19): Megatron's column / row split,
for ``Conv1d/2d/3d``.

- **Filter-parallel** (``filter_parallel``, the plan's ``column``): each of the ``P`` ranks of a group owns
  ``C_out / P`` of the filters (weight rows and bias) and computes those output channels from the whole
  input. The output leaves split by channels; the input's gradient is summed over the group.
- **Channel-parallel** (``channel_parallel``, the plan's ``row``): each rank owns ``C_in / P`` of the input
  channels (weight columns) and convolves its channel slice of the input into a partial output; the
  partial outputs are summed over the group (then the bias, whole on every rank, is added once).

A filter-parallel conv followed by pointwise layers and a channel-parallel conv needs no communication in
between: the pair costs one all-reduce forward and one backward, as Megatron's MLP. PyTorch's DTensor has
no such rule for convolutions (in torch 2.13 a conv with a channel-sharded DTensor weight returns wrong
values while claiming a replicated output), so the split weights are plain local parameters and the two
collectives are autograd Functions here; ``gather_parameter`` reassembles a whole parameter (or its
gradient) from the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridpar.errors import UnsupportedModuleError

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class _CopyToGroup(torch.autograd.Function):
    """Forward: the input as it is (every rank holds all of it). Backward: the gradient summed over the
    group (each rank's filters contributed a part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x[:]  # a view (channel indexing, which a spatial model's shape trace accepts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: the partial outputs summed over the group. Backward: the gradient as it is (every rank's
    partial output fed the sum whole)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        if not out.is_meta:  # a meta tensor (a spatial model's shape trace) has no values to sum
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_cat(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Every rank's ``x``, concatenated along ``dim`` in rank order (by default the channels)."""
    size = dist.get_world_size(group)
    if x.is_meta:  # a spatial model's shape trace: only the shape is gathered
        return torch.cat([x] * size, dim=dim)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherFromGroup(torch.autograd.Function):
    """Forward: every rank's channel slice, concatenated (dim 1). Backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[1]
        return _all_gather_cat(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(1, dist.get_rank(ctx.group) * ctx.width, ctx.width), None


class _SliceToGroup(torch.autograd.Function):
    """Forward: this rank's channel slice of a whole input. Backward: every rank's slice of the gradient,
    concatenated (each rank's slice fed only its own channels)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        width = x.shape[1] // dist.get_world_size(group)
        start = dist.get_rank(group) * width
        return x[:, start:start + width]

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_cat(grad, ctx.group), None


class _SplitConv(nn.Module):
    """A convolution whose parameters are this rank's shard along ``dim`` (0: filters, 1: input channels):
    an ordinary conv of this rank's channels (``self.conv``, same kernel, stride, padding and padding mode,
    so that a spatially parallel model converts it like any conv) between the group's collectives."""

    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, dim: int):
        super().__init__()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.split_dim, self.parts = group, dim, size
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        # the original conv's geometry, for model code that reads it (a "same" padding computed from the stride)
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups, self.padding_mode = conv.dilation, conv.groups, conv.padding_mode
        width = conv.weight.shape[dim] // size
        channels = (conv.in_channels, width) if dim == 0 else (width, conv.out_channels)
        self.conv = type(conv)(*channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                               dilation=conv.dilation, bias=conv.bias is not None and dim == 0,
                               padding_mode=conv.padding_mode, device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            self.conv.weight.copy_(conv.weight.narrow(dim, rank * width, width))
            if self.conv.bias is not None:
                self.conv.bias.copy_(conv.bias.narrow(0, rank * width, width))
        whole_bias = conv.bias is not None and dim == 1  # added once, after the partial outputs are summed
        self.bias = nn.Parameter(conv.bias.detach().clone()) if whole_bias else None

    @property
    def weight(self) -> nn.Parameter:
        """This rank's shard of the original conv's weight."""
        return self.conv.weight

    def local_parameters(self) -> dict[str, nn.Parameter | None]:
        """``{"weight", "bias"}``: this rank's shards, by the original conv's parameter names."""
        return {"weight": self.conv.weight, "bias": self.conv.bias if self.split_dim == 0 else self.bias}

    def extra_repr(self) -> str:
        kind = "filters" if self.split_dim == 0 else "input channels"
        return f"{self.in_channels} -> {self.out_channels}, {kind} split in {self.parts}"


class FilterParallelConv(_SplitConv):
    """``C_out / P`` filters of a conv on every rank: whole input in, this rank's output channels out."""

    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, gather_output: bool = False):
        super().__init__(conv, group, dim=0)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(_CopyToGroup.apply(x, self.group))
        return _GatherFromGroup.apply(out, self.group) if self.gather_output else out


class ChannelParallelConv(_SplitConv):
    """``C_in / P`` input channels of a conv on every rank: this rank's input channels in, whole output out."""

    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, slice_input: bool = False):
        super().__init__(conv, group, dim=1)
        self.slice_input = slice_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.conv.in_channels
        if self.slice_input and x.shape[1] == self.in_channels:
            x = _SliceToGroup.apply(x, self.group)
        if x.shape[1] != width:
            raise UnsupportedModuleError(f"channel-parallel conv ({self.extra_repr()}): its input has {x.shape[1]} "
                                         f"channels, not this rank's {width}; feed it the output of a "
                                         "filter-parallel conv (through pointwise layers), split by channels")
        out = _ReduceFromGroup.apply(self.conv(x), self.group)
        if self.bias is not None:
            out = out + self.bias.view(1, -1, *([1] * (out.dim() - 2)))
        return out


def filter_parallel(conv: nn.Module, group: dist.ProcessGroup, where: str = "conv", *,
                    gather_output: bool = False) -> FilterParallelConv:
    """``conv`` split by its filters (output channels) over ``group``; ``where`` names it in errors. With
    ``gather_output`` every rank gets all the output channels (for a reader that needs them whole)."""
    _check(conv, group, "out_channels", where)
    return FilterParallelConv(conv, group, gather_output)


def channel_parallel(conv: nn.Module, group: dist.ProcessGroup, where: str = "conv", *,
                     slice_input: bool = False) -> ChannelParallelConv:
    """``conv`` split by its input channels over ``group``; ``where`` names it in errors. With
    ``slice_input`` it takes a whole input and uses this rank's channels of it."""
    _check(conv, group, "in_channels", where)
    return ChannelParallelConv(conv, group, slice_input)


def _check(conv: nn.Module, group: dist.ProcessGroup, field: str, where: str) -> None:
    """Refuse what cannot be split, before any communication (the same answer on every rank)."""
    if type(conv) not in CONVS:
        raise UnsupportedModuleError(f"{where}: {type(conv).__name__} cannot be split by channels; filter and "
                                     "channel parallelism take nn.Conv1d, nn.Conv2d or nn.Conv3d")
    if conv.groups != 1:
        raise UnsupportedModuleError(f"{where}: a conv with groups={conv.groups} cannot be split by channels "
                                     "(each group already sees only its own channels); use groups=1, or replicate "
                                     "the layer")
    parts, channels = dist.get_world_size(group), getattr(conv, field)
    if channels % parts:
        raise UnsupportedModuleError(f"{where}: {field}={channels} does not split into {parts} equal parts; use a "
                                     f"tensor-parallel degree that divides {channels}, or replicate the layer")


def gather_parameter(shard: torch.Tensor, module: _SplitConv, name: str) -> torch.Tensor:
    """The whole parameter ``name`` (``weight`` or ``bias``) of the original conv from every rank's ``shard``
    of it (a parameter or its gradient); collective over ``module.group``."""
    if name == "bias" and module.split_dim == 1:
        return shard.clone()  # whole on every rank
    return _all_gather_cat(shard, module.group, module.split_dim if name == "weight" else 0)
