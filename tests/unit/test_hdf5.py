"""Slab-parallel HDF5 reading: slabs equal the slices of a full read (even and uneven grids, crops,
both layouts), bytes read are the slab's share, and every kind of bad file is a clear error."""

import itertools
import math
import os

import h5py
import numpy as np
import pytest
import torch

from hybridpar.data import COSMOFLOW, SEGMENTATION, SampleFormat, SlabDataset, SlabLoader, eval_batches
from hybridpar.errors import DataError
from hybridpar.geometry import Grid

RAW = SampleFormat("full", "unitPar", "vector", "channels_last", "none")


def write_cosmo(path, volume_DHWC, params=(0.1, -0.2, 0.3, 0.4), layout="DHWC", chunks=None):
    data = volume_DHWC if layout == "DHWC" else np.moveaxis(volume_DHWC, 3, 0)
    with h5py.File(path, "w") as f:
        f.create_dataset("full", data=data, chunks=chunks)
        f["unitPar"] = np.asarray(params, np.float32)
        f.attrs["layout"] = layout
    return path


def volume(shape_DHWC, seed=0):
    return np.random.default_rng(seed).integers(0, 50, shape_DHWC).astype(np.int16)


def full_read(vol_DHWC, origin, crop):
    box = tuple(slice(o, o + crop) for o in origin)
    return torch.from_numpy(np.moveaxis(vol_DHWC[box], 3, 0).astype(np.float32))


GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (3, 1, 1), (1, 3, 2), (2, 2, 2)]


@pytest.mark.parametrize("layout", ["DHWC", "CDHW"])
@pytest.mark.parametrize("grid", GRIDS)
def test_slabs_equal_slices_of_full_read(tmp_path, layout, grid):
    vol = volume((10, 9, 7, 4))
    path = write_cosmo(tmp_path / "a.h5", vol, layout=layout)
    ds = SlabDataset([path], SampleFormat("full", "unitPar", "vector", "auto", "none"))
    whole = full_read(vol, (0, 0, 0), 10)[:, :, :9, :7]
    g = Grid(grid)
    for rank in range(g.size):
        x, y = ds.read(0, g, rank)
        box = tuple(slice(lo, hi) for lo, hi in g.slab((10, 9, 7), rank))
        torch.testing.assert_close(x, whole[(slice(None),) + box], rtol=0, atol=0)
        torch.testing.assert_close(y, torch.tensor([0.1, -0.2, 0.3, 0.4]))


@pytest.mark.parametrize("grid", [(1, 1, 1), (2, 1, 1), (3, 2, 1), (2, 2, 2)])
def test_crops_tile_the_universe(tmp_path, grid):
    vol = volume((12, 12, 12, 4), seed=1)
    path = write_cosmo(tmp_path / "u.h5", vol)
    ds = SlabDataset([path], COSMOFLOW, crop=6)
    assert len(ds) == 8 and ds.sample_shape == (4, 6, 6, 6)
    g = Grid(grid)
    for index, origin in enumerate(itertools.product((0, 6), repeat=3)):
        want = torch.log1p(full_read(vol, origin, 6))
        for rank in range(g.size):
            box = tuple(slice(lo, hi) for lo, hi in g.slab((6, 6, 6), rank))
            torch.testing.assert_close(ds.read(index, g, rank)[0], want[(slice(None),) + box])


def test_crops_per_file_and_chunked_files(tmp_path):
    vol = volume((8, 8, 8, 4))
    paths = [write_cosmo(tmp_path / f"{i}.h5", vol, chunks=(4, 4, 4, 4)) for i in range(3)]
    ds = SlabDataset(paths, RAW, crop=4, crops_per_file=2)
    assert len(ds) == 6
    assert [origin for _, origin in ds.samples[:2]] == [(0, 0, 0), (0, 0, 4)]
    torch.testing.assert_close(ds.read(1, Grid((1, 1, 1)), 0)[0], full_read(vol, (0, 0, 4), 4))


@pytest.mark.parametrize("grid", [(2, 1, 1), (1, 2, 1), (1, 1, 4), (2, 2, 1)])
def test_bytes_read_are_the_slab_share(tmp_path, grid):
    vol = volume((16, 16, 16, 4))
    path = write_cosmo(tmp_path / "a.h5", vol)
    g = Grid(grid)
    sample_bytes = vol.nbytes
    metadata = _bytes_after_open(path)
    for rank in range(g.size):
        ds = SlabDataset([path], RAW)
        ds.read(0, g, rank)
        share = math.prod(hi - lo for lo, hi in g.slab((16, 16, 16), rank)) * 4 * 2
        assert share == sample_bytes // g.size
        target = 4 * 4  # the unitPar vector
        assert ds.bytes_read - metadata - target == share, f"rank {rank} read more than its slab"
        ds.close()


