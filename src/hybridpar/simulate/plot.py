"""The scaling figure: samples/s and efficiency against devices, one line per family (PNG, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from hybridpar.simulate.scaling import Point


def plot(points: list[Point], path: str | Path, title: str) -> Path:
    """Write a two-panel PNG of ``points`` to ``path``: throughput (log-log, with each family's ideal line
    from its baseline, dashed) and efficiency (%). Points without a plan are left out of the lines."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders the PNG

    fig = Figure(figsize=(11, 4.4), layout="constrained")
    speed, eff = fig.subplots(1, 2)
    counts = sorted({p.devices for p in points})
    for k, name in enumerate(dict.fromkeys(p.family for p in points)):
        planned = [p for p in points if p.family == name and p.plan is not None]
        if not planned:
            continue
        color, base = f"C{k}", planned[0]
        # families often coincide: later ones thinner, with smaller markers of another shape, stay visible
        style = dict(color=color, marker="os^Dv"[k % 5], markersize=max(9 - 2 * k, 3), linewidth=max(2.5 - 0.6 * k, 1),
                     label=name)
        devices = [p.devices for p in planned]
        speed.plot(devices, [p.samples_per_second for p in planned], **style)
        ideal = [base.samples_per_second * n / base.devices for n in devices]
        speed.plot(devices, ideal, "--", color=color, alpha=0.4, linewidth=1)
        eff.plot(devices, [100 * p.efficiency for p in planned], **style)
    for ax in (speed, eff):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("devices")
        ax.grid(True, which="both", alpha=0.3)
    speed.set_yscale("log")
    speed.set_ylabel("samples / s (predicted); dashed: ideal")
    eff.set_ylabel("efficiency (%)")
    highest = max((p.efficiency for p in points if p.efficiency is not None), default=1.0)
    eff.set_ylim(0, max(105, 105 * highest))  # above 100% when the baseline had to shard or recompute to fit
    if any(p.plan is not None for p in points):
        speed.legend()
        eff.legend()
    fig.suptitle(title)
    fig.savefig(path, format="png", dpi=110)
    return Path(path)
