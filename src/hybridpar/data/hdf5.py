"""Slab-parallel HDF5 reading: each rank of a spatial group reads only its own slab of each sample
with an HDF5 hyperslab selection, never the whole sample.

A *sample* is one file, or one crop of a file when the volumes are tiled into cubes (as MLPerf cuts
each 512^3 universe into 128^3 crops). Every file is checked when the dataset is built (datasets,
shapes, dtypes, and that the data lies inside the file), identically on every rank and before any
communication, so a bad file is an error naming it, never a hang halfway through an epoch.
"""

from __future__ import annotations

import glob
import io
import itertools
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from hybridpar.errors import DataError
from hybridpar.geometry import Grid

LAYOUTS = {"DHWC": "channels_last", "CDHW": "channels_first"}
TRANSFORMS = ("log1p", "none")
MAX_OPEN_FILES = 64


@dataclass(frozen=True)
class SampleFormat:
    """Which datasets of a file hold the volume and the target, and how the volume is stored.

    ``target_kind`` is ``"vector"`` (a regression target such as CosmoFlow's ``unitPar``) or
    ``"volume"`` (voxel labels with the volume's spatial shape, read slab by slab like the input).
    ``layout`` is ``"channels_last"`` (D, H, W, C: the public CosmoFlow files), ``"channels_first"``
    (C, D, H, W) or ``"auto"`` (the file's ``layout`` attribute, ``DHWC`` or ``CDHW``).
    """

    input: str
    target: str
    target_kind: str
    layout: str = "auto"
    transform: str = "none"


COSMOFLOW = SampleFormat("full", "unitPar", "vector", "channels_last", "log1p")
SEGMENTATION = SampleFormat("image", "label", "volume", "auto", "none")
TASKS = {"cosmoflow": (COSMOFLOW, "cosmoflow"), "segmentation": (SEGMENTATION, "unet3d")}  # data.format: its model


class CountingFile(io.FileIO):
    """A file whose reads are counted: the bytes HDF5 actually asked the operating system for."""

    def __init__(self, path):
        super().__init__(path, "rb")
        self.bytes_read = 0

    def readinto(self, buffer) -> int:
        count = super().readinto(buffer)
        self.bytes_read += count or 0
        return count


@dataclass(frozen=True)
class FileInfo:
    path: Path
    layout: str  # channels_last or channels_first
    channels: int
    spatial: tuple[int, int, int]
    target_shape: tuple[int, ...]


def list_files(spec: str | os.PathLike, where: str, generate: str = "synth-cosmoflow") -> list[Path]:
    """The ``.h5`` / ``.hdf5`` files of a directory, or the files a glob pattern matches, sorted; where there are
    none, the error suggests ``hybridpar data GENERATE``."""
    path = Path(spec)
    try:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".h5", ".hdf5"))
        else:
            files = sorted(Path(p) for p in glob.glob(str(spec)))
    except OSError as err:  # a folder we may not list, a name too long
        raise DataError(f"{where} = {str(spec)!r}: cannot list it ({err.strerror})") from None
    if not files:
        raise DataError(f"{where} = {str(spec)!r}: no HDF5 files there (a directory of .h5 files or a glob); "
                        f"generate some with `hybridpar data {generate} --out DIR ...`")
    return files


def _dataset(f: h5py.File, name: str, path: Path, index: int) -> h5py.Dataset:
    """Dataset ``name`` of ``f``, its data stored in ``f`` itself: an external link, a virtual dataset or external
    raw storage would read other files, unchecked (a missing source of a virtual dataset crashes HDF5)."""
    where = f"{path} (sample file {index}): dataset {name!r}"
    fix = "copy its data into the file (h5repack, or h5py's ds[...] into a new file)"
    if isinstance(f.get(name, getlink=True), h5py.ExternalLink):
        raise DataError(f"{where} is an external link to {f.get(name, getlink=True).filename!r}; {fix}")
    if name not in f or not isinstance(f[name], h5py.Dataset):
        raise DataError(f"{path} (sample file {index}): no dataset {name!r}; it has {sorted(f.keys())}. "
                        f"Set the dataset name in the config's [data] table")
    ds = f[name]
    if ds.is_virtual or ds.external:
        raise DataError(f"{where} is {'virtual' if ds.is_virtual else 'stored in external files'}: its data lie "
                        f"in other files; {fix}")
    return ds


