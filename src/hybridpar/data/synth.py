"""Synthetic datasets written as HDF5 files: toy CosmoFlow universes and labelled 3D volumes.

Sample ``i`` of seed ``k`` comes from ``np.random.default_rng([k, i])`` alone, so any sample can be
regenerated on its own. Lengths are in grid cells and wavenumbers in radians per cell, so a crop of a
large universe is statistically a smaller universe (up to the modes longer than the crop).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import h5py
import numpy as np

from hybridpar.errors import HybridparError
from hybridpar.host import available_memory, gib

PARAM_NAMES = ("Omega_m", "sigma_8", "n_s", "H0")
PARAM_LOW = np.array([0.20, 0.60, 0.80, 60.0])
PARAM_HIGH = np.array([0.40, 1.00, 1.20, 80.0])
REDSHIFTS = (0.0, 0.5, 1.5, 3.0)  # channel c is the snapshot at REDSHIFTS[c]
R8_CELLS = 2.0  # radius of the top-hat sphere sigma_8 is defined in
K_TURN = 0.5  # turnover wavenumber (rad / cell) at H0 = 70; it scales as (H0 / 70)^2
_K_TABLE = np.linspace(1e-4, np.pi, 4096)  # radial wavenumbers of the normalisation integrals


@dataclass(frozen=True)
class Cosmology:
    """The 4 parameters of one universe, in physical units (``PARAM_NAMES`` order)."""

    omega_m: float
    sigma_8: float
    n_s: float
    h0: float

    @property
    def values(self) -> np.ndarray:
        return np.array([self.omega_m, self.sigma_8, self.n_s, self.h0])

    @property
    def unit(self) -> np.ndarray:
        """The parameters mapped linearly from ``[PARAM_LOW, PARAM_HIGH]`` to ``[-1, 1]`` (``unitPar``)."""
        return (2 * (self.values - PARAM_LOW) / (PARAM_HIGH - PARAM_LOW) - 1).astype(np.float32)

    @property
    def k_turn(self) -> float:
        return K_TURN * (self.h0 / 70.0) ** 2


def draw_cosmology(rng: np.random.Generator) -> Cosmology:
    """Parameters drawn independently and uniformly in their ranges."""
    return Cosmology(*map(float, rng.uniform(PARAM_LOW, PARAM_HIGH)))


def growth_factor(z: float, omega_m: float) -> float:
    """Linear growth D(z) / D(0) of flat LCDM (Carroll, Press & Turner 1992, eq. 29)."""
    def g(z):
        e2 = omega_m * (1 + z) ** 3 + 1 - omega_m
        om, ol = omega_m * (1 + z) ** 3 / e2, (1 - omega_m) / e2
        return 2.5 * om / (om ** (4 / 7) - ol + (1 + om / 2) * (1 + ol / 70))
    return g(z) / ((1 + z) * g(0.0))


def _shape(k: np.ndarray, cosmo: Cosmology) -> np.ndarray:
    """Unnormalised P(k): k^n_s below the turnover, k^(n_s - 4) above it."""
    return k ** cosmo.n_s / (1 + (k / cosmo.k_turn) ** 4)


def _radial_integral(f: np.ndarray) -> float:
    """int d^3k / (2 pi)^3 f(|k|) over the sphere |k| < pi, for f on ``_K_TABLE``."""
    return float(np.trapezoid(_K_TABLE ** 2 * f, _K_TABLE) / (2 * np.pi ** 2))


def power_spectrum(k: np.ndarray, cosmo: Cosmology) -> np.ndarray:
    """Linear P(k) at z = 0 in cell^3, normalised so the rms in a sphere of R8_CELLS is sigma_8."""
    x = _K_TABLE * R8_CELLS
    tophat = 3 * (np.sin(x) - x * np.cos(x)) / x ** 3
    amplitude = cosmo.sigma_8 ** 2 / _radial_integral(_shape(_K_TABLE, cosmo) * tophat ** 2)
    return amplitude * _shape(k, cosmo)


def field_variance(cosmo: Cosmology) -> float:
    """Variance of the z = 0 Gaussian field per cell (the expectation, whatever the box size)."""
    return _radial_integral(power_spectrum(_K_TABLE, cosmo))


@lru_cache(maxsize=4)
def _wavenumbers(size: int) -> np.ndarray:
    """|k| (rad / cell) on the rfftn grid of a size^3 periodic box, float32 (S, S, S//2+1)."""
    k = 2 * np.pi * np.fft.fftfreq(size).astype(np.float32)
    kz = 2 * np.pi * np.fft.rfftfreq(size).astype(np.float32)
    return np.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2)


