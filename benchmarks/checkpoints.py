"""How long a checkpoint holds a training step up, written in the foreground and in the background, side by side.

A GPT (float32) trains under DDP on 2 local workers (gloo). Between steps, the run's checkpoint (its weights and
Adam's moments, what ``hybridpar train`` saves) is written ``--saves`` times each way:

- **foreground**: ``checkpoint_dir.save_state``, DCP's synchronous save, its manifest and rename: the step waits
  for all of it (how hybridpar saved before);
- **background**: ``checkpoint_dir.Saver``: the state copied in memory in a thread while the next step's forward
  and backward run (the update waits for the copy: the only wait), then written, hashed into its manifest and
  renamed on a process group of its own while training goes on; the next save waits for it.

Reported: the median seconds a save blocks the step, as a share of the median step (a step here: forward,
backward, the gradients' all-reduce and Adam's update), and the median step time while a background save is
being written (the write competes for the cores).

    python benchmarks/checkpoints.py                  # about 1 minute on 2 cores
    python benchmarks/checkpoints.py --d-model 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def worker(d_model: int, layers: int, saves: int, folder: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hybridpar.launch import init_distributed
    from hybridpar.models.gpt import gpt
    from hybridpar.train import checkpoint_dir

    init_distributed()
    torch.manual_seed(0)
    model = DistributedDataParallel(gpt(vocab_size=256, seq_len=128, num_layers=layers, num_heads=8,
                                        d_model=d_model))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (4, 129))

    def step(saver=None) -> float:
        """One step; a background save's copy in flight (``saver``) finished before the update, as in training."""
        begin = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        if saver is not None:
            saver.staged()
        optimizer.step()
        return time.perf_counter() - begin

    def state() -> dict:
        return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()["state"]}

    for _ in range(3):
        step()  # warm up, Adam's moments made
    steps = [step() for _ in range(10)]
    foreground, background, during = [], [], []
    saver = checkpoint_dir.Saver()
    for i in range(saves):
        dist.barrier()
        begin = time.perf_counter()
        checkpoint_dir.save_state(Path(folder) / "foreground", i, state(), keep=1)
        foreground.append(time.perf_counter() - begin)
        saver.save(Path(folder) / "background", i, state(), keep=1)
        during.append(step(saver))  # the step the copy runs beside
        background.append(saver.blocked_s)
        while not saver.written():  # steps while it is written
            during.append(step())
        saver.wait()
    size = sum(f.stat().st_size for f in (Path(folder) / "foreground").rglob("*") if f.is_file())
    return {"step": statistics.median(steps), "foreground": statistics.median(foreground),
            "background": statistics.median(background), "during": statistics.median(during) if during else None,
            "written": statistics.median([saver.write_s]), "bytes": size,
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from hybridpar.launch import launch_local

    with tempfile.TemporaryDirectory() as folder:
        r = launch_local(worker, (args.d_model, args.layers, args.saves, folder), 2)[0]
    print(f"GPT d_model {args.d_model} x {args.layers} layers ({r['parameters'] / 1e6:.1f} M parameters, float32), "
          f"DDP on 2 local workers ({os.cpu_count()} cores); a checkpoint of {r['bytes'] / 2**20:.0f} MiB "
          f"(weights, Adam's moments); medians of {args.saves} saves\n")
    print("| save | blocks the step s | share of a step | step while it is written s |")
    print("|---|---|---|---|")
    print(f"| none | | | {r['step']:.3f} |")
    print(f"| foreground (DCP save) | {r['foreground']:.3f} | {r['foreground'] / r['step']:.0%} | |")
    during = f"{r['during']:.3f}" if r["during"] is not None else "(written within the save)"
    print(f"| background (staged, `Saver`) | {r['background']:.3f} | {r['background'] / r['step']:.1%} | "
          f"{during} |")


if __name__ == "__main__":
    main()