def _bytes_after_open(path) -> int:
    """What opening the file reads (superblock, object headers): the reader's only overhead."""
    from hybridpar.data.hdf5 import CountingFile

    with CountingFile(path) as fileobj, h5py.File(fileobj, "r") as f:
        f["full"].id, f["unitPar"].id
        return fileobj.bytes_read


def test_segmentation_labels_are_sliced_with_the_volume(tmp_path):
    rng = np.random.default_rng(0)
    image, label = rng.normal(size=(1, 8, 6, 6)).astype(np.float32), rng.integers(0, 3, (8, 6, 6)).astype(np.uint8)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f["image"], f["label"] = image, label
        f.attrs["layout"] = "CDHW"
    ds = SlabDataset([tmp_path / "s.h5"], SEGMENTATION)
    g = Grid((2, 1, 2))
    for rank in range(4):
        (d0, d1), (h0, h1), (w0, w1) = g.slab((8, 6, 6), rank)
        x, y = ds.read(0, g, rank)
        torch.testing.assert_close(x, torch.from_numpy(image[:, d0:d1, h0:h1, w0:w1]))
        assert y.dtype == torch.long and torch.equal(y, torch.from_numpy(label[d0:d1, h0:h1, w0:w1]).long())


def _bad_files(tmp_path):
    good = write_cosmo(tmp_path / "good.h5", volume((8, 8, 8, 4)))
    with h5py.File(tmp_path / "name.h5", "w") as f:
        f["volume"] = volume((8, 8, 8, 4))
        f["unitPar"] = np.zeros(4, np.float32)
    with h5py.File(tmp_path / "shape.h5", "w") as f:
        f["full"], f["unitPar"] = volume((8, 8, 8, 4))[..., 0], np.zeros(4, np.float32)
    with h5py.File(tmp_path / "dtype.h5", "w") as f:
        f["full"], f["unitPar"] = np.zeros((8, 8, 8, 4), dtype="S1"), np.zeros(4, np.float32)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["full"], f["unitPar"] = volume((8, 8, 8, 3)), np.zeros(4, np.float32)
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    (tmp_path / "garbage.h5").write_bytes(b"not hdf5 at all" * 100)
    with h5py.File(tmp_path / "vector.h5", "w") as f:  # a 2-D target would broadcast against the output
        f["full"], f["unitPar"] = volume((8, 8, 8, 4)), np.zeros((4, 1), np.float32)
    with h5py.File(tmp_path / "link.h5", "w") as f:
        f["full"], f["unitPar"] = h5py.ExternalLink("elsewhere.h5", "/full"), np.zeros(4, np.float32)
    with h5py.File(tmp_path / "virtual.h5", "w") as f:  # its source is missing: HDF5 itself would crash
        layout = h5py.VirtualLayout((8, 8, 8, 4), np.int16)
        layout[...] = h5py.VirtualSource(str(tmp_path / "gone.h5"), "full", (8, 8, 8, 4))
        f.create_virtual_dataset("full", layout)
        f["unitPar"] = np.zeros(4, np.float32)
    with h5py.File(tmp_path / "external.h5", "w") as f:
        f.create_dataset("full", (8, 8, 8, 4), np.int16, external=[(str(tmp_path / "raw.bin"), 0, h5py.h5f.UNLIMITED)])
        f["unitPar"] = np.zeros(4, np.float32)
    os.mkfifo(tmp_path / "fifo.h5")  # opening it would wait for a writer forever
    return {
        "missing": (tmp_path / "missing.h5", "file not found"),
        "name": (tmp_path / "name.h5", "no dataset 'full'"),
        "shape": (tmp_path / "shape.h5", "expected numbers of shape"),
        "dtype": (tmp_path / "dtype.h5", "expected numbers of shape"),
        "channels": (tmp_path / "other.h5", "most files have 4 channels"),
        "truncated": (truncated, "truncated"),
        "garbage": (tmp_path / "garbage.h5", "not a readable HDF5 file"),
        "2-D target": (tmp_path / "vector.h5", r"target 'unitPar' is float32 of shape \(4, 1\); expected a vector"),
        "external link": (tmp_path / "link.h5", "dataset 'full' is an external link to 'elsewhere.h5'; copy"),
        "virtual": (tmp_path / "virtual.h5", "dataset 'full' is virtual: its data lie in other files; copy"),
        "external storage": (tmp_path / "external.h5", "dataset 'full' is stored in external files"),
        "fifo": (tmp_path / "fifo.h5", "not a regular file"),
    }, good


