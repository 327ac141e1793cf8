"""Worker-side checks for the error, loss, dropout, unshard and mesh tests (run on every rank by the
harness). Global tensors are drawn from a generator seeded the same on every rank, so every rank holds
the same global input; float64 throughout (tolerance 1e-10: only summation order differs, ~1e-15)."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.spatial import Grid, cross_entropy, dice_loss, mse_loss, parallelize, shard, split_bounds, unshard
from hybridpar.spatial.collectives import all_reduce_sum
from support import cases, harness

TOL = dict(rtol=1e-10, atol=1e-10)


def _global(shape, seed=0, kind="randn"):
    """The same global tensor on every rank."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "rand":
        return torch.rand(shape, generator=gen, dtype=torch.float64)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _spatial_rank(mesh) -> int:
    return dist.get_rank(mesh.get_group())


def _gather_objects(obj, mesh) -> list:
    out = [None] * mesh.size()
    dist.all_gather_object(out, obj, group=mesh.get_group())
    return out


# -- models that make mistakes ---------------------------------------------------------------------


class ViewHead(nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)


class FlattenHead(nn.Module):
    def forward(self, x):
        return torch.flatten(x, 1)


class ReshapeHead(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1)


class InterpolateHead(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=2)


class MeanHead(nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3, 4))


class PadHead(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 1, 1, 1, 1, 1))


class CatSpatialHead(nn.Module):
    def forward(self, x):
        return torch.cat([x, x], dim=2)


class CatChannelsHead(nn.Module):
    """Allowed: concatenation along channels, channel slicing and a channel softmax."""

    def forward(self, x):
        return torch.cat([x, x[:, :1]], dim=1).softmax(dim=1)


class ExactOnSlabsHead(nn.Module):
    """Allowed: operations that compute on a slab what they compute on the whole volume, whatever their name:
    padding of zero rows on the split dims (and of channels), a repeat along the channels only, a conversion
    that changes nothing, and modules whose parameter has one element (PReLU, BatchNorm3d(1))."""

    def __init__(self):
        super().__init__()
        self.act = nn.PReLU()
        self.norm = nn.BatchNorm3d(1)

    def forward(self, x):
        x = F.pad(x, (0, 0, 0, 0, 0, 0, 0, 1))  # one more channel of zeros, no spatial padding
        x = torch.as_tensor(x).repeat(1, 2, 1, 1, 1)  # (N, 6, D, H, W)
        return self.act(x) + self.norm(x[:, :1])


class DropoutHead(nn.Module):
    """A dense head whose dropout is functional: it would draw a different mask on every rank."""

    def __init__(self, features: int):
        super().__init__()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(features, 3)

    def forward(self, x):
        return F.dropout(self.fc(self.flat(x)), 0.5, training=self.training)


class Net(nn.Module):
    def __init__(self, head: nn.Module, channels: int = 1):
        super().__init__()
        self.conv = nn.Conv3d(channels, 2, 3, padding=1)
        self.head = head

    def forward(self, x):
        return self.head(self.conv(x))


class RootView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y.view(y.size(0), -1)


def _seq(**layers):
    return nn.Sequential(OrderedDict(layers))


def _conv(k=3, p=1):
    return nn.Conv3d(1, 1, k, padding=p)


def _hand_slab(shape, grid, mesh):
    """This rank's slab shape by split_bounds, without shard's checks (it may be empty)."""
    coords = Grid(tuple(grid)).coords(_spatial_rank(mesh))
    local = list(shape[:2]) + [hi - lo for lo, hi in
                               (split_bounds(n, p)[c] for n, p, c in zip(shape[2:], grid, coords))]
    return torch.randn(local, dtype=torch.float64)


