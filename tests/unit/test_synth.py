"""The synthetic generators: file layouts, determinism, that each CosmoFlow parameter is visible in the
field (and better estimated from larger crops), that segmentation labels match the image, and argument errors."""

import h5py
import numpy as np
import pytest

from hybridpar.data import synth
from hybridpar.data.hdf5 import COSMOFLOW, SEGMENTATION, SampleFormat, inspect_file
from hybridpar.errors import HybridparError

AXES = (0, 1, 2)


def _read(path, *names):
    with h5py.File(path, "r") as f:
        return [f[n][...] for n in names] + [dict(f.attrs)]


def _spearman(a, b) -> float:
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731 (no ties among continuous values)
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def _band_power(field, lo, hi) -> float:
    """Mean |FFT|^2 / N of the modes with lo <= |k| < hi (rad / cell)."""
    k = synth._wavenumbers(field.shape[0])
    power = np.abs(np.fft.rfftn(field - field.mean())) ** 2 / field.size
    return float(power[(k >= lo) & (k < hi)].mean())


# Statistics of one (S, S, S, 4) count cube, each aimed at one parameter.

def _growth_stat(x):
    """Omega_m: growth from z = 0 to z = 3, cov(l3, l1) / cov(l0, l1) of log Gaussian-smoothed counts
    (the z = 0.5 channel as reference: its independent Poisson noise drops out of the covariances)."""
    k = synth._wavenumbers(x.shape[0])
    logs = [np.log(np.fft.irfftn(np.fft.rfftn(x[..., c]) * np.exp(-k ** 2 / 2), s=x.shape[:3], axes=AXES))
            for c in range(4)]
    cov = lambda a, b: np.mean((a - a.mean()) * (b - b.mean()))  # noqa: E731
    return cov(logs[3], logs[1]) / cov(logs[0], logs[1])


def _amplitude_stat(x):
    """sigma_8: variance of the z = 3 density contrast in top-hat spheres of R8 (the most linear snapshot)."""
    k = synth._wavenumbers(x.shape[0])
    kr = np.maximum(k * synth.R8_CELLS, 1e-6)
    tophat = 3 * (np.sin(kr) - kr * np.cos(kr)) / kr ** 3
    delta = x[..., 3] / x[..., 3].mean() - 1
    return np.fft.irfftn(np.fft.rfftn(delta) * tophat, s=delta.shape, axes=AXES).var()


def _slope_stat(x):
    """n_s: high-k power ratio of log1p counts at z = 1.5, less the white (shot) noise of the |k| > pi corners."""
    l2 = np.log1p(x[..., 2])
    white = _band_power(l2, 3.3, 6.0)
    return np.log((_band_power(l2, 1.9, 3.0) - white) / (_band_power(l2, 1.2, 1.9) - white))


def _turnover_stat(x):
    """H0: low-k power ratio of log1p counts at z = 0, across the turnover."""
    l0 = np.log1p(x[..., 0])
    return np.log(_band_power(l0, 0.5, 0.8) / _band_power(l0, 0.3, 0.5))


def _universes(num, size, seed):
    """(parameters (num, 4), float32 counts) of universes drawn as synth_cosmoflow draws them."""
    params, cubes = [], []
    for i in range(num):
        rng = np.random.default_rng([seed, i])
        cosmo = synth.draw_cosmology(rng)
        params.append(cosmo.values)
        cubes.append(synth.universe_counts(cosmo, size, rng, 4.0).astype(np.float32))
    return np.array(params), cubes


def _crops(x, size):
    n = x.shape[0]
    return [x[i:i + size, j:j + size, k:k + size]
            for i in range(0, n, size) for j in range(0, n, size) for k in range(0, n, size)]


def test_cosmoflow_layouts(tmp_path):
    (last,) = synth.synth_cosmoflow(tmp_path / "last", 1, 16, seed=3)
    (first,) = synth.synth_cosmoflow(tmp_path / "first", 1, 16, seed=3, channels_last=False)
    full_last, unit, attrs = _read(last, "full", "unitPar")
    full_first, _, attrs_first = _read(first, "full", "unitPar")
    assert last.name == "univ_00000.h5"
    assert full_last.shape == (16, 16, 16, 4) and full_last.dtype == np.int16 and attrs["layout"] == "DHWC"
    assert full_first.shape == (4, 16, 16, 16) and attrs_first["layout"] == "CDHW"
    np.testing.assert_array_equal(np.moveaxis(full_first, 0, -1), full_last)
    assert unit.shape == (4,) and unit.dtype == np.float32 and np.all(np.abs(unit) <= 1)
    assert list(attrs["param_names"]) == list(synth.PARAM_NAMES)
    low, high = attrs["param_low"], attrs["param_high"]
    np.testing.assert_allclose(unit, 2 * (attrs["phys_par"] - low) / (high - low) - 1, rtol=1e-6)
    assert inspect_file(last, COSMOFLOW, 0).layout == "channels_last"  # the project's reader accepts both
    assert inspect_file(first, SampleFormat("full", "unitPar", "vector"), 0).layout == "channels_first"