def _check_task(f: h5py.File, fmt: SampleFormat, path: Path, index: int) -> None:
    """Refuse a file of another task's data (the 3D U-Net's volumes and labels read as CosmoFlow universes, or
    the reverse), naming the datasets found, those expected and the config keys that choose them."""
    found = set(f.keys())
    if {fmt.input, fmt.target} <= found:
        return
    for task, (other, model) in TASKS.items():
        if other.target_kind != fmt.target_kind and {other.input, other.target} <= found:
            raise DataError(f"{path} (sample file {index}): holds {task} data (datasets {other.input!r} and "
                            f"{other.target!r}), not the datasets {fmt.input!r} and {fmt.target!r} this run reads; "
                            f"train on it with data.format = \"{task}\" and model.name = \"{model}\", or point "
                            "data.train / data.val at files of this run's task")


def _check_inside(ds: h5py.Dataset, path: Path, index: int) -> None:
    """Refuse a dataset whose stored bytes run past the end of the file (a truncated copy)."""
    size = path.stat().st_size
    if ds.chunks is None:
        offset = ds.id.get_offset()
        extents = [] if offset is None else [(offset, ds.id.get_storage_size())]
    else:
        extents = [(c.byte_offset, c.size) for c in map(ds.id.get_chunk_info, range(ds.id.get_num_chunks()))]
    end = max((o + n for o, n in extents), default=0)
    if end > size:
        raise DataError(f"{path} (sample file {index}): truncated: dataset {ds.name!r} needs {end} bytes, "
                        f"the file has {size}. Copy or generate the file again")


def _layout(ds: h5py.Dataset, fmt: SampleFormat, path: Path, index: int) -> str:
    if fmt.layout != "auto":
        return fmt.layout
    attr = ds.file.attrs.get("layout", ds.attrs.get("layout"))
    attr = attr.decode() if isinstance(attr, bytes) else attr
    if attr not in LAYOUTS:
        raise DataError(f"{path} (sample file {index}): layout 'auto' needs a file attribute layout = "
                        f"'DHWC' or 'CDHW' (found {attr!r}); set data.layout to channels_last or channels_first")
    return LAYOUTS[attr]


def inspect_file(path: Path, fmt: SampleFormat, index: int) -> FileInfo:
    """Open ``path`` and check it against ``fmt``; raises :class:`DataError` naming the file."""
    if path.exists() and not path.is_file():
        raise DataError(f"{path} (sample file {index}): not a regular file (a folder, a FIFO or a device); "
                        "remove it from the data folder or the glob")
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise DataError(f"{path} (sample file {index}): file not found") from None
    except OSError as err:
        if "truncated file" in str(err):
            raise DataError(f"{path} (sample file {index}): truncated: the file is shorter than its HDF5 header "
                            f"says ({err}). Copy or generate the file again") from None
        raise DataError(f"{path} (sample file {index}): not a readable HDF5 file ({err})") from None
    with f:
        try:
            return _checked(f, fmt, path, index)
        except DataError:
            raise
        except (KeyError, RuntimeError, OSError, ValueError) as err:  # HDF5 on damaged metadata, a dangling link
            raise DataError(f"{path} (sample file {index}): damaged HDF5 file ({err}). Copy or generate the file "
                            "again") from None


