"""Tensor parallelism from the model's structure: the column / row pairs found in the layer graph, and the
split model against one process (float64: output, loss, every parameter gradient, one Adam step) on 2
and 4 ranks."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridpar.errors import PlanError
from hybridpar.parallel.channels import ChannelParallelConv, FilterParallelConv
from hybridpar.parallel.tensor import pair_strategies, tensor_parallel
from hybridpar.plan import graph_of
from support import harness

TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64: the split sums the same products in another order


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.0), nn.Linear(16, 8), nn.ReLU(),
                         nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))


class Residual(nn.Module):
    """A linear layer whose output is added to its input: nothing to pair it with."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(x + self.fc(x))


def test_pairs_are_found_from_the_graph():
    assert pair_strategies(graph_of(mlp(), (2, 8)), tp=2) == {"0": "column", "1": "shard", "2": "shard", "3": "row",
                                                              "5": "column", "6": "shard", "7": "row"}
    assert pair_strategies(graph_of(mlp(), (2, 8)), tp=4) == {"0": "column", "1": "shard", "2": "shard", "3": "row",
                                                              "5": "column", "6": "shard", "7": "row"}
    # 12 and 4 features do not split into 8: the second pair and the output layer replicate
    assert pair_strategies(graph_of(mlp(), (2, 8)), tp=8) == {"0": "column", "1": "shard", "2": "shard", "3": "row"}
    convs = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.LeakyReLU(), nn.Conv3d(8, 2, 1), nn.MaxPool3d(2),
                          nn.Conv3d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2 * 2, 3))
    assert pair_strategies(graph_of(convs, (1, 2, 8, 8, 8)), tp=2) == {"0": "column", "1": "shard", "2": "row"}
    assert pair_strategies(graph_of(Residual(), (2, 8)), tp=2) == {"head": "column"}  # fc's output meets x


def test_overrides_set_what_the_rules_miss():
    """A residual block the rules leave whole, split by a table of shell-style patterns (first match wins);
    a pattern that matches nothing, or an unknown strategy, is refused."""
    graph = graph_of(Residual(), (2, 8))
    assert pair_strategies(graph, tp=2, overrides={"h*": "replicate", "fc": "column"}) == {"fc": "column"}
    assert pair_strategies(graph, tp=2, overrides={"*": "replicate"}) == {}
    with pytest.raises(PlanError, match="override 'blocks.*' matches no layer of Residual"):
        pair_strategies(graph, tp=2, overrides={"blocks.*": "column"})
    with pytest.raises(PlanError, match="override 'fc': strategy 'cols'"):
        pair_strategies(graph, tp=2, overrides={"fc": "cols"})


def mlp_equivalence(seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = mlp().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    target = torch.randn(4, 4, dtype=torch.float64)
    mesh = harness.mesh((torch.distributed.get_world_size(),), ("tp",))
    graph = graph_of(model, (4, 8), dtype="float64")
    split = tensor_parallel(copy.deepcopy(model), pair_strategies(graph, tp=mesh.size()), mesh, graph)
    tp = mesh.size()
    for name, placement, rows in (("0.weight", Shard(0), 16 // tp), ("3.weight", Shard(1), 8),
                                  ("7.bias", Replicate(), 4)):  # as the pairs say
        param = dict(split.named_parameters())[name]
        assert isinstance(param, DTensor) and param.placements == (placement,) and param.to_local().shape[0] == rows
    loss, loss_split = F.mse_loss(model(x), target), F.mse_loss(split(x), target)
    loss.backward()
    loss_split.backward()
    assert torch.allclose(loss_split, loss, **TIGHT)
    ours = dict(split.named_parameters())
    for name, param in model.named_parameters():
        grad = ours[name].grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        assert torch.allclose(grad, param.grad, **TIGHT), name
    for m in (model, split):
        torch.optim.Adam(m.parameters(), lr=1e-2).step()
    for name, param in model.named_parameters():
        value = ours[name].detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.allclose(value, param.detach(), **TIGHT), f"{name} after a step"


def conv_pair(seed: int = 0) -> None:
    """Convolutions named in the strategies become filter- and channel-parallel convs."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 2, 3, padding=1)).double()
    x = torch.randn(1, 2, 4, 4, 4, dtype=torch.float64)
    mesh = harness.mesh((torch.distributed.get_world_size(),), ("tp",))
    graph = graph_of(model, x.shape, dtype="float64")
    split = tensor_parallel(copy.deepcopy(model), pair_strategies(graph, tp=mesh.size()), mesh, graph)
    assert isinstance(split[0], FilterParallelConv) and isinstance(split[2], ChannelParallelConv)
    assert torch.allclose(split(x), model(x), **TIGHT)


def refusals() -> list[str]:
    mesh = harness.mesh((torch.distributed.get_world_size(),), ("tp",))
    cases = [({"0": "column", "3": "row", "5": "column"}, "layer '5': out_features=12 does not split into 8"),
             ({"9": "column"}, "layer '9' is not in the model"),
             ({"1": "column"}, r"layer '1' \(GELU\) cannot be split column-wise"),
             ({"0": "rows"}, "layer '0': tensor-parallel strategy 'rows'"),
             ({"1": "shard", "3": "row"}, r"layer '1' \(shard\) needs its input split over tp, but '0' gives it"),
             ({"0": "column", "1": "shard"}, r"layer '1' \(shard\) leaves its output split over tp, but '2' reads")]
    messages = []
    for strategies, match in cases:
        model = mlp()
        before = [p.clone() for p in model.parameters()]
        with pytest.raises(PlanError, match=match) as err:
            tensor_parallel(model, strategies, mesh, graph_of(model, (2, 8)))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was split
        messages.append(str(err.value))
    return messages


def test_tp2(dist2):
    dist2.run(mlp_equivalence)


def test_tp4(dist4):
    dist4.run(mlp_equivalence)


def test_convolutions_split_by_channels(dist2):
    dist2.run(conv_pair)


@pytest.mark.slow  # 8 ranks (and their start) on 2 cores
def test_plans_that_do_not_match_the_model_are_refused_before_any_split(dist8):
    first, *others = dist8.run(refusals)
    assert all(o == first for o in others)