def test_cosmoflow_deterministic(tmp_path):
    a = synth.synth_cosmoflow(tmp_path / "a", 3, 16, seed=5)
    b = synth.synth_cosmoflow(tmp_path / "b", 3, 16, seed=5)
    c = synth.synth_cosmoflow(tmp_path / "c", 3, 16, seed=6)
    for pa, pb, pc in zip(a, b, c):
        xa, ya, _ = _read(pa, "full", "unitPar")
        xb, yb, _ = _read(pb, "full", "unitPar")
        xc, yc, _ = _read(pc, "full", "unitPar")
        assert xa.tobytes() == xb.tobytes() and ya.tobytes() == yb.tobytes()
        assert xa.tobytes() != xc.tobytes() and ya.tobytes() != yc.tobytes()
    rng = np.random.default_rng([5, 2])  # sample 2 alone, without the files before it
    again = synth.universe_counts(synth.draw_cosmology(rng), 16, rng, 4.0)
    np.testing.assert_array_equal(again, _read(a[2], "full")[0])


@pytest.mark.parametrize("mean_count", [1.0, 4.0])
def test_counts_have_the_intended_mean(mean_count):
    rng = np.random.default_rng(0)
    counts = synth.universe_counts(synth.draw_cosmology(rng), 32, rng, mean_count)
    assert counts.min() >= 0
    # lognormal rho has mean 1 exactly in expectation; a 32^3 box misses the modes longer than it (~5%)
    np.testing.assert_allclose(counts.mean(axis=AXES), mean_count, rtol=0.05)


def test_each_parameter_is_visible_in_the_field():
    params, cubes = _universes(32, 64, seed=1)
    for stat, column in ((_growth_stat, 0), (_amplitude_stat, 1), (_slope_stat, 2), (_turnover_stat, 3)):
        r = _spearman([stat(x) for x in cubes], params[:, column])
        assert abs(r) > 0.8, f"{stat.__name__} vs {synth.PARAM_NAMES[column]}: Spearman r = {r:.2f}"