def _checked(f: h5py.File, fmt: SampleFormat, path: Path, index: int) -> FileInfo:
    """The checks of ``inspect_file`` on the open file ``f``."""
    _check_task(f, fmt, path, index)
    x = _dataset(f, fmt.input, path, index)
    y = _dataset(f, fmt.target, path, index)
    layout = _layout(x, fmt, path, index)
    if x.ndim != 4 or x.dtype.kind not in "iuf":
        raise DataError(f"{path} (sample file {index}): dataset {fmt.input!r} is {x.dtype} of shape {x.shape}; "
                        f"expected numbers of shape (D, H, W, C) or (C, D, H, W)")
    channels, spatial = (x.shape[3], x.shape[:3]) if layout == "channels_last" else (x.shape[0], x.shape[1:])
    want_kind = "iu" if fmt.target_kind == "volume" else "iuf"
    want_shape = y.shape == spatial if fmt.target_kind == "volume" else y.ndim == 1
    if y.dtype.kind not in want_kind or not want_shape:
        raise DataError(f"{path} (sample file {index}): target {fmt.target!r} is {y.dtype} of shape {y.shape}; "
                        f"expected " + (f"integer labels of shape {spatial}" if fmt.target_kind == "volume"
                                        else "a vector of numbers (one dimension)"))
    for ds in (x, y):
        _check_inside(ds, path, index)
    return FileInfo(path, layout, channels, tuple(spatial), tuple(y.shape))


def _check_finite(values: torch.Tensor, where: str, note: str) -> None:
    """Refuse NaN or infinite values: they would make every weight NaN at the next step."""
    bad = values.numel() - int(torch.isfinite(values).sum())
    if bad:
        raise DataError(f"{where}: {bad} NaN or infinite value(s){note}; fix the file, or remove it from the data")


def _most_common(keys: list[tuple]) -> tuple | None:
    """The most frequent key, the earliest on a tie (``None`` for no keys)."""
    return Counter(keys).most_common(1)[0][0] if keys else None


def _tiles(spatial: tuple[int, ...], crop: int | None) -> list[tuple[int, ...]]:
    if crop is None:
        return [(0,) * len(spatial)]
    return list(itertools.product(*(range(0, n - crop + 1, crop) for n in spatial)))


