"""Runs that meet failures, through the command line: workers killed at random steps and ranks are restarted
from the newest checkpoint and end bitwise equal to the uninterrupted run; SIGTERM and Ctrl-C stop a run after
its step with a checkpoint; a NaN loss stops the run (or skips the step) before any broken checkpoint is written,
and ``metrics.jsonl`` stays JSON."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridpar.train import checkpoint_dir, metrics
from support.harness import limit, load
from support.processes import alive, children, descendants, gone_within, workers
from test_train import COSMO, expect_error, final_weights, hybridpar, synth, write_config
from test_train_gpt import config, last_checkpoint, losses, plan_file

pytestmark = pytest.mark.slow  # each test trains through the CLI in fresh worker processes

DP2 = "[mesh]\ndp = 2\n"
KILLS = 20


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("cosmo"), "synth-cosmoflow", 32, 8, 3)


def kills(seed: int, count: int, ranks: int, steps: int) -> str:
    """``HYBRIDPAR_FAULTS`` for ``count`` kills at random ranks and steps: the i-th kill comes in restart attempt
    i, at a step that attempt reaches (the steps do not decrease; a step may see several)."""
    rng = random.Random(seed)
    return ",".join(f"kill:{rng.randrange(ranks)}@{step}" for step in sorted(rng.randint(1, steps)
                                                                             for _ in range(count)))


def killed_run(cfg: Path, seed: int) -> str:
    """Train ``cfg`` on 4 workers with ``KILLS`` kills and as many restarts allowed; its output."""
    proc = hybridpar("train", cfg, "--nproc", 4, "--max-restarts", KILLS, timeout=600,
                     env={"HYBRIDPAR_FAULTS": kills(seed, KILLS, 4, 12)})
    told = re.findall(r"rank (\d) died(?: in step (\d+))? \(signal 9, SIGKILL\); (?:last checkpoint: step (\d+)|no "
                      r"checkpoint yet); restarting \((\d+) of 20\)", proc.stdout)
    assert [int(attempt) for *_, attempt in told] == list(range(1, KILLS + 1)), proc.stdout
    # a checkpoint at every step, written in the background: a kill during step s finds that of step s - 1 finished,
    # or still being written (then the newest is that of step s - 2)
    assert all(int(step or 1) - 2 <= int(last or 0) <= int(step or 1) - 1 for _, step, last, _ in told), told
    assert "Traceback" not in proc.stderr and not proc.stderr.strip(), proc.stderr
    return proc.stdout


@pytest.mark.timeout(900)
def test_twenty_kills_of_a_tensor_and_pipeline_plan_end_bitwise_equal(tmp_path):
    """A GPT at tp=2 x pp=2 on 4 workers, 20 workers killed at random: every loss and every tensor of the last
    checkpoint (weights, Adam's moments) equal the uninterrupted run's, bit for bit."""
    plan = f'plan = "{plan_file(tmp_path / "plan.json", tp=2, pp=2, stages=("blocks.2.ln_1",), micro_batches=2)}"'
    full = config(tmp_path / "full.toml", tmp_path / "full", top=plan)
    killed = config(tmp_path / "killed.toml", tmp_path / "killed", top=plan)
    for cfg in (full, killed):
        cfg.write_text(cfg.read_text().replace("steps = 6", "steps = 12").replace("every = 3", "every = 1"))
    hybridpar("train", full)
    killed_run(killed, seed=1)
    assert losses(tmp_path / "full") == losses(tmp_path / "killed") and len(losses(tmp_path / "full")) == 12
    expected, got = last_checkpoint(tmp_path / "full"), last_checkpoint(tmp_path / "killed")
    assert sorted(expected) == sorted(got)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.timeout(900)
def test_twenty_kills_of_ddp_over_dp_and_spatial_end_bitwise_equal(tmp_path, volumes):
    """CosmoFlow at dp=2 x spatial 2 with DDP and batch norm on 4 workers, 20 workers killed at random (a
    checkpoint every step, written in the background while the next step's forward changes batch norm's
    statistics): losses, validation metrics and weights equal the uninterrupted run's, bit for bit."""
    values = dict(data=volumes, dp=2, spatial=[1, 2, 1], steps=12, dropout=0.25, batch_norm="true")
    full = write_config(tmp_path / "full.toml", COSMO, run=tmp_path / "full", **values)
    killed = write_config(tmp_path / "killed.toml", COSMO, run=tmp_path / "killed", **values)
    for cfg in (full, killed):
        cfg.write_text(cfg.read_text().replace("[checkpoint]\nevery = 2", "[checkpoint]\nevery = 1"))
    hybridpar("train", full, "--nproc", 4)
    killed_run(killed, seed=2)
    a, b = metrics.read(tmp_path / "full" / "metrics.jsonl"), metrics.read(tmp_path / "killed" / "metrics.jsonl")
    assert [(r["step"], r["split"], r.get("loss"), r.get("mae")) for r in a] == \
        [(r["step"], r["split"], r.get("loss"), r.get("mae")) for r in b if r["split"] != "restart"]
    restarts = [r for r in b if r["split"] == "restart"]
    assert [r["attempt"] for r in restarts][-1] == KILLS and all(r["of"] == KILLS for r in restarts)
    expected, got = final_weights(full), final_weights(killed)
    for name, w in expected.items():
        assert torch.equal(got[name], w), name


def test_a_nan_loss_stops_the_run_before_its_update(tmp_path):
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    error = expect_error("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "nan:1@5"},
                         match="step 5: the loss is NaN or infinite on rank 1; the run stopped before its update "
                               "(last checkpoint: step 3)")
    assert 'train.non_finite = "skip"' in error
    assert [r["step"] for r in metrics.read(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [3]


def test_a_nan_loss_skips_the_step_when_asked(tmp_path):
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2, train_extra='non_finite = "skip"')
    proc = hybridpar("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "nan:0@2"})
    assert "step 2: the loss is NaN or infinite on rank 0; the step's update is skipped" in proc.stderr
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text
    records = [json.loads(line) for line in text.splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert [(r["step"], r["loss"]) for r in skipped] == [(2, None)]
    assert all(isinstance(r["loss"], float) for r in records if r not in skipped)
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [3, 6]


def test_weights_that_became_infinite_are_never_checkpointed(tmp_path):
    """A weight of rank 1 turns infinite after the update of step 4 (the loss of step 4 was finite): the run stops
    at the checkpoint of step 4, which is not written, and the checkpoint of step 3 stays."""
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    Path(cfg).write_text(cfg.read_text().replace("every = 3", "every = 1\nkeep = 1"))
    expect_error("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "inf:1@4"},
                 match="step 4: the weights became NaN or infinite on rank 1; the checkpoint of step 4 was not "
                       "written (last checkpoint: step 3)")
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [3]


def long_run(tmp_path: Path, checkpoint_every: int = 0) -> Path:
    """A config of a run far longer than any test waits for (dp=2, checkpoints every ``checkpoint_every`` steps)."""
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    text = cfg.read_text().replace("steps = 6", "steps = 100000").replace("log_every = 2", "log_every = 10000")
    cfg.write_text(text.replace("every = 3", f"every = {checkpoint_every}"))
    return cfg


def started(cfg: Path, out: Path, *flags) -> subprocess.Popen:
    """``hybridpar train cfg --nproc 2`` in a session of its own, once it has logged 3 records (stdout and
    stderr into ``out`` and ``out.err``)."""
    with out.open("w") as stdout, out.with_suffix(".err").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "hybridpar", "train", str(cfg), "--nproc", "2", *flags],
                                stdout=stdout, stderr=stderr, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                start_new_session=True)
    deadline = time.monotonic() + limit(120)
    while (metrics_lines(cfg.parent / "run") < 3 and proc.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.2)
    if metrics_lines(cfg.parent / "run") < 3 and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run logged no 3 records within {limit(120):.0f} s: {load()}")
    return proc


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to every process", "two SIGTERMs in a row"])
def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint(tmp_path, how):
    """SIGTERM (what SLURM sends before a time limit; ``timeout`` and SLURM may send it twice) or Ctrl-C: every
    worker finishes its step, the run writes a checkpoint of it, says so while it waits, then where to resume
    from, and exits 143 or 130; --resume goes on from that step."""
    cfg = long_run(tmp_path)
    out, err = tmp_path / "out.txt", tmp_path / "out.err"
    proc = started(cfg, out)
    try:
        if how == "Ctrl-C to every process":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
            if how == "two SIGTERMs in a row":
                time.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=limit(150))
    finally:
        ended(proc)
    name, expected_code = ("SIGINT", 130) if how.startswith("Ctrl-C") else ("SIGTERM", 143)
    assert code == expected_code, out.read_text() + err.read_text()
    assert f"{name}: the workers finish their step and write its checkpoint (waiting up to 120 s" in out.read_text()
    found = re.search(rf"stopped by {name}; last checkpoint: step (\d+) \(.*\); continue with --resume",
                      out.read_text())
    assert found, out.read_text()
    step = int(found.group(1))
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [step]
    assert metrics.read(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == step >= 3
    assert not err.read_text().strip(), err.read_text()  # no traceback, no warning
    resumed = hybridpar("train", cfg, "--nproc", 2, "--resume", "--stop-after", step + 2)
    assert f"trained steps {step}..{step + 2} on dp=2" in resumed.stdout, resumed.stdout


def test_workers_die_with_their_launcher_and_a_run_dir_holds_one_run(tmp_path):
    """While a run trains, a second one on its run_dir (a --resume) is refused, naming the first's pid. SIGKILL to
    the launcher (what the OOM killer sends) ends its workers and fork server within seconds: nothing writes to
    the run_dir after it. The lock the dead run left is taken over: --resume goes on from its checkpoint."""
    cfg = long_run(tmp_path, checkpoint_every=1)
    first = started(cfg, tmp_path / "first.txt")
    try:
        second = hybridpar("train", cfg, "--nproc", 2, "--resume", check=False)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is in use by another run (pid {first.pid} on host" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        workers = descendants(first.pid)
        assert len(workers) >= 3, workers  # the fork server, the workers (and the resource tracker)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert gone_within(workers, 30) == []
    finally:
        ended(first)
    written = (tmp_path / "run" / "metrics.jsonl").read_text()
    time.sleep(1)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == written
    step = checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")[-1][0]
    resumed = hybridpar("train", cfg, "--nproc", 2, "--resume", "--stop-after", step + 1)
    assert f"trained steps {step}..{step + 1} on dp=2" in resumed.stdout, resumed.stdout + resumed.stderr


def torchrun(cfg: Path, *flags, port: int | None = None) -> list[str]:
    """The command of one torchrun agent (a node of 2 workers) training ``cfg``, its store on loopback."""
    return [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port or free_port()}", *flags, "-m",
            "hybridpar", "train", str(cfg)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_dir_holds_one_torchrun_job_and_its_own_restarts(tmp_path):
    """Under torchrun global rank 0 holds run_dir's lock: a second job on the folder is refused on every rank
    before it trains, naming the first's rank 0; the first job's own restart (rank 0 killed, torchrun
    --max-restarts) takes the lock over and trains on."""
    cfg = long_run(tmp_path, checkpoint_every=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", HYBRIDPAR_FAULTS="kill:0@4")
    with (tmp_path / "first.txt").open("w") as out:
        first = subprocess.Popen(torchrun(cfg, "--max-restarts", "1"), stdout=out, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + limit(240)
        while '"split": "restart"' not in text_of(tmp_path / "run" / "metrics.jsonl") and first.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        while metrics_lines(tmp_path / "run") < 12 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the restarted attempt trains: its rank 0 took the lock over
        assert first.poll() is None, (tmp_path / "first.txt").read_text()[-3000:]
        holder = json.loads((tmp_path / "run" / ".hybridpar.lock").read_text())["pid"]
        assert holder in descendants(first.pid), holder
        second = subprocess.run(torchrun(cfg, "--max-restarts", "0"), capture_output=True, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=limit(120))
        assert second.returncode != 0, second.stdout + second.stderr
        assert f"is in use by another run (pid {holder} on host" in second.stdout + second.stderr, second.stderr
        assert "hybridpar/" not in second.stdout + second.stderr, second.stderr  # torchrun's own report only
        assert first.poll() is None, (tmp_path / "first.txt").read_text()[-3000:]
    finally:
        ended(first)


def text_of(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_stopped_worker_is_a_hang_the_run_recovers_from(tmp_path):
    """SIGSTOP to a worker: no error, no exit, every rank waits. Its peer's watchdog finds no progress within its
    limit (10 s here: the steps are short), names the rank that stopped beating, ends the attempt; the run
    restarts from its newest checkpoint and ends where the uninterrupted run ends, bit for bit."""
    reference = config(tmp_path / "r.toml", tmp_path / "reference", top=DP2)
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    for path in (reference, cfg):
        path.write_text(path.read_text().replace("steps = 6", "steps = 300").replace("every = 3", "every = 5"))
    hybridpar("train", reference, "--nproc", 2)
    proc = started(cfg, tmp_path / "out.txt", "--max-restarts", "1")
    try:
        stopped = workers(proc.pid)[-1]
        os.kill(stopped, signal.SIGSTOP)
        code = proc.wait(timeout=limit(200))
        assert code == 0, (tmp_path / "out.txt").read_text() + (tmp_path / "out.err").read_text()
    finally:
        ended(proc)
    out = (tmp_path / "out.txt").read_text()
    found = re.search(r"hung: no progress in (step \d+|the [\w -]+ after step \d+) for [\d.]+ s on rank (\d) \(its "
                      r"limit [\d.]+ s: train.hang_factor = 10\); rank (\d) stopped beating \(stopped, frozen or cut "
                      r"off\); (?:last checkpoint: step \d+|no checkpoint yet); restarting \(1 of 1\)", out)
    assert found and found.group(2) != found.group(3), out
    assert not alive(stopped)
    known = json.loads((tmp_path / "run" / "phase_times.json").read_text())  # the restart's first phases' limits
    assert known["key"] == "2 ranks" and {"set-up", "step", "batch", "checkpoint"} <= set(known["seconds"]), known
    assert losses(tmp_path / "run")[-1] == losses(tmp_path / "reference")[-1]
    expected, got = last_checkpoint(tmp_path / "reference"), last_checkpoint(tmp_path / "run")
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def test_a_stalled_collective_is_a_hang_that_stops_the_run_with_its_checkpoint(tmp_path):
    """A rank that stops sending but lives on (its heartbeat goes on: a link dropping packets): the hang is
    found, told as a stalled collective, and without --max-restarts the run stops, its checkpoint kept."""
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    cfg.write_text(cfg.read_text().replace("steps = 6", "steps = 40").replace("every = 3", "every = 2"))
    error = expect_error("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "stall:1@7"}, code=1,
                         match="hung: no progress in step 7 for ")
    assert "every rank beats: a collective or its link stalled; last checkpoint: step 6; continue with --resume " \
        "(or let --max-restarts N restart it)" in error, error
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")][-1] == 6


def ended(proc: subprocess.Popen) -> None:
    """Whatever of a run a failed test left: its session killed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_demo_stops_on_a_signal_in_one_line(tmp_path):
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hybridpar", "demo", "--steps", "100000"], stdout=out,
                                stderr=err, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    deadline = time.monotonic() + limit(120)
    while len(descendants(proc.pid)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # the workers started
    time.sleep(2)
    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=limit(150)) == 143
    assert (tmp_path / "err").read_text().strip() == "error: stopped by SIGTERM"
    assert gone_within(workers, 30) == []




def metrics_lines(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_run_resumed_on_fewer_workers_replans_and_computes_the_same(tmp_path, volumes):
    """Steps 1-2 at dp=2 x spatial 2 on 4 workers, then the workers lost but 2: --resume --nproc 2 re-plans to
    dp=1 x spatial 2 (the global batch kept), records why, and every later loss and the weights are the
    uninterrupted 4-worker run's (float64; only the order of sums differs)."""
    values = dict(data=volumes, dp=2, spatial=[1, 2, 1], steps=4)
    full = write_config(tmp_path / "full.toml", COSMO, run=tmp_path / "full", **values)
    part = write_config(tmp_path / "part.toml", COSMO, run=tmp_path / "part", **values)
    hybridpar("train", full, "--nproc", 4)
    hybridpar("train", part, "--nproc", 4, "--stop-after", 2)
    resumed = hybridpar("train", part, "--nproc", 2, "--resume")
    assert "re-planned at step 2: dp=1 spatial=1x2x1 (4 processes planned, 2 present)" in resumed.stderr
    assert "trained steps 2..4 on dp=1 spatial=1x2x1" in resumed.stdout, resumed.stdout
    a, b = metrics.read(tmp_path / "full" / "metrics.jsonl"), metrics.read(tmp_path / "part" / "metrics.jsonl")
    assert [r for r in b if r["split"] == "replan"] == [
        {"step": 2, "split": "replan", "plan": "dp=1 spatial=1x2x1", "reason": "4 processes planned, 2 present"}]
    train_a, train_b = ([r["loss"] for r in m if r["split"] == "train"] for m in (a, b))
    assert train_b == pytest.approx(train_a, rel=1e-10) and len(train_a) == 4
    for name, w in final_weights(full).items():
        torch.testing.assert_close(final_weights(part)[name], w, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_a_node_lost_for_good_under_torchrun_replans_and_finishes(tmp_path):
    """Two torchrun agents (nodes) of 2 workers each train a GPT at dp=4; one node dies for good (its agent and
    workers killed). The other's workers stop, torchrun restarts them with the one node left, and the run
    re-plans to dp=2 from the newest checkpoint and finishes: every loss is the uninterrupted run's (to 1e-10,
    float64), so the loss curve goes on where it was."""
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top="[mesh]\ndp = 4\n")
    text = cfg.read_text().replace("steps = 6", "steps = 300").replace("log_every = 2", "log_every = 1000")
    cfg.write_text(text.replace("every = 3", "every = 10"))
    reference = config(tmp_path / "r.toml", tmp_path / "reference", top="[mesh]\ndp = 4\n")
    reference.write_text(cfg.read_text().replace(str(tmp_path / "run"), str(tmp_path / "reference")))
    hybridpar("train", reference, "--nproc", 4)
    port = free_port()
    command = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink",
               "--max-restarts", "3", "--rdzv-conf",
               "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2",  # a lost node seen in 2 s
               "-m", "hybridpar", "train", str(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [(tmp_path / f"{name}.out").open("w") for name in ("a", "b")]
    first = subprocess.Popen(command, stdout=logs[0], stderr=subprocess.STDOUT, env=env, start_new_session=True)
    time.sleep(1)  # the first agent hosts the rendezvous store
    second = subprocess.Popen(command, stdout=logs[1], stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + limit(240)
    while metrics_lines(tmp_path / "run") < 30 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    workers = children(second.pid)  # the second node: it does not host the rendezvous (the first started it)
    assert len(workers) == 2, workers
    for pid in [second.pid, *workers]:
        os.kill(pid, signal.SIGKILL)
    second.wait()
    assert first.wait(timeout=limit(300)) == 0, (tmp_path / "a.out").read_text()[-3000:]
    records = metrics.read(tmp_path / "run" / "metrics.jsonl")
    replans = [r for r in records if r["split"] == "replan"]
    assert [(r["plan"], r["reason"]) for r in replans] == [("dp=2", "4 processes planned, 2 present")], replans
    assert replans[0]["step"] % 10 == 0 and replans[0]["step"] >= 20  # a checkpoint: of step 30, or 20 if 30 was cut
    expected = [r["loss"] for r in metrics.read(tmp_path / "reference" / "metrics.jsonl") if r["split"] == "train"]
    got = [r["loss"] for r in records if r["split"] == "train"]
    assert len(got) == len(expected) == 300 and got == pytest.approx(expected, rel=1e-10)


def test_the_automatic_checkpoint_interval_follows_the_failure_rate(tmp_path):
    """checkpoint.every = 0: saves every Young/Daly interval. Devices that fail all the time (an interval
    shorter than any step) save after every step; the default rate (devices failing every 50,000 hours) only at
    the end of a short run. Both say so before training."""
    runs = {}
    for name, mtbf in (("failing", "1e-12"), ("default", "")):
        cfg = config(tmp_path / f"{name}.toml", tmp_path / name, top=DP2)
        extra = f"\nmtbf_hours = {mtbf}" if mtbf else ""
        cfg.write_text(cfg.read_text().replace("every = 3", f"every = 0\nkeep = 100{extra}"))
        runs[name] = hybridpar("train", cfg, "--nproc", 2)
        assert re.search(r"checkpoints every [\d.e+-]+ (s|min|h) \(Young/Daly", runs[name].stdout), runs[name].stdout
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "failing" / "checkpoints")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "default" / "checkpoints")] == [6]
    assert "the devices fail together every 25,000 h on average" in runs["default"].stdout  # 50,000 h / 2