def test_larger_crops_estimate_better():
    params, cubes = _universes(6, 128, seed=3)

    def h0_error(size):
        """rms error of H0 predicted from the turnover statistic of crops, by a linear fit per crop size."""
        stats = np.array([_turnover_stat(c) for x in cubes for c in _crops(x, size)])
        truth = np.repeat(params[:, 3], len(stats) // len(cubes))
        design = np.c_[stats, np.ones_like(stats)]
        return np.std(truth - design @ np.linalg.lstsq(design, truth, rcond=None)[0])

    def amplitude_scatter(size):
        """Relative scatter of the sigma_8 statistic across the crops of one universe, averaged."""
        per = np.array([[_amplitude_stat(c) for c in _crops(x, size)] for x in cubes])
        return np.mean(per.std(axis=1) / per.mean(axis=1))

    # cosmic variance: 8x the volume has 8x the modes, so ~1/sqrt(8) of the scatter; margins leave room
    assert h0_error(64) < 0.8 * h0_error(32)
    assert amplitude_scatter(64) < 0.5 * amplitude_scatter(32)


def test_crop_looks_like_a_smaller_universe():
    cosmo = synth.Cosmology(0.3, 0.8, 1.0, 70.0)
    big = synth.universe_counts(cosmo, 64, np.random.default_rng(0), 4.0)
    crops = _crops(big.astype(np.float32), 32)
    small = [synth.universe_counts(cosmo, 32, np.random.default_rng([1, i]), 4.0) for i in range(8)]
    var_crops = np.mean([np.log1p(c).var(axis=AXES) for c in crops], axis=0)
    var_small = np.mean([np.log1p(s.astype(np.float32)).var(axis=AXES) for s in small], axis=0)
    np.testing.assert_allclose(var_crops, var_small, rtol=0.05)  # per-channel scatter of the mean is ~1%


def test_segmentation_layouts_and_determinism(tmp_path):
    first = synth.synth_segmentation(tmp_path / "a", 2, 16, seed=2)
    again = synth.synth_segmentation(tmp_path / "b", 2, 16, seed=2)
    other = synth.synth_segmentation(tmp_path / "c", 2, 16, seed=3)
    (last,) = synth.synth_segmentation(tmp_path / "d", 1, 16, seed=2, channels_last=True)
    image, label, attrs = _read(first[0], "image", "label")
    assert first[0].name == "seg_00000.h5"
    assert image.shape == (1, 16, 16, 16) and image.dtype == np.float32 and attrs["layout"] == "CDHW"
    assert label.shape == (16, 16, 16) and label.dtype == np.uint8
    image_last, label_last, attrs_last = _read(last, "image", "label")
    assert image_last.shape == (16, 16, 16, 1) and attrs_last["layout"] == "DHWC"
    np.testing.assert_array_equal(image_last[..., 0], image[0])
    np.testing.assert_array_equal(label_last, label)
    for a, b, c in zip(first, again, other):
        assert _read(a, "image")[0].tobytes() == _read(b, "image")[0].tobytes()
        assert _read(a, "label")[0].tobytes() == _read(b, "label")[0].tobytes()
        assert _read(a, "image")[0].tobytes() != _read(c, "image")[0].tobytes()
    inspect_file(first[0], SEGMENTATION, 0)
    inspect_file(last, SEGMENTATION, 0)


@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_segmentation_labels_match_the_image(num_classes):
    for i in range(4):
        image, label = synth.segmentation_volume(32, num_classes, np.random.default_rng([0, i]), 0.5)
        assert set(np.unique(label)) == set(range(num_classes))
        means = [image[label == c].mean() for c in range(num_classes)]
        # class c has intensity c (+- 10% per object), shifted by the smooth background (rms 0.3)
        assert np.all(np.diff(means) > 0.5), means
        background = image[label == 0]
        # noise 0.5 and background variation 0.3 in quadrature: ~0.58
        assert 0.45 < background.std() < 0.75


def test_segmentation_is_not_a_per_voxel_threshold():
    image, label = synth.segmentation_volume(32, 3, np.random.default_rng(0), 0.5)
    nearest = np.clip(np.rint(image), 0, 2)
    dice = [2 * np.sum((nearest == c) & (label == c)) / (np.sum(nearest == c) + np.sum(label == c)) for c in (1, 2)]
    assert np.mean(dice) < 0.75  # a small 3D U-Net reaches ~0.93 within 300 CPU steps on such volumes


def test_on_sample_and_overwrite(tmp_path):
    seen = []
    synth.synth_segmentation(tmp_path / "new" / "dir", 3, 8, on_sample=seen.append)
    assert seen == [0, 1, 2]
    with pytest.raises(HybridparError, match="seg_00000.h5 already exists .*overwrite=True"):
        synth.synth_segmentation(tmp_path / "new" / "dir", 3, 8, seed=1)
    synth.synth_segmentation(tmp_path / "new" / "dir", 3, 8, seed=1, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == [f"seg_0000{i}.h5" for i in range(3)]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_samples": 0}, "num_samples = 0: must be an integer >= 1"),
    ({"num_samples": 2.5}, "num_samples = 2.5"),
    ({"size": 4}, "size = 4: must be an integer >= 8"),
    ({"seed": -1}, "seed = -1: must be an integer >= 0"),
    ({"mean_count": 0.0}, "mean_count = 0.0"),
    ({"num_classes": 1}, "num_classes = 1: must be an integer >= 2"),
    ({"num_classes": 300}, "num_classes = 300: labels are uint8"),
    ({"noise": -0.1}, "noise = -0.1"),
])
def test_argument_errors(tmp_path, kwargs, message):
    generator = synth.synth_cosmoflow if "mean_count" in kwargs else synth.synth_segmentation
    args = {"num_samples": 1, "size": 8} | kwargs
    with pytest.raises(HybridparError, match=message):
        generator(tmp_path, args.pop("num_samples"), args.pop("size"), **args)
    assert not list(tmp_path.iterdir())


def test_out_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(HybridparError, match="is a file, not a directory"):
        synth.synth_cosmoflow(tmp_path / "taken", 1, 8)


def test_a_sample_larger_than_the_memory_is_refused_before_the_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "available_memory", lambda: 2**30)
    with pytest.raises(HybridparError, match=r"size = 512 \(CLI: --size\): one sample of 512\^3 voxels takes about "
                                             r"5 GiB to generate \(40 bytes per voxel\), more than the 1 GiB this "
                                             r"machine has available; use a size of at most 299"):
        synth.synth_cosmoflow(tmp_path / "out", 1, 512)
    assert not (tmp_path / "out").exists()
    assert 299**3 * synth.BYTES_PER_VOXEL <= 2**30 < 300**3 * synth.BYTES_PER_VOXEL


@pytest.mark.parametrize("generator, worker", [(synth.synth_cosmoflow, "universe_counts"),
                                               (synth.synth_segmentation, "segmentation_volume")])
def test_a_failed_generation_leaves_no_folder_and_no_file(tmp_path, monkeypatch, generator, worker):
    def fail(*args):
        raise MemoryError("out of memory")

    monkeypatch.setattr(synth, worker, fail)
    with pytest.raises(MemoryError):
        generator(tmp_path / "new" / "out", 2, 8)
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("")
    with pytest.raises(MemoryError):
        generator(tmp_path / "kept" / "out", 2, 8)
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]