# name -> (model factory, global shape, grid, substrings the message must contain, slab maker or None)
ERROR_CASES = {
    "thin_slab_conv_k5_p2": (
        lambda: _seq(c1=_conv(5, 2)), (1, 1, 5, 4, 4), (4, 1, 1),
        ["layer 'c1' (Conv3d)", "along spatial dim 0 (size 5, 4 parts)", "thinnest slab has 1 rows",
         "use fewer parts along dim 0 or a larger input"], None),
    "more_parts_than_rows_input": (
        lambda: _seq(c1=_conv()), (1, 1, 3, 4, 4), (4, 1, 1),
        ["the model input", "spatial dim 0 has 3 rows but the grid splits it into 4 parts",
         "use at most 3 parts along dim 0"], "hand"),
    "more_parts_than_rows_after_pool": (
        lambda: _seq(pool=nn.MaxPool3d(2), c1=_conv()), (1, 1, 4, 4, 4), (4, 1, 1),
        ["layer 'pool' (MaxPool3d) output", "spatial dim 0 has 2 rows but the grid splits it into 4 parts"], None),
    "grid_with_wrong_number_of_dims": (
        lambda: _seq(c1=_conv()), (1, 1, 8, 4, 4), (2, 1),
        ["the model input", "with 2 spatial dims"], lambda shape, mesh: shard(_global(shape), mesh, grid=(2, 1, 1))),
    "maxpool_return_indices": (
        lambda: _seq(c1=_conv(), pool=nn.MaxPool3d(2, return_indices=True)), (1, 1, 8, 4, 4), (2, 1, 1),
        ["layer 'pool' (MaxPool3d)", "return_indices=True", "use return_indices=False"], None),
    "adaptive_max_pool_return_indices": (
        lambda: _seq(c1=_conv(), gmp=nn.AdaptiveMaxPool3d(1, return_indices=True)), (1, 1, 8, 4, 4), (2, 1, 1),
        ["layer 'gmp' (AdaptiveMaxPool3d)", "return_indices=True", "use return_indices=False"], None),
    "adaptive_avg_pool_to_2": (
        lambda: _seq(c1=_conv(), gap=nn.AdaptiveAvgPool3d(2)), (1, 1, 8, 4, 4), (2, 1, 1),
        ["layer 'gap' (AdaptiveAvgPool3d)", "adaptive pooling to (2, 2, 2)", "output_size=1"], None),
    "upsample_bicubic_2d": (
        lambda: _seq(up=nn.Upsample(scale_factor=2, mode="bicubic")), (1, 1, 8, 6), (2, 1),
        ["layer 'up' (Upsample)", "mode 'bicubic' is not supported", "use one of", "bilinear"], None),
    "view_in_a_child": (
        lambda: Net(ViewHead()), (1, 1, 8, 4, 4), (2, 1, 1),
        ["view on a spatially split tensor", "forward of 'head'", "nn.Flatten()"], None),
    "view_in_a_nested_child": (
        lambda: Net(nn.Sequential(nn.ReLU(), ViewHead())), (1, 1, 8, 4, 4), (1, 1, 2),
        ["view on a spatially split tensor", "forward of 'head.1'", "nn.Flatten()"], None),
    "view_in_the_root_forward": (
        RootView, (1, 1, 8, 4, 4), (2, 1, 1),
        ["view on a spatially split tensor", "forward of '<root>'", "nn.Flatten()"], None),
    "functional_flatten": (
        lambda: Net(FlattenHead()), (1, 1, 8, 4, 4), (2, 1, 1),
        ["flatten on a spatially split tensor", "forward of 'head'", "nn.Flatten()"], None),
    "reshape_in_a_child": (
        lambda: Net(ReshapeHead()), (1, 1, 8, 4, 4), (2, 2, 1),
        ["reshape on a spatially split tensor", "forward of 'head'", "nn.Flatten()"], None),
    "functional_interpolate": (
        lambda: Net(InterpolateHead()), (1, 1, 8, 4, 4), (2, 1, 1),
        ["interpolate on a spatially split tensor", "forward of 'head'", "nn.Upsample"], None),
    "mean_over_spatial_dims": (
        lambda: Net(MeanHead()), (1, 1, 8, 4, 4), (2, 1, 1),
        ["mean on a spatially split tensor", "forward of 'head'", "AdaptiveAvgPool"], None),
    "functional_pad": (
        lambda: Net(PadHead()), (1, 1, 8, 4, 4), (2, 1, 1),
        ["pad on a spatially split tensor", "forward of 'head'", "padding in the convolution"], None),
    "cat_along_a_spatial_dim": (
        lambda: Net(CatSpatialHead()), (1, 1, 8, 4, 4), (2, 1, 1),
        ["cat on a spatially split tensor", "forward of 'head'", "an unsplit dim"], None),
    "functional_dropout_on_the_head": (
        lambda: Net(DropoutHead(2 * 8 * 4 * 4)), (1, 1, 8, 4, 4), (2, 1, 1),
        ["dropout in the forward of 'head'", "different mask on each rank", "use an nn.Dropout module"], None),
}