def gaussian_field(noise: np.ndarray, cosmo: Cosmology) -> np.ndarray:
    """White noise (unit variance per cell) coloured to P(k), with modes |k| > pi and k = 0 removed."""
    k = _wavenumbers(noise.shape[0])
    amplitude = np.sqrt(power_spectrum(np.maximum(k, 1e-6), cosmo), dtype=np.float32)
    amplitude[(k > np.pi) | (k == 0)] = 0
    return np.fft.irfftn(np.fft.rfftn(noise) * amplitude, s=noise.shape, axes=(0, 1, 2)).astype(np.float32)


def universe_counts(cosmo: Cosmology, size: int, rng: np.random.Generator, mean_count: float) -> np.ndarray:
    """Particle counts (S, S, S, 4) int16 of one universe at the 4 ``REDSHIFTS``.

    One Gaussian field delta scaled by the growth D(z) of each snapshot, made lognormal,
    rho = exp(D delta - D^2 var / 2) (mean 1), and Poisson-sampled with mean ``mean_count`` per cell.
    """
    delta = gaussian_field(rng.standard_normal((size,) * 3, dtype=np.float32), cosmo)
    var = field_variance(cosmo)
    counts = np.empty((size,) * 3 + (len(REDSHIFTS),), np.int16)
    for c, z in enumerate(REDSHIFTS):
        d = growth_factor(z, cosmo.omega_m)
        rate = np.exp(d * delta - np.float32(d * d * var / 2)) * np.float32(mean_count)
        counts[..., c] = np.minimum(rng.poisson(rate), np.iinfo(np.int16).max)
    return counts


def synth_cosmoflow(out_dir: str | os.PathLike, num_samples: int, size: int, *, seed: int = 0,
                    channels_last: bool = True, mean_count: float = 4.0, overwrite: bool = False,
                    on_sample: Callable[[int], None] | None = None) -> list[Path]:
    """Write ``univ_{i:05d}.h5`` files: ``full`` int16 counts (S, S, S, 4) or (4, S, S, S), ``unitPar``
    float32 (4,); attrs ``layout`` (``DHWC`` / ``CDHW``), ``param_names``, ``phys_par`` and the generator's
    settings. ``on_sample(i)`` is called after each file."""
    _check_common(num_samples, size, seed)
    if not (isinstance(mean_count, numbers.Real) and math.isfinite(mean_count) and 0 < mean_count <= 1000):
        raise HybridparError(f"mean_count = {mean_count!r}: must be a number in (0, 1000] "
                             f"(particles per cell; 1 to 10 is typical)")
    with _output_paths(out_dir, "univ_{:05d}.h5", num_samples, overwrite) as paths:
        for i, path in enumerate(paths):
            rng = np.random.default_rng([seed, i])
            cosmo = draw_cosmology(rng)
            counts = universe_counts(cosmo, size, rng, mean_count)  # (S, S, S, 4)
            full = counts if channels_last else np.ascontiguousarray(np.moveaxis(counts, -1, 0))
            attrs = {"layout": "DHWC" if channels_last else "CDHW", "param_names": list(PARAM_NAMES),
                     "phys_par": cosmo.values, "param_low": PARAM_LOW, "param_high": PARAM_HIGH,
                     "redshifts": np.array(REDSHIFTS), "mean_count": float(mean_count), "seed": seed, "index": i}
            _write(path, {"full": full, "unitPar": cosmo.unit}, attrs)
            if on_sample is not None:
                on_sample(i)
    return paths


