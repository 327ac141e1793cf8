"""Filter- and channel-parallel convolutions against one process, float64: output, loss, the input's
gradient, every parameter's gradient (gathered) and one optimizer step, on 2 and 4 ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.errors import UnsupportedModuleError
from hybridpar.parallel.channels import channel_parallel, filter_parallel, gather_parameter

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64: the split sums the same products in another order


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.allclose(a, b, **TIGHT), f"{what}: largest difference {(a - b).abs().max().item():.3g}"


def pair_equivalence(dims: int, stride: int, bias: bool, padding=1, mode: str = "zeros", seed: int = 0) -> None:
    """A filter-parallel conv, ReLU, a channel-parallel conv (the Megatron pair) against the same layers
    in one process, on every rank of the world group."""
    conv = CONVS[dims]
    torch.manual_seed(seed)
    model = nn.Sequential(conv(4, 8, 3, padding=padding, bias=bias, padding_mode=mode), nn.ReLU(),
                          conv(8, 4, 3, stride=stride, padding=padding, bias=bias, padding_mode=mode)).double()
    x = torch.randn(2, 4, *(6,) * dims, dtype=torch.float64, requires_grad=True)
    target = torch.randn_like(model(x))
    group = dist.group.WORLD
    split = nn.Sequential(filter_parallel(model[0], group, "0"), nn.ReLU(), channel_parallel(model[2], group, "2"))
    x_split = x.detach().clone().requires_grad_()

    out, out_split = model(x), split(x_split)
    loss, loss_split = F.mse_loss(out, target), F.mse_loss(out_split, target)
    loss.backward()
    loss_split.backward()
    _close(out_split, out, "output")
    _close(loss_split, loss, "loss")
    _close(x_split.grad, x.grad, "input gradient")
    for i in (0, 2):
        for name, param in model[i].named_parameters():
            shard = split[i].local_parameters()[name]
            _close(gather_parameter(shard.grad, split[i], name), param.grad, f"{i}.{name} grad")

    for m in (model, split):
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9).step()
    for i in (0, 2):
        for name, param in model[i].named_parameters():
            shard = split[i].local_parameters()[name]
            _close(gather_parameter(shard.detach(), split[i], name), param.detach(), f"{i}.{name} after a step")


def filter_alone(seed: int = 0) -> None:
    """A filter-parallel conv by itself: this rank's output channels, and the whole input gradient."""
    torch.manual_seed(seed)
    conv = nn.Conv3d(3, 4, 3, padding=1).double()
    x = torch.randn(1, 3, 5, 4, 6, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn_like(conv(x))
    split = filter_parallel(copy.deepcopy(conv), dist.group.WORLD)
    x_split = x.detach().clone().requires_grad_()
    width, rank = 4 // dist.get_world_size(), dist.get_rank()
    mine = slice(rank * width, (rank + 1) * width)
    y, y_split = conv(x), split(x_split)
    _close(y_split, y[:, mine], "this rank's output channels")
    y.backward(cotangent)
    y_split.backward(cotangent[:, mine])
    _close(x_split.grad, x.grad, "input gradient")
    _close(split.weight.grad, conv.weight.grad[mine], "weight gradient shard")


def refusals() -> list[str]:
    """What cannot be split is refused, naming the layer, on every rank alike (no collective is reached)."""
    group, messages = dist.group.WORLD, []
    cases = [(filter_parallel, nn.Conv3d(4, 5, 3), "out_channels=5 does not split"),
             (channel_parallel, nn.Conv3d(3, 4, 3), "in_channels=3 does not split"),
             (filter_parallel, nn.Conv3d(4, 4, 3, groups=2), "groups=2"),
             (filter_parallel, nn.Linear(4, 4), "Linear cannot be split by channels")]
    for fn, module, match in cases:
        with pytest.raises(UnsupportedModuleError, match=match) as err:
            fn(module, group, "features.3")
        assert "features.3" in str(err.value)
        messages.append(str(err.value))
    split = channel_parallel(nn.Conv3d(4, 2, 1).double(), group, "head")
    with pytest.raises(UnsupportedModuleError, match="its input has 4 channels"):
        split(torch.zeros(1, 4, 2, 2, 2, dtype=torch.float64))
    return messages


@pytest.mark.parametrize("dims,stride,bias", [(3, 1, True), (3, 2, False), (2, 1, True), (1, 2, True)])
def test_filter_then_channel_parallel_two_ranks(dist2, dims, stride, bias):
    dist2.run(pair_equivalence, dims=dims, stride=stride, bias=bias)


@pytest.mark.parametrize("padding,mode", [("same", "zeros"), (1, "reflect"), (2, "circular")])
def test_any_padding_splits(dist2, padding, mode):
    """Padding is per channel, so each split conv pads its own channels as the whole conv would."""
    dist2.run(pair_equivalence, dims=3, stride=1, bias=True, padding=padding, mode=mode)


def test_filter_then_channel_parallel_four_ranks(dist4):
    dist4.run(pair_equivalence, dims=3, stride=1, bias=True)


def test_filter_parallel_alone(dist2):
    dist2.run(filter_alone)


def test_what_cannot_be_split_is_refused_alike_on_every_rank(dist2):
    first, second = dist2.run(refusals)
    assert first == second