def _slab(shape, grid, mesh, maker):
    if maker is None:
        return shard(_global(shape), mesh, grid=grid)
    if maker == "hand":
        return _hand_slab(shape, grid, mesh)
    return maker(shape, mesh)


def expect_value_error(case: str, train: bool = True) -> str:
    """The parallelized model raises a ValueError with every expected phrase, on this rank."""
    factory, shape, grid, phrases, maker = ERROR_CASES[case]
    mesh = cases.spatial_mesh(math.prod(grid))
    torch.manual_seed(0)
    model = parallelize(factory().double().train(train), mesh, grid=grid)
    x = _slab(shape, grid, mesh, maker)
    try:
        model(x)
    except ValueError as err:
        missing = [p for p in phrases if p not in str(err)]
        assert not missing, f"{case}: message lacks {missing}: {err}"
        return str(err)
    raise AssertionError(f"{case}: no ValueError")


def _raises(fn, phrases) -> str:
    try:
        fn()
    except ValueError as err:
        missing = [p for p in phrases if p not in str(err)]
        assert not missing, f"message lacks {missing}: {err}"
        return str(err)
    raise AssertionError(f"no ValueError (expected {phrases})")


def shard_errors() -> list[str]:
    """``shard`` refuses a grid with more parts than rows and a grid of the wrong number of dims."""
    mesh = cases.spatial_mesh(dist.get_world_size())
    n = dist.get_world_size()
    return [
        _raises(lambda: shard(_global((1, 1, n - 1, 4)), mesh, grid=(n, 1)),
                [f"shard: spatial dim 0 has {n - 1} rows but the grid splits it into {n} parts",
                 f"use at most {n - 1} parts"]),
        _raises(lambda: shard(_global((1, 1, 8, 4, 4)), mesh, grid=(n, 1)),
                [f"a grid of 2 spatial dims ({n}, 1) cannot split a tensor with 3 spatial dims"]),
    ]


def wrong_mesh_size_errors() -> list[str]:
    """A grid whose part count is not the mesh size is refused by parallelize, shard and unshard."""
    n = dist.get_world_size()
    mesh = cases.spatial_mesh(n)
    phrase = [f"grid (2, {n}, 1) has {2 * n} parts but the spatial mesh has {n} ranks"]
    x = _global((1, 1, 8, 8, 4))
    return [
        _raises(lambda: parallelize(_seq(c1=_conv()), mesh, grid=(2, n, 1)), phrase),
        _raises(lambda: shard(x, mesh, grid=(2, n, 1)), phrase),
        _raises(lambda: unshard(x, mesh, grid=(2, n, 1)), phrase),
    ]


