"""Checkpoint folders that can be trusted: a manifest of every file's size and SHA-256 written last, checked
before loading, and DCP's ``.metadata`` read without unpickling anything but DCP's own metadata types.

``torch.distributed.checkpoint`` reads ``.metadata`` with ``pickle.load``: a crafted file would run code in
every worker that loads it. ``SafeReader`` admits only the classes DCP's metadata is made of (and torch's
dtypes, sizes and layouts), refuses entries that DCP would load with ``torch.load(weights_only=False)``
(bytes), and file names that leave the folder. Files are hashed in parallel: rank ``r`` of ``W`` takes every
``W``-th file of the sorted list.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from hybridpar.errors import CheckpointError

MANIFEST = "manifest.json"
_DATA_FILE = re.compile(r"^[\w.-]+\.distcp$")
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata types and nothing else."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path} names {module}.{name}, which is no part of a checkpoint's metadata: "
                              "refused (a crafted or foreign file); resume from a checkpoint hybridpar wrote")


def read_metadata(path: Path) -> Metadata:
    """The metadata of the checkpoint folder ``path``, unpickled with only DCP's types and checked to describe
    tensors stored in files of the folder itself."""
    file = Path(path) / ".metadata"
    try:
        with file.open("rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except Exception as err:  # any damage to the bytes: truncation, garbage, wrong types
        problem = f"{type(err).__name__}: {err}"
        raise CheckpointError(f"{file} is not a readable checkpoint metadata file ({problem})") from None
    _check_metadata(metadata, file)
    return metadata


def _check_metadata(metadata, file: Path) -> None:
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not a checkpoint's metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):  # bytes would be read with torch.load(weights_only=False)
            raise CheckpointError(f"{file}: entry {key!r} is a {type(entry).__name__}; hybridpar checkpoints hold "
                                  "tensors only: refused (a crafted or foreign file)")
    for info in (metadata.storage_data or {}).values():
        if not isinstance(info, _StorageInfo) or not _DATA_FILE.match(str(info.relative_path)):
            raise CheckpointError(f"{file} points outside its folder ({getattr(info, 'relative_path', info)!r}): "
                                  "refused (a crafted or foreign file)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with ``read_metadata`` above instead of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank metadata files are not part of hybridpar checkpoints")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder ``path`` (weights, buffers, optimizer moments), whole, read in this
    process alone, its metadata read as ``read_metadata`` reads it."""
    items = read_metadata(Path(path)).state_dict_metadata.items()
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in items}
    with warnings.catch_warnings():  # DCP's "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return state


def write_manifest(path: Path, group=None) -> None:
    """Hash every file of the checkpoint folder ``path`` (in parallel over the ranks) and write ``manifest.json``
    (rank 0; collective over ``group``, a group of every rank: by default the default one). Written last, after
    DCP's ``.metadata``."""
    path = Path(path)
    names = _broadcast(sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
                       if dist.get_rank() == 0 else None, group)
    mine = {name: _digest(path / name) for name in _my_share(names)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    problem = None
    if dist.get_rank() == 0:
        files = {name: entry for part in everyone for name, entry in part.items()}
        temporary = path / (MANIFEST + ".tmp")
        try:
            temporary.write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")
            os.replace(temporary, path / MANIFEST)
        except OSError as err:  # a full disk: an error on every rank, not rank 0 alone
            problem = f"cannot write {temporary}: {err.strerror}"
    problem = _broadcast(problem, group)
    if problem:
        raise CheckpointError(problem)


def verify(path: Path) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (a missing, short or changed file), or ``None`` if every
    file matches its manifest; the same answer on every rank (collective). A process outside any process group
    (the command, before its workers start) checks every file itself."""
    path = Path(path)
    if not dist.is_initialized():
        manifest = _read_manifest(path)
        if isinstance(manifest, str):
            return manifest
        return next(filter(None, (_file_problem(path / name, entry) for name, entry in sorted(manifest.items()))),
                    None)
    manifest = _broadcast(_read_manifest(path) if dist.get_rank() == 0 else None)
    if isinstance(manifest, str):
        problems = [manifest]
    else:
        mine = [_file_problem(path / name, entry) for name, entry in _my_share(sorted(manifest.items()))]
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, next((p for p in mine if p), None))
    return next((p for p in problems if p), None)


def _read_manifest(path: Path) -> dict | str:
    """The manifest's ``{name: {"bytes", "sha256"}}``, or what is wrong with it."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        if all(isinstance(e["bytes"], int) and isinstance(e["sha256"], str) and "/" not in name
               for name, e in files.items()) and ".metadata" in files:
            return files
    except FileNotFoundError:
        return f"no {MANIFEST} (not written by this hybridpar, or its save never finished)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return f"{MANIFEST} is unreadable"


def _file_problem(file: Path, entry: dict) -> str | None:
    try:
        size = file.stat().st_size
    except OSError:
        return f"{file.name} is missing"
    if size != entry["bytes"]:
        return f"{file.name} has {size} bytes, its manifest {entry['bytes']}"
    if _digest(file)["sha256"] != entry["sha256"]:
        return f"{file.name} changed since it was written (its SHA-256 differs from the manifest's)"
    return None


def _digest(file: Path) -> dict:
    with file.open("rb") as f:
        return {"bytes": file.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _my_share(items: list) -> list:
    return items[dist.get_rank()::dist.get_world_size()]


def _broadcast(value, group=None):
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