SHAPES = ("sphere", "cube", "ellipsoid")  # object class c has shape SHAPES[(c - 1) % 3] and intensity c
BACKGROUND_STD = 0.3  # rms of the smooth background variation, in units of the class contrast


def object_mask(shape: str, size: int, rng: np.random.Generator) -> tuple[tuple[slice, ...], np.ndarray]:
    """A randomly placed, sized and rotated solid of ``shape``: its bounding box in the (S, S, S) volume
    and the bool mask inside that box (never empty: the voxel nearest the centre is inside)."""
    centre = rng.uniform(0.15, 0.85, 3) * size
    radius = max(1.5, rng.uniform(0.1, 0.2) * size)
    rotation, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    lo = np.maximum(np.floor(centre - 1.6 * radius), 0).astype(int)  # 1.6 radius bounds every shape
    hi = np.minimum(np.ceil(centre + 1.6 * radius) + 1, size).astype(int)
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    axes = (np.arange(a, b, dtype=np.float32) + 0.5 - c for a, b, c in zip(lo, hi, centre.astype(np.float32)))
    local = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1) @ rotation.astype(np.float32)  # (d, h, w, 3)
    if shape == "sphere":
        return box, (local ** 2).sum(-1) <= radius ** 2
    if shape == "cube":
        return box, np.abs(local).max(-1) <= 0.8 * radius
    semi_axes = radius * rng.uniform([1.0, 0.4, 0.4], [1.6, 0.8, 0.8])
    return box, ((local / semi_axes.astype(np.float32)) ** 2).sum(-1) <= 1


def smooth_background(size: int, rng: np.random.Generator) -> np.ndarray:
    """A smooth random field (S, S, S) float32 of rms BACKGROUND_STD, correlated over ~size / 8."""
    k = _wavenumbers(size)
    field = np.fft.irfftn(np.fft.rfftn(rng.standard_normal((size,) * 3, dtype=np.float32))
                          * np.exp(-(k * size / 8) ** 2 / 2), s=(size,) * 3, axes=(0, 1, 2))
    return (field * (BACKGROUND_STD / max(field.std(), 1e-12))).astype(np.float32)


def segmentation_volume(size: int, num_classes: int, rng: np.random.Generator,
                        noise: float) -> tuple[np.ndarray, np.ndarray]:
    """``image`` (S, S, S) float32 and ``label`` (S, S, S) uint8 of one volume.

    2 to 5 objects per class, painted in random order (later ones cover earlier ones), then any class
    left invisible painted once more. Object class c has intensity c (times 1 +- 10% per object), over a
    smooth background and Gaussian noise of rms ``noise``.
    """
    classes = [c for c in range(1, num_classes) for _ in range(rng.integers(2, 6))]
    label = np.zeros((size,) * 3, np.uint8)
    intensity = np.zeros((size,) * 3, np.float32)
    for c in rng.permutation(classes):
        _paint(label, intensity, int(c), rng)
    while missing := sorted(set(range(1, num_classes)) - set(np.unique(label).tolist())):
        _paint(label, intensity, missing[0], rng)
    image = intensity + smooth_background(size, rng) + rng.standard_normal(label.shape, dtype=np.float32) * noise
    return image.astype(np.float32), label


def _paint(label: np.ndarray, intensity: np.ndarray, c: int, rng: np.random.Generator) -> None:
    box, mask = object_mask(SHAPES[(c - 1) % len(SHAPES)], label.shape[0], rng)
    label[box][mask] = c
    intensity[box][mask] = c * rng.uniform(0.9, 1.1)