@pytest.mark.parametrize("kind", ["missing", "name", "shape", "dtype", "channels", "truncated", "garbage",
                                  "2-D target", "external link", "virtual", "external storage", "fifo"])
def test_bad_files_name_the_file_and_sample(tmp_path, kind):
    bad, good = _bad_files(tmp_path)
    path, message = bad[kind]
    with pytest.raises(DataError, match=message) as err:
        SlabDataset([good, path], RAW)
    assert str(path) in str(err.value) and "sample file 1" in str(err.value)


def test_another_tasks_data_is_named_as_such(tmp_path):
    """Segmentation volumes read as CosmoFlow universes (or the reverse) are not damaged files: the error names the
    datasets found, those expected and the config keys that choose them."""
    from hybridpar.data import synth

    seg = synth.synth_segmentation(tmp_path / "seg", 1, 8)[0]
    cosmo = synth.synth_cosmoflow(tmp_path / "cosmo", 1, 8)[0]
    with pytest.raises(DataError) as err:
        SlabDataset([seg], COSMOFLOW)
    assert str(err.value) == (f"{seg} (sample file 0): holds segmentation data (datasets 'image' and 'label'), not "
                              "the datasets 'full' and 'unitPar' this run reads; train on it with data.format = "
                              '"segmentation" and model.name = "unet3d", or point data.train / data.val at files of '
                              "this run's task")
    with pytest.raises(DataError, match='holds cosmoflow data .* data.format = "cosmoflow" and model.name = '
                                        '"cosmoflow"') as err:
        SlabDataset([cosmo], SEGMENTATION)
    assert "damaged" not in str(err.value)


def test_skip_bad_counts_and_skips(tmp_path):
    bad, good = _bad_files(tmp_path)
    ds = SlabDataset([good] + [p for p, _ in bad.values()] + [good], RAW, skip_bad=True)
    assert len(ds) == 2 and len(ds.skipped) == len(bad)
    assert {p for p, _ in ds.skipped} == {p for p, _ in bad.values()}


def test_skip_bad_keeps_the_shape_of_most_files(tmp_path):
    odd = write_cosmo(tmp_path / "a_odd.h5", volume((4, 4, 4, 4)))  # first in order, but the odd one out
    usual = [write_cosmo(tmp_path / f"b{i}.h5", volume((8, 8, 8, 4), seed=i)) for i in range(2)]
    ds = SlabDataset([odd] + usual, RAW, skip_bad=True)
    assert [info.path for info in ds.infos] == usual and ds.sample_shape == (4, 8, 8, 8)
    assert ds.skipped[0][0] == odd and "most files have 4 channels, volume (8, 8, 8)" in ds.skipped[0][1]


def test_truncated_header_is_reported_as_truncated(tmp_path):
    good = write_cosmo(tmp_path / "good.h5", volume((8, 8, 8, 4)))
    cut = tmp_path / "cut.h5"
    cut.write_bytes(good.read_bytes()[:1200])  # the superblock says the file is longer
    with pytest.raises(DataError, match="cut.h5 \\(sample file 0\\): truncated: the file is shorter"):
        SlabDataset([cut], RAW)


def test_labels_outside_the_classes_name_the_file_and_sample(tmp_path):
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f["image"], f["label"] = np.zeros((1, 4, 4, 4), np.float32), np.full((4, 4, 4), 3, np.uint8)
        f.attrs["layout"] = "CDHW"
    SlabDataset([tmp_path / "s.h5"], SEGMENTATION, num_classes=4).read(0, Grid((1, 1, 1)), 0)
    ds = SlabDataset([tmp_path / "s.h5"], SEGMENTATION, num_classes=3)
    with pytest.raises(DataError, match=r"s.h5 \(sample 0\): labels 3..3 .* num_classes = 3"):
        ds.read(0, Grid((2, 1, 1)), 1)