def two_dim_mesh_error(what: str) -> str:
    """A 2-D (dp x spatial) mesh passed where the 1-D spatial sub-mesh belongs is refused clearly."""
    mesh = harness.mesh((2, dist.get_world_size() // 2), ("dp", "spatial"))
    grid = (mesh.size(), 1, 1)
    x = _global((1, 1, 8, 4, 4))
    call = {
        "parallelize": lambda: parallelize(_seq(c1=_conv()), mesh, grid=grid),
        "shard": lambda: shard(x, mesh, grid=grid),
        "unshard": lambda: unshard(x, mesh, grid=grid),
    }[what]
    return _raises(call, ["spatial mesh has 2 axes ('dp', 'spatial')", "pass its 1-D spatial sub-mesh"])


def untileable_slabs(kind: str) -> str:
    """Slabs made by hand that do not tile a global volume split by the grid are refused on every rank."""
    mesh = cases.spatial_mesh(2)
    rank = _spatial_rank(mesh)
    shapes = {
        "smaller_first": [(1, 1, 4, 6, 6), (1, 1, 5, 6, 6)],  # 9 rows split (5, 4), not (4, 5)
        "unequal_other_dim": [(1, 1, 4, 6, 6), (1, 1, 4, 5, 6)],
        "unequal_channels": [(1, 2, 4, 6, 6), (1, 1, 4, 6, 6)],
        "unequal_ndim": [(1, 1, 4, 6, 6), (1, 1, 4, 6)],
    }[kind]
    model = parallelize(_seq(c1=nn.Conv3d(1, 1, 3, padding=1)).double(), mesh, grid=(2, 1, 1))
    x = torch.randn(shapes[rank], dtype=torch.float64)
    phrases = {
        "smaller_first": ["the model input", "do not tile a global (1, 1, 9, 6, 6) split by grid (2, 1, 1)",
                          "expected [(1, 1, 5, 6, 6), (1, 1, 4, 6, 6)]", "hybridpar.spatial.shard"],
        "unequal_other_dim": ["the model input", "do not tile", "hybridpar.spatial.shard"],
        "unequal_channels": ["the model input", "do not tile", "hybridpar.spatial.shard"],
        "unequal_ndim": ["the model input", "with 3 spatial dims"],
    }[kind]
    return _raises(lambda: model(x), phrases)


def allowed_ops_match_one_process(train: bool) -> None:
    """Controls: code the checker allows (channel cat / slice / softmax, eval-mode F.dropout, zero padding,
    channel repeats, no-op conversions, one-element parameters) runs and equals one process."""
    mesh = cases.spatial_mesh(2)
    for make_head in (CatChannelsHead, lambda: DropoutHead(2 * 8 * 4 * 4), ExactOnSlabsHead):
        torch.manual_seed(0)
        ref = Net(make_head()).double()
        ref.train(train and not isinstance(ref.head, DropoutHead))  # F.dropout is only allowed in eval
        model = parallelize(Net(make_head()).double(), mesh, grid=(2, 1, 1))
        model.load_state_dict(ref.state_dict())
        model.train(ref.training)
        x = _global((1, 1, 8, 4, 4))
        y = model(shard(x, mesh, grid=(2, 1, 1)))
        y_ref = ref(x)
        expect = shard(y_ref, mesh, grid=(2, 1, 1)) if y_ref.dim() == 5 else y_ref
        torch.testing.assert_close(y, expect, **TOL)


# -- losses ---------------------------------------------------------------------------------------


def _shard_target(t, mesh, grid):
    return shard(t.unsqueeze(1), mesh, grid=grid).squeeze(1)


def _loss_configs(C):
    weight = torch.linspace(0.5, 2.0, C, dtype=torch.float64)
    return {
        "mse_mean": ("mse", dict(reduction="mean")),
        "mse_sum": ("mse", dict(reduction="sum")),
        "ce_mean": ("ce", dict()),
        "ce_sum": ("ce", dict(reduction="sum")),
        "ce_weight_mean": ("ce", dict(weight=weight)),
        "ce_weight_sum": ("ce", dict(weight=weight, reduction="sum")),
        "ce_ignore_mean": ("ce", dict(ignore_index=-100)),
        "ce_ignore_class_1": ("ce", dict(ignore_index=1, weight=weight)),
        "ce_smooth_mean": ("ce", dict(label_smoothing=0.1)),
        "ce_smooth_sum": ("ce", dict(label_smoothing=0.2, reduction="sum")),
        "ce_weight_ignore_smooth_mean": ("ce", dict(weight=weight, ignore_index=-100, label_smoothing=0.1)),
        "ce_weight_ignore_smooth_sum": ("ce", dict(weight=weight, ignore_index=-100, label_smoothing=0.1,
                                                   reduction="sum")),
        "ce_ignore_255_weight": ("ce", dict(weight=weight, ignore_index=255)),
        "ce_ignore_255": ("ce", dict(ignore_index=255)),
        "dice": ("dice", dict()),
        "dice_smooth_1": ("dice", dict(smooth=1.0)),
    }


LOSS_NAMES = tuple(_loss_configs(3))


def _dice_reference(x, t, smooth=1e-5):
    """Soft Dice written out directly: ``1 - mean_{n,c} (2 sum p*g + s) / (sum p + sum g + s)``."""
    probs = torch.softmax(x, dim=1)
    onehot = torch.stack([(t == c) for c in range(x.shape[1])], dim=1).to(x.dtype)
    inter = (probs * onehot).flatten(2).sum(-1)
    denom = probs.flatten(2).sum(-1) + onehot.flatten(2).sum(-1)
    return 1 - ((2 * inter + smooth) / (denom + smooth)).mean()


def check_losses(shape, grid, names=LOSS_NAMES) -> dict:
    """Each loss over slabs equals the one-process loss (and torch's own), on every rank, and each
    rank's input gradient is ``P`` times its share of the one-process gradient."""
    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = cases.spatial_mesh(parts)
    C = shape[1]
    x = _global(shape, seed=1)
    y = _global(shape, seed=2)
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, C, (shape[0],) + tuple(shape[2:]), generator=gen)
    drop = torch.rand(labels.shape, generator=gen) < 0.3
    values = {}
    for name in names:
        kind, kw = _loss_configs(C)[name]
        if kind == "mse":
            def loss(inp, m, tgt, kw=kw):
                return mse_loss(inp, tgt, m, **kw)
            ref_fn, target = (lambda inp, kw=kw: F.mse_loss(inp, y, **kw)), y
            target_loc = shard(y, mesh, grid=grid)
        else:
            target = labels.clone()
            if "ignore_index" in kw:
                target[drop] = kw["ignore_index"]
            target_loc = _shard_target(target, mesh, grid)
            if kind == "ce":
                def loss(inp, m, tgt, kw=kw):
                    return cross_entropy(inp, tgt, m, **kw)
                ref_fn = lambda inp, kw=kw, target=target: F.cross_entropy(inp, target, **kw)  # noqa: E731
            else:
                def loss(inp, m, tgt, kw=kw):
                    return dice_loss(inp, tgt, m, **kw)
                ref_fn = lambda inp, kw=kw, target=target: _dice_reference(inp, target, **kw)  # noqa: E731
        x_ref = x.clone().requires_grad_()
        one = loss(x_ref, None, target)
        torch_value = ref_fn(x.clone())
        torch.testing.assert_close(one, torch_value, **TOL, msg=lambda m: f"{name}, one process vs torch: {m}")
        one.backward()

        x_loc = shard(x, mesh, grid=grid).requires_grad_()
        value = loss(x_loc, mesh, target_loc)
        torch.testing.assert_close(value, one.detach(), **TOL, msg=lambda m: f"{name}, slabs vs one process: {m}")
        value.backward()
        torch.testing.assert_close(x_loc.grad / parts, shard(x_ref.grad, mesh, grid=grid), **TOL,
                                   msg=lambda m: f"{name}, input gradient: {m}")
        values[name] = float(value)
    return values


# -- dropout --------------------------------------------------------------------------------------


def _seed_by_rank():
    torch.manual_seed(1000 + dist.get_rank())


def _dropout_mesh(dp: int, parts: int):
    if dp == 1:
        return cases.spatial_mesh(parts)
    return harness.mesh((dp, parts), ("dp", "spatial"))["spatial"]


def dropout_on_slab(shape, grid, p: float = 0.5, dp: int = 1) -> None:
    """Element-wise dropout on a slab: each rank draws its own mask; the kept entries are ``x/(1-p)``,
    the rest exactly 0, and the input gradient is ``cot/(1-p)`` on kept entries and exactly 0 elsewhere."""
    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = _dropout_mesh(dp, parts)
    model = parallelize(_seq(drop=nn.Dropout(p)), mesh, grid=grid).train()
    x = _global(shape, kind="rand") + 0.5  # no zeros, so a zero output means dropped
    cot = _global(shape, seed=7)
    x_loc = shard(x, mesh, grid=grid).requires_grad_()
    _seed_by_rank()
    y = model(x_loc)
    kept = y != 0
    torch.testing.assert_close(y[kept], x_loc.detach()[kept] / (1 - p), **TOL)
    fraction = kept.double().mean().item()
    assert abs(fraction - (1 - p)) < 0.15, f"kept fraction {fraction} for p={p} on {kept.numel()} entries"
    masks = _gather_objects(kept.flatten().tolist(), mesh)
    if len({len(m) for m in masks}) == 1:
        assert len({tuple(m) for m in masks}) == parts, "ranks seeded differently drew the same slab mask"
    all_reduce_sum((y * shard(cot, mesh, grid=grid)).sum(), mesh.get_group()).backward()
    grad = x_loc.grad / parts
    assert torch.all(grad[~kept] == 0), "gradient leaks into dropped entries"
    torch.testing.assert_close(grad, torch.where(kept, shard(cot, mesh, grid=grid) / (1 - p), 0.0), **TOL)


def dropout3d_on_slab(shape, grid, p: float = 0.5, dp: int = 1) -> None:
    """Channel dropout on slabs: whole ``(n, c)`` channels dropped, the same ones on every rank of the
    spatial group, though each rank's random generator is seeded differently."""
    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = _dropout_mesh(dp, parts)
    model = parallelize(_seq(drop=nn.Dropout3d(p)), mesh, grid=grid).train()
    x = _global(shape, kind="rand") + 0.5
    cot = _global(shape, seed=7)
    x_loc = shard(x, mesh, grid=grid).requires_grad_()
    _seed_by_rank()
    y = model(x_loc)
    nonzero = (y != 0).flatten(2)
    channel_kept = nonzero.any(-1)
    assert torch.equal(channel_kept, nonzero.all(-1)), "a channel is partly dropped"
    assert 0 < channel_kept.sum() < channel_kept.numel(), "with p=0.5 over many channels some stay, some go"
    keep = channel_kept[:, :, None, None, None]
    torch.testing.assert_close(y, torch.where(keep, x_loc.detach() / (1 - p), 0.0), **TOL)
    masks = _gather_objects(channel_kept.tolist(), mesh)
    assert all(m == masks[0] for m in masks), f"channel masks differ across the spatial group: {masks}"
    all_reduce_sum((y * shard(cot, mesh, grid=grid)).sum(), mesh.get_group()).backward()
    grad = x_loc.grad / parts
    assert torch.all(grad[~keep.expand_as(grad)] == 0)
    torch.testing.assert_close(grad, torch.where(keep, shard(cot, mesh, grid=grid) / (1 - p), 0.0), **TOL)


def _replicated_head(head: str, shape, p: float) -> tuple[nn.Module, nn.Module]:
    """(layers before the dropout, the dropout) of a head whose dropout sees a replicated tensor."""
    torch.manual_seed(0)  # the same weights on every rank
    pre = {
        "flatten": lambda: _seq(flat=nn.Flatten()),
        "flatten_linear": lambda: _seq(flat=nn.Flatten(), fc=nn.Linear(math.prod(shape[1:]), 6)),
        "global_pool": lambda: _seq(gap=nn.AdaptiveAvgPool3d(1)),
    }[head]().double()
    drop = nn.Dropout3d(p) if head == "global_pool" else nn.Dropout(p)
    return pre, drop


def dropout_on_replicated(shape, grid, head: str = "flatten", p: float = 0.5, dp: int = 1) -> None:
    """Dropout on the replicated head (after Flatten, a dense layer or global pooling): the same output on
    every rank of the spatial group, ``head(x) / (1-p)`` or exactly 0, and each rank's input gradient is
    ``P`` times its share of the one-process gradient through the same mask."""
    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = _dropout_mesh(dp, parts)
    pre, drop = _replicated_head(head, shape, p)
    ref = copy.deepcopy(pre)
    model = parallelize(nn.Sequential(pre, drop), mesh, grid=grid).train()
    x = _global(shape, kind="rand") + 0.5
    x_loc = shard(x, mesh, grid=grid).requires_grad_()
    _seed_by_rank()
    y = model(x_loc)
    kept = y != 0
    assert 0 < kept.sum() < kept.numel(), kept
    outputs = _gather_objects(y.detach(), mesh)
    assert all(torch.equal(o, outputs[0]) for o in outputs), "the replicated head differs across the spatial group"
    x_ref = x.clone().requires_grad_()
    y_ref = torch.where(kept, ref(x_ref) / (1 - p), 0.0)
    torch.testing.assert_close(y, y_ref, **TOL)
    cot = _global(y.shape, seed=7)
    (y * cot).sum().backward()  # the same global loss on every rank
    (y_ref * cot).sum().backward()
    torch.testing.assert_close(x_loc.grad / parts, shard(x_ref.grad, mesh, grid=grid), **TOL)
    if head == "flatten":
        assert torch.all(x_loc.grad[shard(~kept.view(shape), mesh, grid=grid)] == 0)


def dropout_eval_is_identity(shape, grid) -> None:
    grid = tuple(grid)
    mesh = cases.spatial_mesh(math.prod(grid))
    x = _global(shape)
    x_loc = shard(x, mesh, grid=grid)
    for layer in (nn.Dropout(0.5), nn.Dropout3d(0.5)):
        model = parallelize(_seq(drop=layer), mesh, grid=grid).eval()
        assert torch.equal(model(x_loc), x_loc)
    model = parallelize(_seq(flat=nn.Flatten(), drop=nn.Dropout(0.5)), mesh, grid=grid).eval()
    assert torch.equal(model(x_loc), x.flatten(1))


# -- unshard --------------------------------------------------------------------------------------


def unshard_round_trip(shape, grid, dp: int = 1) -> None:
    """``unshard(shard(x)) == x`` on every rank; the gradient of a loss of the global tensor comes back
    to each slab summed over the ranks that computed it (``P`` times its share for one global loss)."""
    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = _dropout_mesh(dp, parts)
    rank = _spatial_rank(mesh)
    x = _global(shape, seed=11)
    x_loc = shard(x, mesh, grid=grid).requires_grad_()
    y = unshard(x_loc, mesh, grid=grid)
    assert y.shape == x.shape and torch.equal(y, x), "unshard(shard(x)) != x"
    cot = _global(shape, seed=12)
    (y * cot).sum().backward()
    torch.testing.assert_close(x_loc.grad, parts * shard(cot, mesh, grid=grid), **TOL)
    # different cotangents per rank: the slab's gradient is the sum of every rank's
    x_loc.grad = None
    y = unshard(x_loc, mesh, grid=grid)
    (y * cot * (rank + 1)).sum().backward()
    torch.testing.assert_close(x_loc.grad, sum(range(1, parts + 1)) * shard(cot, mesh, grid=grid), **TOL)


# -- mesh -----------------------------------------------------------------------------------------


def built_mesh(dims: dict) -> dict:
    from hybridpar.mesh import AXES, ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(**dims), dist.get_world_size())
    return {
        "names": tuple(mesh.mesh_dim_names),
        "shape": tuple(mesh.shape),
        "sizes": {a: mesh[a].size() for a in AXES},
        "coords": tuple(mesh.get_coordinate()),
        "groups": {a: tuple(dist.get_process_group_ranks(mesh[a].get_group())) for a in AXES},
    }