class SlabDataset:
    """Samples (file, crop origin) of a set of HDF5 files, read slab by slab.

    ``crop``: edge of the cubic crops the volumes are tiled into (``None``: whole volumes);
    ``crops_per_file``: how many of each file's tiles to use (``None``: all, in row-major order).
    ``skip_bad``: count and skip files that fail the checks instead of raising; a file whose shape
    differs from most files' is the bad one. ``num_classes``: labels of volume targets must lie in
    ``[0, num_classes)`` (checked as each slab is read).
    """

    def __init__(self, paths: list[Path], fmt: SampleFormat, *, crop: int | None = None,
                 crops_per_file: int | None = None, skip_bad: bool = False, dtype=torch.float32,
                 num_classes: int | None = None):
        if fmt.transform not in TRANSFORMS:
            raise DataError(f"transform {fmt.transform!r} is not one of {TRANSFORMS}")
        self.fmt, self.crop, self.dtype, self.num_classes = fmt, crop, dtype, num_classes
        self.infos: list[FileInfo] = []
        self.skipped: list[tuple[Path, str]] = []
        readable = [(index, info) for index, path in enumerate(paths)
                    if (info := self._attempt(skip_bad, Path(path), inspect_file, Path(path), fmt, index))]
        reference = _most_common([self._shape_key(info) for _, info in readable])
        for index, info in readable:
            if (checked := self._attempt(skip_bad, info.path, self._check, info, index, reference)):
                self.infos.append(checked)
        if not self.infos:
            raise DataError(f"none of the {len(paths)} files is usable; first problem: {self.skipped[0][1]}")
        self.samples = [(i, origin) for i, info in enumerate(self.infos)
                        for origin in _tiles(info.spatial, crop)[:crops_per_file]]
        self._files: OrderedDict[int, tuple[CountingFile, h5py.File]] = OrderedDict()  # open, newest last
        self._closed_bytes = 0
        self._lock = threading.Lock()  # the prefetch thread opens files while the loop reads bytes_read

    def _attempt(self, skip_bad: bool, path: Path, check, *args):
        """``check(*args)``; with ``skip_bad``, a :class:`DataError` is recorded in ``skipped`` (``None``)."""
        try:
            return check(*args)
        except DataError as err:
            if not skip_bad:
                raise
            self.skipped.append((path, str(err)))
            return None

    def _shape_key(self, info: FileInfo) -> tuple:
        """What every file must share: channels, the target's shape (vectors), the volume (uncropped)."""
        return (info.channels, None if self.fmt.target_kind == "volume" else info.target_shape,
                info.spatial if self.crop is None else None)

    def _check(self, info: FileInfo, index: int, reference: tuple) -> FileInfo:
        if self._shape_key(info) != reference:
            channels, target, spatial = reference
            want = ", ".join([f"{channels} channels"] + ([f"volume {spatial}"] if spatial else []) +
                             ([f"target {target}"] if target else []))
            raise DataError(f"{info.path} (sample file {index}): {info.channels} channels, volume {info.spatial}, "
                            f"target {info.target_shape}; most files have {want}. Every sample must have the "
                            f"same shape (set data.crop to tile volumes of different sizes)")
        if self.crop is not None and min(info.spatial) < self.crop:
            raise DataError(f"{info.path} (sample file {index}): volume {info.spatial} is smaller than "
                            f"data.crop = {self.crop}; use a crop of at most {min(info.spatial)}")
        return info

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """``(C, D, H, W)`` of one sample (one crop)."""
        info = self.infos[0]
        return (info.channels,) + ((self.crop,) * 3 if self.crop else info.spatial)

    @property
    def bytes_read(self) -> int:
        with self._lock:
            return self._closed_bytes + sum(fileobj.bytes_read for fileobj, _ in self._files.values())

    def _open(self, file_index: int) -> h5py.File:
        """The open file, kept among the ``MAX_OPEN_FILES`` most recently used (far below ``ulimit -n``)."""
        with self._lock:
            if file_index in self._files:
                self._files.move_to_end(file_index)
            else:
                fileobj = CountingFile(self.infos[file_index].path)
                self._files[file_index] = (fileobj, h5py.File(fileobj, "r"))
                if len(self._files) > MAX_OPEN_FILES:
                    self._close(*self._files.popitem(last=False)[1])
            return self._files[file_index][1]

    def _close(self, fileobj: CountingFile, f: h5py.File) -> None:
        f.close()
        fileobj.close()
        self._closed_bytes += fileobj.bytes_read

    def read(self, index: int, grid: Grid, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This spatial rank's slab ``(C, d, h, w)`` of sample ``index`` and its target (the whole
        vector, or the label slab ``(d, h, w)``)."""
        file_index, origin = self.samples[index]
        info = self.infos[file_index]
        bounds = grid.slab(self.sample_shape[1:], rank)
        box = tuple(slice(o + lo, o + hi) for o, (lo, hi) in zip(origin, bounds))
        try:
            f = self._open(file_index)
            select = box + (slice(None),) if info.layout == "channels_last" else (slice(None),) + box
            x = f[self.fmt.input][select]
            y = f[self.fmt.target][box] if self.fmt.target_kind == "volume" else f[self.fmt.target][()]
        except (OSError, KeyError, ValueError, RuntimeError) as err:  # a file changed or broke since it was checked
            raise DataError(f"{info.path} (sample {index}): reading slab {box} failed ({err})") from None
        x = np.moveaxis(x, 3, 0) if info.layout == "channels_last" else x
        x = torch.from_numpy(np.ascontiguousarray(x)).to(self.dtype)
        x = torch.log1p(x) if self.fmt.transform == "log1p" else x
        _check_finite(x, f"{info.path} (sample {index}): dataset {self.fmt.input!r}, slab {box}",
                      " (after log1p: values below -1 have none)" if self.fmt.transform == "log1p" else "")
        if self.fmt.target_kind == "vector":
            y = torch.as_tensor(np.asarray(y), dtype=self.dtype)
            _check_finite(y, f"{info.path} (sample {index}): target {self.fmt.target!r}", "")
            return x, y
        y = torch.from_numpy(np.asarray(y)).long()
        if self.num_classes is not None and y.numel() and not 0 <= y.min() <= y.max() < self.num_classes:
            raise DataError(f"{info.path} (sample {index}): labels {int(y.min())}..{int(y.max())} in slab {box}; "
                            f"the model has num_classes = {self.num_classes}, so labels must lie in 0.."
                            f"{self.num_classes - 1}. Set model.num_classes to cover every label")
        return x, y

    def close(self) -> None:
        with self._lock:
            for fileobj, f in self._files.values():
                self._close(fileobj, f)
            self._files.clear()