def synth_segmentation(out_dir: str | os.PathLike, num_samples: int, size: int, *, num_classes: int = 3,
                       seed: int = 0, channels_last: bool = False, noise: float = 0.5, overwrite: bool = False,
                       on_sample: Callable[[int], None] | None = None) -> list[Path]:
    """Write ``seg_{i:05d}.h5`` files: ``image`` float32 (1, S, S, S) or (S, S, S, 1), ``label`` uint8
    (S, S, S) in 0 (background) .. num_classes - 1; attrs ``layout``, ``class_names`` and the settings."""
    _check_common(num_samples, size, seed)
    _check_int("num_classes", num_classes, 2, "count the background as class 0 (2: one object class)")
    if num_classes > 256:
        raise HybridparError(f"num_classes = {num_classes}: labels are uint8; use at most 256 classes")
    if not (isinstance(noise, numbers.Real) and math.isfinite(noise) and noise >= 0):
        raise HybridparError(f"noise = {noise!r}: must be a finite number >= 0 "
                             f"(rms of the Gaussian noise; the contrast between classes is 1)")
    names = ["background"] + [SHAPES[(c - 1) % len(SHAPES)] for c in range(1, num_classes)]
    with _output_paths(out_dir, "seg_{:05d}.h5", num_samples, overwrite) as paths:
        for i, path in enumerate(paths):
            image, label = segmentation_volume(size, num_classes, np.random.default_rng([seed, i]), noise)
            image = image[..., None] if channels_last else image[None]
            attrs = {"layout": "DHWC" if channels_last else "CDHW", "num_classes": num_classes,
                     "class_names": names, "noise": float(noise), "seed": seed, "index": i}
            _write(path, {"image": image, "label": label}, attrs)
            if on_sample is not None:
                on_sample(i)
    return paths


# Peak memory of generating one sample, per voxel: 34 to 37 bytes measured (tracemalloc, numpy 2.4) for both
# generators at 64^3 and 128^3 (float32 fields, their FFTs, the Poisson rates, the int16 counts or the labels).
BYTES_PER_VOXEL = 40


def _check_common(num_samples: int, size: int, seed: int) -> None:
    _check_int("num_samples", num_samples, 1, "ask for at least one file")
    _check_int("size", size, 8, "use an edge of at least 8 voxels")
    _check_int("seed", seed, 0, "use a non-negative integer seed")
    _check_memory(size)


def _check_memory(size: int) -> None:
    """Refuse a sample that cannot be generated in the memory this machine has available."""
    need, available = BYTES_PER_VOXEL * size ** 3, available_memory()
    if need > available:
        largest = round((available / BYTES_PER_VOXEL) ** (1 / 3))
        largest -= largest ** 3 * BYTES_PER_VOXEL > available
        raise HybridparError(f"size = {size} (CLI: --size): one sample of {size}^3 voxels takes about {gib(need)} to "
                             f"generate ({BYTES_PER_VOXEL} bytes per voxel), more than the {gib(available)} this "
                             f"machine has available; use a size of at most {largest}")


def _check_int(name: str, value, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise HybridparError(f"{name} = {value!r}: must be an integer >= {minimum}; {fix}")


@contextlib.contextmanager
def _output_paths(out_dir: str | os.PathLike, pattern: str, num_samples: int, overwrite: bool) -> Iterator[list[Path]]:
    """The files to write, in ``out_dir`` (created); refuses to replace files unless ``overwrite``. The folders it
    created are removed again where an error leaves them empty."""
    out = Path(out_dir)
    existing_dir = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing_dir.is_dir():
        raise HybridparError(f"out_dir = {str(out)!r}: {existing_dir} is a file, not a directory; choose a directory")
    paths = [out / pattern.format(i) for i in range(num_samples)]
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise HybridparError(f"{existing[0]} already exists ({len(existing)} of the {num_samples} files do); "
                             f"pass overwrite=True (CLI: --overwrite) to replace them, or choose another out_dir")
    created = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _remove_empty(created)
        raise HybridparError(f"out_dir = {str(out)!r}: cannot create it ({err.strerror}); choose another "
                             "out_dir") from None
    try:
        yield paths
    except BaseException:
        _remove_empty(created)
        raise


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (the deepest first) while they are empty: one that holds anything stays, with those
    above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _write(path: Path, datasets: dict[str, np.ndarray], attrs: dict) -> None:
    """Write to a temporary name and rename, so an interrupted run leaves no truncated ``.h5`` file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with h5py.File(tmp, "w") as f:
            for name, data in datasets.items():
                f.create_dataset(name, data=data)
            f.attrs.update(attrs)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
