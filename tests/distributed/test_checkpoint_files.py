"""Checkpoints that can be trusted: a damaged newest checkpoint (truncated, bit-flipped, a file missing) is
passed over for the intact one before it, with a warning naming it; a crafted ``.metadata`` is refused before
any of it runs (in ``hybridpar.parallel.checkpoint.read``, which every load goes through)."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from hybridpar.errors import CheckpointError
from hybridpar.parallel import checkpoint_files as files
from hybridpar.train import checkpoint_dir


def state_of(step: int) -> dict:
    """Tensors that differ per step and per rank (each rank's own key), so a load shows which step it read."""
    rank = dist.get_rank()
    return {"model": {"w": torch.arange(6.0) * step, f"r{rank}": torch.full((4, 3), float(step + rank))}}


def save_steps(directory: str, steps: tuple[int, ...]) -> None:
    for step in steps:
        checkpoint_dir.save_state(Path(directory), step, state_of(step), keep=len(steps))


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def resume_from(directory: str) -> dict:
    """The step, tensors and warnings of a resume from ``directory`` (or the error, the same on every rank)."""
    seen = Warnings()
    logging.getLogger("hybridpar").addHandler(seen)
    try:
        path = checkpoint_dir.newest_intact(Path(directory))
        state = {"model": {k: torch.zeros_like(v) for k, v in state_of(0)["model"].items()}}
        step = checkpoint_dir.load_state(path, state)
        return {"step": step, "equal": all(torch.equal(v, state_of(step)["model"][k])
                                           for k, v in state["model"].items()), "warnings": seen.lines}
    except CheckpointError as err:
        return {"error": str(err), "warnings": seen.lines}
    finally:
        logging.getLogger("hybridpar").removeHandler(seen)


def shard(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[-1]


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def flip_bits(file: Path) -> None:
    """64 flipped bits in the middle of the file (its size unchanged): only the checksum can tell."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    file.write_bytes(bytes(data))


DAMAGES = {
    "shard truncated": lambda p: truncate(shard(p)),
    "shard bit-flipped": lambda p: flip_bits(shard(p)),
    "metadata truncated": lambda p: truncate(p / ".metadata"),
    "shard deleted": lambda p: shard(p).unlink(),
    "manifest deleted": lambda p: (p / files.MANIFEST).unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_falls_back_to_the_one_before(dist2, tmp_path, damage):
    dist2.run(save_steps, directory=str(tmp_path), steps=(2, 4))
    newest = tmp_path / "step_00000004"
    DAMAGES[damage](newest)
    results = dist2.run(resume_from, directory=str(tmp_path))
    assert all(r["step"] == 2 and r["equal"] for r in results), results
    assert len(results[0]["warnings"]) == 1 and not results[1]["warnings"]  # one line, from rank 0
    assert f"checkpoint {newest} is damaged (" in results[0]["warnings"][0]


def test_no_intact_checkpoint_is_an_error_on_every_rank(dist2, tmp_path):
    dist2.run(save_steps, directory=str(tmp_path), steps=(2, 4))
    flip_bits(shard(tmp_path / "step_00000002"))
    truncate(shard(tmp_path / "step_00000004"))
    results = dist2.run(resume_from, directory=str(tmp_path))
    assert results[0]["error"] == results[1]["error"]
    assert f"no intact checkpoint in {tmp_path} (2 damaged" in results[0]["error"]
    assert "has" in results[0]["warnings"][0] and "SHA-256" in results[0]["warnings"][1]


def test_an_intact_checkpoint_loads_without_warning(dist2, tmp_path):
    dist2.run(save_steps, directory=str(tmp_path), steps=(2, 4))
    manifest = json.loads((tmp_path / "step_00000004" / files.MANIFEST).read_text())["files"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= manifest.keys()
    results = dist2.run(resume_from, directory=str(tmp_path))
    assert all(r == {"step": 4, "equal": True, "warnings": []} for r in results), results


class Payload:
    """What a crafted pickle would run on loading: creating a file proves it ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rewrite_metadata(path: Path, change) -> None:
    """Replace ``path``'s ``.metadata`` by ``change(metadata)`` pickled, and its manifest to match (a crafted
    checkpoint is crafted whole)."""
    with (path / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    (path / ".metadata").write_bytes(pickle.dumps(change(metadata)))
    manifest = json.loads((path / files.MANIFEST).read_text())
    digest = files._digest(path / ".metadata")
    manifest["files"][".metadata"] = digest
    (path / files.MANIFEST).write_text(json.dumps(manifest))


def with_payload(marker: Path):
    def change(metadata):
        metadata.planner_data = Payload(marker)
        return metadata
    return change


def with_bytes_entry(metadata):
    metadata.state_dict_metadata["model.w"] = BytesStorageMetadata()
    return metadata


def with_outside_file(metadata):
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    return metadata


@pytest.mark.parametrize("craft", ["payload", "bytes entry", "outside file"])
def test_crafted_metadata_is_refused_on_every_rank_before_it_runs(dist2, tmp_path, craft):
    dist2.run(save_steps, directory=str(tmp_path), steps=(2,))
    marker = tmp_path / "ran"
    change = {"payload": with_payload(marker), "bytes entry": with_bytes_entry,
              "outside file": with_outside_file}[craft]
    rewrite_metadata(tmp_path / "step_00000002", change)
    results = dist2.run(resume_from, directory=str(tmp_path))
    assert not marker.exists(), "the crafted metadata ran"
    expected = {"payload": "names posix.system, which is no part of a checkpoint's metadata: refused",
                "bytes entry": "entry 'model.w' is a BytesStorageMetadata; hybridpar checkpoints hold tensors only",
                "outside file": "points outside its folder ('../../elsewhere.distcp')"}[craft]
    assert all(str(tmp_path / "step_00000002" / ".metadata") in r["error"] and expected in r["error"]
               for r in results), results


def test_metadata_that_is_not_a_pickle_is_named(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04junk")
    with pytest.raises(CheckpointError, match=r"\.metadata is not a readable checkpoint metadata file"):
        files.read_metadata(tmp_path)


def save_or_error(directory: str, step: int) -> str:
    try:
        checkpoint_dir.save_state(Path(directory), step, state_of(step), keep=2)
        return "saved"
    except CheckpointError as err:
        return str(err)


@pytest.mark.parametrize("blocked", ["the checkpoints folder", "the checkpoint's own folder"])
def test_a_checkpoint_that_cannot_be_written_is_an_error_on_every_rank(dist2, tmp_path, blocked):
    """A path taken by a file (or a full disk) where rank 0 prepares the folder, or where DCP writes: the same
    error on every rank (no rank left waiting in a collective), and the checkpoints before stay intact."""
    directory = tmp_path / "checkpoints"
    dist2.run(save_steps, directory=str(directory), steps=(2,))
    if blocked == "the checkpoints folder":
        directory = tmp_path / "taken"
        directory.write_text("a file where the folder should be")
    else:
        (directory / "step_00000004.partial").write_text("a file where DCP makes its folder")
    errors = dist2.run(save_or_error, directory=str(directory), step=4)
    assert errors[0] == errors[1] and errors[0].startswith("cannot write the checkpoint of step 4: "), errors
    assert "the checkpoints before it are intact" in errors[0]
    assert checkpoint_dir.checkpoints(tmp_path / "checkpoints") == [(2, tmp_path / "checkpoints" / "step_00000002")]


def save_in_background(directory: str, steps: tuple[int, ...], blocked_at: int | None = None) -> dict:
    """Checkpoints of ``steps`` written in the background (``checkpoint_dir.Saver``), the state changed as soon as
    each save returns (training goes on); the folders and the step each read back as (or the error)."""
    saver = checkpoint_dir.Saver()
    finished = []
    try:
        for step in steps:
            state = state_of(step)
            if step == blocked_at and dist.get_rank() == 0:
                (Path(directory) / f"step_{step:08d}.partial").write_text("a file where DCP makes its folder")
            saver.save(Path(directory), step, state, keep=len(steps))
            saver.staged()  # the copy in memory done: what may change the state (the next update) may run
            for tensor in state["model"].values():
                tensor.add_(1000)  # the next step's update, while the save is written
            finished.append(saver.wait())
    except CheckpointError as err:
        return {"error": str(err)}
    return {"finished": [p.name for p in finished], "resumed": resume_from(directory)}


def test_a_checkpoint_written_in_the_background_holds_the_state_of_its_step(dist2, tmp_path):
    """The state is copied in memory (``staged``) before anything may change it: what the next update changes is
    not in the checkpoint; each rank's files, the manifest and the rename come after, and a resume reads the
    newest bit for bit."""
    results = dist2.run(save_in_background, directory=str(tmp_path), steps=(2, 4))
    assert [r["finished"] for r in results] == [["step_00000002", "step_00000004"]] * 2
    assert [r["resumed"] for r in results] == [{"step": 4, "equal": True, "warnings": []}] * 2
    assert files.verify(tmp_path / "step_00000004") is None and not list(tmp_path.glob("*.partial"))


def test_a_checkpoint_that_cannot_be_written_in_the_background_is_an_error_on_every_rank(dist2, tmp_path):
    results = dist2.run(save_in_background, directory=str(tmp_path), steps=(2, 4), blocked_at=4)
    assert results[0] == results[1] and results[0]["error"].startswith("cannot write the checkpoint of step 4: ")
    assert checkpoint_dir.checkpoints(tmp_path) == [(2, tmp_path / "step_00000002")]
