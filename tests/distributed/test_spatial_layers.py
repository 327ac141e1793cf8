"""Every spatial layer against one process: forward, input gradient, parameter gradients, running
statistics; float64; 1-D, 2-D and 3-D grids, even and uneven slabs, 2, 4 and 8 ranks."""

import pytest

from support import cases

C = dict(in_channels=2, out_channels=3)
CONV3D = [
    dict(C, kernel_size=3, padding=1),
    dict(C, kernel_size=3),
    dict(C, kernel_size=5, padding=2, bias=False),
    dict(C, kernel_size=3, stride=2, padding=1),
    dict(C, kernel_size=4, stride=2, padding=1),
    dict(C, kernel_size=(4, 2, 3), padding="same"),
    dict(C, kernel_size=3, padding="valid", stride=(1, 2, 3)),
    dict(C, kernel_size=3, padding=2, dilation=2),
    dict(in_channels=2, out_channels=4, kernel_size=3, padding=1, groups=2),
    dict(C, kernel_size=3, padding=1, padding_mode="circular"),
    dict(C, kernel_size=5, padding=2, padding_mode="circular", stride=2),
    dict(C, kernel_size=3, padding=1, padding_mode="reflect"),
    dict(C, kernel_size=3, padding=(1, 2, 1), padding_mode="replicate"),
    dict(C, kernel_size=1),
    dict(C, kernel_size=3, stride=3),
]
CONVT3D = [
    dict(C, kernel_size=2, stride=2),
    dict(C, kernel_size=3, stride=2, padding=1, output_padding=1),
    dict(C, kernel_size=3, padding=1),
    dict(C, kernel_size=4, stride=2, padding=1),
    dict(C, kernel_size=2, stride=3, output_padding=2),
    dict(C, kernel_size=3, stride=2, dilation=2, output_padding=1),
    dict(in_channels=2, out_channels=4, kernel_size=3, stride=2, groups=2, bias=False),
]
POOL3D = [
    ("MaxPool3d", dict(kernel_size=2)),
    ("MaxPool3d", dict(kernel_size=3, stride=1, padding=1)),
    ("MaxPool3d", dict(kernel_size=3, stride=2, padding=1)),
    ("MaxPool3d", dict(kernel_size=2, stride=2, ceil_mode=True)),
    ("MaxPool3d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("MaxPool3d", dict(kernel_size=2, dilation=2, stride=1)),
    ("AvgPool3d", dict(kernel_size=2)),
    ("AvgPool3d", dict(kernel_size=3, stride=1, padding=1)),
    ("AvgPool3d", dict(kernel_size=3, stride=1, padding=1, count_include_pad=False)),
    ("AvgPool3d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("AvgPool3d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("AvgPool3d", dict(kernel_size=2, divisor_override=3)),
    ("AdaptiveAvgPool3d", dict(output_size=1)),
    ("AdaptiveMaxPool3d", dict(output_size=(1, 1, 1))),
]
NORM3D = [
    ("BatchNorm3d", dict(num_features=2)),
    ("BatchNorm3d", dict(num_features=2, momentum=None)),
    ("BatchNorm3d", dict(num_features=2, affine=False, track_running_stats=False)),
    ("InstanceNorm3d", dict(num_features=2)),
    ("InstanceNorm3d", dict(num_features=2, affine=True, track_running_stats=True)),
    ("GroupNorm", dict(num_groups=2, num_channels=2)),
    ("GroupNorm", dict(num_groups=1, num_channels=2, affine=False)),
]
UPSAMPLE3D = [
    dict(scale_factor=2, mode="nearest"),
    dict(size=(13, 11, 9), mode="nearest"),
    dict(scale_factor=1.5, mode="nearest-exact"),
    dict(scale_factor=2, mode="trilinear", align_corners=False),
    dict(scale_factor=2, mode="trilinear", align_corners=True),
    dict(size=(12, 11, 10), mode="trilinear"),
    dict(scale_factor=(1, 2, 3), mode="trilinear", align_corners=True),
]
MISC3D = [
    ("LeakyReLU", dict(negative_slope=0.3)),
    ("Flatten", dict()),
    ("Dropout", dict(p=0.5)),
    ("Dropout3d", dict(p=0.5)),
]

SPECS_3D = (
    [("Conv3d", c) for c in CONV3D]
    + [("ConvTranspose3d", c) for c in CONVT3D]
    + POOL3D + NORM3D + [("Upsample", u) for u in UPSAMPLE3D] + MISC3D
)
SHAPE_3D = (2, 2, 9, 8, 7)
SHAPE_3D_4 = (1, 2, 13, 9, 7)  # 4 parts along depth leave slabs of 4, 3, 3, 3; stride 3 still gives 4 rows
GRIDS_2 = [(2, 1, 1), (1, 1, 2)]
GRIDS_4 = [(4, 1, 1), (2, 2, 1), (1, 2, 2)]


def _id(spec):
    args = ",".join(f"{k}={v}" for k, v in spec[1].items() if k not in ("in_channels", "out_channels"))
    return f"{spec[0]}({args})"


def _train(spec) -> bool:
    return not spec[0].startswith("Dropout")


@pytest.mark.parametrize("grid", GRIDS_2, ids=str)
@pytest.mark.parametrize("spec", SPECS_3D, ids=_id)
def test_3d_two_ranks(dist2, spec, grid):
    dist2.run(cases.check_equivalence, spec=spec, shape=SHAPE_3D, grid=grid, train=_train(spec))


@pytest.mark.parametrize("grid", GRIDS_4, ids=str)
@pytest.mark.parametrize("spec", SPECS_3D, ids=_id)
def test_3d_four_ranks(dist4, spec, grid):
    dist4.run(cases.check_equivalence, spec=spec, shape=SHAPE_3D_4, grid=grid, train=_train(spec))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("grid", GRIDS_2 + [(1, 2, 1)], ids=str)
@pytest.mark.parametrize("spec", [("Conv3d", c) for c in CONV3D], ids=_id)
def test_conv3d_overlap_two_ranks(dist2, spec, grid, overlap):
    dist2.run(cases.check_equivalence, spec=spec, shape=SHAPE_3D, grid=grid, overlap=overlap)


@pytest.mark.parametrize("grid", GRIDS_4, ids=str)
@pytest.mark.parametrize("spec", [("Conv3d", c) for c in CONV3D], ids=_id)
def test_conv3d_overlap_four_ranks(dist4, spec, grid):
    dist4.run(cases.check_equivalence, spec=spec, shape=SHAPE_3D_4, grid=grid, overlap=True)


SPECS_2D = [
    ("Conv2d", dict(C, kernel_size=3, padding=1)),
    ("Conv2d", dict(C, kernel_size=3, stride=2, padding=1, padding_mode="circular")),
    ("Conv2d", dict(C, kernel_size=(2, 4), padding="same", dilation=(2, 1))),
    ("ConvTranspose2d", dict(C, kernel_size=3, stride=2, padding=1, output_padding=1)),
    ("MaxPool2d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("AvgPool2d", dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    ("BatchNorm2d", dict(num_features=2)),
    ("InstanceNorm2d", dict(num_features=2, affine=True)),
    ("Upsample", dict(scale_factor=2, mode="bilinear", align_corners=False)),
    ("Upsample", dict(scale_factor=3, mode="nearest")),
    ("AdaptiveAvgPool2d", dict(output_size=1)),
]
SPECS_1D = [
    ("Conv1d", dict(C, kernel_size=3, padding=1)),
    ("Conv1d", dict(C, kernel_size=5, stride=2, padding=2, padding_mode="circular")),
    ("ConvTranspose1d", dict(C, kernel_size=4, stride=2, padding=1)),
    ("MaxPool1d", dict(kernel_size=3, stride=2, padding=1)),
    ("AvgPool1d", dict(kernel_size=3, stride=1, padding=1, count_include_pad=False)),
    ("BatchNorm1d", dict(num_features=2)),
    ("Upsample", dict(scale_factor=2, mode="linear", align_corners=True)),
]


@pytest.mark.parametrize("grid", [(2, 1), (1, 2)], ids=str)
@pytest.mark.parametrize("spec", SPECS_2D, ids=_id)
def test_2d_two_ranks(dist2, spec, grid):
    dist2.run(cases.check_equivalence, spec=spec, shape=(2, 2, 9, 7), grid=grid)


@pytest.mark.parametrize("grid", [(2, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("spec", SPECS_2D, ids=_id)
def test_2d_four_ranks(dist4, spec, grid):
    dist4.run(cases.check_equivalence, spec=spec, shape=(2, 2, 9, 7), grid=grid)


@pytest.mark.parametrize("spec", SPECS_1D, ids=_id)
def test_1d(dist2, dist4, spec):
    dist2.run(cases.check_equivalence, spec=spec, shape=(2, 2, 11), grid=(2,))
    dist4.run(cases.check_equivalence, spec=spec, shape=(2, 2, 11), grid=(4,))


@pytest.mark.parametrize("spec", [s for s in SPECS_3D if s[0] in ("Conv3d", "ConvTranspose3d", "MaxPool3d",
                                                                   "AvgPool3d", "Upsample", "BatchNorm3d")][::2],
                         ids=_id)
@pytest.mark.slow
def test_3d_grid_eight_ranks(dist8, spec):
    dist8.run(cases.check_equivalence, spec=spec, shape=(2, 2, 9, 8, 7), grid=(2, 2, 2))


@pytest.mark.parametrize("grid", GRIDS_2, ids=str)
def test_residual_block_with_conv_subclass(dist2, grid):
    dist2.run(cases.check_equivalence, spec=("model", "Residual", {}), shape=SHAPE_3D, grid=grid)