@pytest.mark.parametrize("where", ["input", "target", "log1p"])
def test_non_finite_values_name_the_file_and_sample(tmp_path, where):
    vol, params = volume((8, 8, 8, 2)).astype(np.float32), np.zeros(4, np.float32)
    if where == "input":
        vol[5, 0, 0, 1] = np.nan
    elif where == "target":
        params[2] = np.inf
    else:
        vol[1, 2, 3, 0] = -2  # log1p(-2) is NaN
    path = write_cosmo(tmp_path / "n.h5", vol, params)
    ds = SlabDataset([path], COSMOFLOW if where == "log1p" else RAW)
    grid = Grid((2, 1, 1))
    message = {"input": r"\(sample 0\): dataset 'full', slab .*: 1 NaN or infinite value\(s\); fix the file",
               "target": r"\(sample 0\): target 'unitPar': 1 NaN or infinite value",
               "log1p": r"1 NaN or infinite value\(s\) \(after log1p: values below -1 have none\)"}[where]
    rank = 1 if where == "input" else 0  # the NaN of the input lies in rank 1's slab only
    if where == "input":
        ds.read(0, grid, 0)
    with pytest.raises(DataError, match=message):
        ds.read(0, grid, rank)


def test_crop_larger_than_volume(tmp_path):
    path = write_cosmo(tmp_path / "a.h5", volume((8, 8, 8, 4)))
    with pytest.raises(DataError, match="data.crop = 16"):
        SlabDataset([path], RAW, crop=16)


def _dataset(tmp_path, n):
    paths = [write_cosmo(tmp_path / f"{i:02d}.h5", volume((4, 4, 4, 4), seed=i), params=(i, 0, 0, 0))
             for i in range(n)]
    return SlabDataset(paths, RAW)


def _batch_ids(loader, start, stop):
    return [sorted(int(v) for v in y[:, 0]) for _, _, y in loader.batches(start, stop)]


@pytest.mark.parametrize("rows", [((0, 2), (2, 4)), ((0, 3), (3, 4))], ids=["even", "uneven shares"])
def test_dp_groups_read_disjoint_samples_forming_the_global_batch(tmp_path, rows):
    ds = _dataset(tmp_path, 13)
    grid = Grid((1, 1, 1))
    one = SlabLoader(ds, batch_size=4, dp=1, rows=(0, 4), grid=grid, spatial_rank=0, seed=3)
    parts = [SlabLoader(ds, batch_size=4, dp=2, rows=r, grid=grid, spatial_rank=0, seed=3) for r in rows]
    assert one.steps_per_epoch == 3 and parts[0].steps_per_epoch == 3
    for a, b, want in zip(_batch_ids(parts[0], 0, 6), _batch_ids(parts[1], 0, 6), _batch_ids(one, 0, 6),
                          strict=True):
        assert (len(a), len(b)) == tuple(stop - start for start, stop in rows) and not set(a) & set(b)
        assert sorted(a + b) == want


def test_loader_resumes_mid_epoch_with_the_same_batches(tmp_path):
    ds = _dataset(tmp_path, 10)
    loader = SlabLoader(ds, batch_size=2, dp=1, rows=(0, 2), grid=Grid((1, 1, 1)), spatial_rank=0, seed=0, prefetch=3)
    full = [y[:, 0].tolist() for _, _, y in loader.batches(0, 12)]
    again = SlabLoader(ds, batch_size=2, dp=1, rows=(0, 2), grid=Grid((1, 1, 1)), spatial_rank=0, seed=0)
    assert [y[:, 0].tolist() for _, _, y in again.batches(7, 12)] == full[7:]
    assert full[:5] != full[5:10], "epochs are shuffled differently"


@pytest.mark.parametrize("num_samples, limit", [(7, 0), (7, 5), (2, 0)])
def test_eval_batches_cover_every_sample_once(tmp_path, num_samples, limit):
    ds = _dataset(tmp_path, num_samples)
    seen, shapes = [], []
    for r in range(3):
        batches = list(eval_batches(ds, batch_size=3, dp=(3, r), grid=Grid((1, 1, 1)), spatial_rank=0, limit=limit))
        shapes.append([len(y) for _, y, _ in batches])
        seen += [int(v) for _, y, num_valid in batches for v in y[:num_valid, 0]]
    assert sorted(seen) == list(range(limit or num_samples))
    assert shapes[0] == shapes[1] == shapes[2], "every dp rank runs the same batches (padded)"


def test_open_files_are_bounded_and_bytes_still_counted(tmp_path, monkeypatch):
    from hybridpar.data import hdf5

    monkeypatch.setattr(hdf5, "MAX_OPEN_FILES", 2)
    ds = _dataset(tmp_path, 5)
    for i in range(5):
        ds.read(i, Grid((1, 1, 1)), 0)
    assert len(ds._files) == 2
    per_file = ds.bytes_read / 5
    ds.read(0, Grid((1, 1, 1)), 0)  # reopened: its open overhead counts again
    assert ds.bytes_read > 5 * per_file
