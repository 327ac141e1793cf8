"""The workload models: output shapes, the full-size CosmoFlow on the meta device, the reference parameter
count, argument errors; their exactness under spatial parallelism is in ``tests/distributed/test_models_spatial.py``."""

import math
import re

import pytest
import torch
import torch.nn as nn

from hybridpar.errors import HybridparError
from hybridpar.models import MODELS, CosmoFlow, UNet3D, cosmoflow, gpt, unet3d
from hybridpar.models.unet3d import NORMS


def _count(model: nn.Module, cls: type) -> int:
    return sum(type(m) is cls for m in model.modules())


def test_registry():
    assert MODELS == {"cosmoflow": cosmoflow, "unet3d": unet3d, "gpt": gpt}
    assert isinstance(MODELS["cosmoflow"](size=32, base_channels=1), CosmoFlow)
    assert isinstance(MODELS["unet3d"](base_channels=1), UNet3D)


# -- CosmoFlow -------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_norm", [False, True], ids=["plain", "batch_norm"])
@pytest.mark.parametrize("size", [32, 64])
def test_cosmoflow_shapes(size, batch_norm):
    model = cosmoflow(size, in_channels=2, base_channels=2, fc_sizes=(8,), num_outputs=3, batch_norm=batch_norm)
    x = torch.randn(2, 2, size, size, size)  # (N, C, D, H, W)
    features = model.features(x)
    blocks = int(math.log2(size)) - 2
    assert features.shape == (2, 2 * 2 ** (blocks - 1), 4, 4, 4)
    assert _count(model, nn.Conv3d) == blocks
    assert _count(model, nn.BatchNorm3d) == (blocks if batch_norm else 0)
    y = model(x)
    assert y.shape == (2, 3) and y.abs().max() <= 1.2
    assert model.size == size


@pytest.mark.parametrize("size, blocks", [(128, 5), (512, 7)])
def test_cosmoflow_full_size_on_meta(size, blocks):
    with torch.device("meta"):
        model = cosmoflow(size)
        features = model.features(torch.empty(2, 4, size, size, size))
        y = model.head(features)
    assert _count(model, nn.Conv3d) == blocks
    assert features.shape == (2, 32 * 2 ** (blocks - 1), 4, 4, 4)
    assert y.shape == (2, 4) and y.is_meta


def test_cosmoflow_reference_parameter_count():
    widths = [32, 64, 128, 256, 512]  # conv_size 32, doubling, 5 blocks for a 128^3 input
    convs = sum(3**3 * c_in * c_out + c_out for c_in, c_out in zip([4] + widths[:-1], widths))
    dense = (512 * 4**3 * 128 + 128) + (128 * 64 + 64) + (64 * 4 + 4)
    assert convs + dense == 8_907_556
    with torch.device("meta"):
        plain, normed = cosmoflow(), cosmoflow(batch_norm=True)
    assert sum(p.numel() for p in plain.parameters()) == convs + dense
    # with batch norm each conv loses its bias and each norm adds a weight and a bias per channel
    assert sum(p.numel() for p in normed.parameters()) == convs + dense + sum(widths)


@pytest.mark.parametrize("size", [32, 64, 128])
def test_cosmoflow_average_pooling_is_one_network_for_every_edge(size):
    """With fixed blocks and global average pooling, the parameters do not depend on the input edge."""
    small = cosmoflow(32, base_channels=2, fc_sizes=(8,), num_blocks=3, pooling="average")
    model = cosmoflow(size, base_channels=2, fc_sizes=(8,), num_blocks=3, pooling="average")
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in small.state_dict().items()}
    assert _count(model, nn.Conv3d) == 3 and _count(model, nn.AdaptiveAvgPool3d) == 1
    with torch.device("meta"):
        model = cosmoflow(size, base_channels=2, fc_sizes=(8,), num_blocks=3, pooling="average")
        features = model.features(torch.empty(2, 4, size, size, size))
        assert features.shape == (2, 8) + (size // 8,) * 3
        assert model.head(features).shape == (2, 4)
    small.check_input_size(size)  # any edge the blocks halve exactly
    with pytest.raises(HybridparError, match="size=32"):
        small.check_input_size(36)


def test_cosmoflow_flatten_with_fewer_blocks():
    model = cosmoflow(64, base_channels=2, fc_sizes=(8,), num_blocks=2)
    assert model.head[1].in_features == 4 * 16**3  # 2 blocks: 64 -> 16, 4 channels
    assert model(torch.randn(1, 4, 64, 64, 64)).shape == (1, 4)


def test_cosmoflow_check_input_size():
    model = cosmoflow(32, base_channels=1)
    model.check_input_size(32)
    with pytest.raises(HybridparError, match="size=64"):
        model.check_input_size(64)


COSMOFLOW_ERRORS = [
    ("size", 100), ("size", 16), ("size", 1024), ("size", 64.0), ("size", True), ("in_channels", 0),
    ("base_channels", -1), ("kernel_size", 0), ("fc_sizes", (128, 0)), ("fc_sizes", 128), ("num_outputs", 0),
    ("dropout", 1.0), ("dropout", -0.1), ("dropout", "0.5"), ("batch_norm", "yes"), ("num_blocks", -1),
    ("num_blocks", 8), ("num_blocks", 2.0), ("pooling", "max"),
]


@pytest.mark.parametrize("name, value", COSMOFLOW_ERRORS, ids=str)
def test_cosmoflow_argument_errors(name, value):
    with pytest.raises(HybridparError, match=re.escape(f"{name}={value!r}")):
        cosmoflow(**{name: value})


# -- UNet3D ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("depth, edge", [(1, 5), (2, 6), (3, 8), (4, 16)])
def test_unet3d_shapes(depth, edge, norm):
    model = unet3d(in_channels=2, num_classes=3, base_channels=2, depth=depth, norm=norm)
    assert model.input_multiple == 2 ** (depth - 1)
    x = torch.randn(2, 2, edge, edge + model.input_multiple, edge)  # (N, C, D, H, W), not cubic
    assert model(x).shape == (2, 3) + x.shape[2:]


@pytest.mark.parametrize("convs_per_level", [1, 3])
@pytest.mark.parametrize("depth", [1, 3])
def test_unet3d_structure(depth, convs_per_level):
    model = unet3d(base_channels=4, depth=depth, convs_per_level=convs_per_level)
    assert _count(model, nn.Conv3d) == convs_per_level * (2 * depth - 1) + 1
    assert _count(model, nn.InstanceNorm3d) == convs_per_level * (2 * depth - 1)
    assert [up.out_channels for up in model.ups] == [4 * 2**i for i in reversed(range(depth - 1))]
    assert model.encoders[-1][0].out_channels == 4 * 2 ** (depth - 1)


def test_unet3d_check_input_size():
    model = unet3d(depth=3)
    model.check_input_size(4)
    model.check_input_size(12)
    for bad in (10, 2, 0):
        with pytest.raises(HybridparError, match="not a multiple of 4"):
            model.check_input_size(bad)


UNET3D_ERRORS = [
    ("in_channels", 0), ("num_classes", 0), ("base_channels", 0), ("depth", 0), ("depth", 2.5),
    ("convs_per_level", 0), ("norm", "group"), ("norm", None),
]


@pytest.mark.parametrize("name, value", UNET3D_ERRORS, ids=str)
def test_unet3d_argument_errors(name, value):
    with pytest.raises(HybridparError, match=re.escape(f"{name}={value!r}")) as err:
        unet3d(**{name: value})
    if name == "norm":
        assert all(repr(n) in str(err.value) for n in NORMS)
