"""``hybridpar.verify``: a plan proved on your own model before a long run. One float64 training step of the plan
(the loss, every gradient, one optimizer step) runs on local processes beside one process on the same weights and
the same batch, and every tensor is compared: a report of the worst difference per tensor and a verdict.

Each rank takes its replica's rows of the batch and, under spatial parallelism, its slab of them; the loss is the
caller's one-process loss function, on the output gathered whole where the plan splits it in slabs (so that any
loss can be used). Inside a process group of the plan's size, ``verify`` runs there (every rank gets the report);
without one it starts the plan's number of local processes itself (gloo on loopback, or NCCL on a GPU node).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hybridpar.errors import HybridparError, PlanError
from hybridpar.ir.types import Plan

# float64: the plan sums the same products in other orders (split matmuls, micro-batch means, all-reduces), which
# moves a value by ~1e-15 of its scale; 1e-9 leaves room for long sums and fails any wrong shard (~1e-3 and more).
TOLERANCE = 1e-9
# after the step: Adam moves a parameter by lr * g / (|g| + eps), so a gradient that cancels to ~0 in exact
# arithmetic (a bias before a norm) moves by its rounding amplified up to lr / eps (1e4 with eps = 1e-6); a missed
# or misplaced step moves a parameter by ~lr.
STEP_TOLERANCE = 1e-7
STEP_EPS = 1e-6


FLOOR = 1e-6  # of the largest tensor of a kind: a gradient that cancels to ~0 (a key's bias) is measured against it


@dataclass(frozen=True)
class Difference:
    """One tensor compared: its largest absolute difference from one process's, and the scale it is measured
    against (the largest absolute value of one process's tensor, at least ``FLOOR`` of the largest of its kind: a
    gradient that cancels to zero in exact arithmetic is rounding, not a scale), and its relative tolerance."""

    name: str
    kind: str  # "loss", "gradient" or "after step"
    worst: float
    scale: float
    tolerance: float

    @property
    def relative(self) -> float:
        return self.worst / self.scale if self.scale > 0 else (0.0 if self.worst == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return self.relative <= self.tolerance


@dataclass(frozen=True)
class Report:
    """What ``verify`` found for one plan: each tensor's difference, or why the plan was refused (before any
    communication), or why its run failed (``failed``: the workers that stopped)."""

    plan: str
    differences: tuple[Difference, ...] = ()
    refused: str = ""
    failed: str = ""
    loss: float = math.nan

    @property
    def verdict(self) -> str:
        """``exact``, ``refused`` (hybridpar said why, before any communication), ``failed`` or ``differs``."""
        if self.refused:
            return "refused"
        if self.failed:
            return "failed"
        return "exact" if all(d.ok for d in self.differences) else "differs"

    @property
    def worst(self) -> Difference | None:
        return max(self.differences, key=lambda d: d.relative / d.tolerance, default=None)

    def lines(self, top: int | None = 10) -> list[str]:
        """The report as text: the verdict, then the tensors worst first (``top`` of them; all with ``None``)."""
        if self.refused or self.failed:
            return [f"{self.plan}: {self.verdict}: {self.refused or self.failed}"]
        worst = self.worst
        head = f"{self.plan}: {self.verdict}, {len(self.differences)} tensors"
        if worst is not None:
            head += f", worst {worst.name} ({worst.kind}) at {worst.relative:.1e} of its scale"
        ranked = sorted(self.differences, key=lambda d: d.relative / d.tolerance, reverse=True)
        rows = [f"  {'ok' if d.ok else 'DIFFERS':7s} {d.kind:10s} {d.relative:9.1e} (limit {d.tolerance:.0e})  {d.name}"
                for d in ranked[:top]]
        return [head, *rows]


def verify(model: torch.nn.Module, plan: Plan, batch: tuple[torch.Tensor, torch.Tensor], *, loss_fn,
           lr: float = 1e-2) -> Report:
    """One float64 training step of ``plan`` on ``model`` against one process, on ``batch`` (``(inputs, targets)``,
    one step's global batch): the report of every tensor's worst difference and a verdict. ``loss_fn(output,
    target)`` is the one-process loss, a mean over the samples. ``model`` is not changed (copies run). Inside a
    process group of ``plan.world_size`` ranks this is collective; without one, it starts that many local
    processes (the model and ``loss_fn`` must then pickle: a module-level function, not a lambda)."""
    _check(plan, batch)
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != plan.world_size:
            raise PlanError(f"verify: the plan ({plan.describe()}) needs {plan.world_size} processes, but this process "
                            f"group has {dist.get_world_size()}; run it in a group of {plan.world_size}, or outside "
                            "any, where verify starts them")
        return run_here(model, plan, batch, loss_fn, lr)
    from hybridpar.launch import launch_local

    try:
        return launch_local(_worker, (model, plan, batch, loss_fn, lr), plan.world_size)[0]
    except (AttributeError, TypeError) as err:
        if "pickle" not in str(err):
            raise
        raise PlanError(f"verify starts {plan.world_size} local processes, which take the model and the loss "
                        f"function by pickling ({err}); use a module-level loss function, or call verify inside a "
                        "process group (under torchrun)") from None


def _check(plan: Plan, batch) -> None:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise PlanError("verify: batch = (inputs, targets), two tensors of one step's global batch")
    inputs, targets = batch
    if len(inputs) != len(targets):
        raise PlanError(f"verify: {len(inputs)} inputs but {len(targets)} targets; give one target per sample")
    if plan.global_batch > 1 and len(inputs) != plan.global_batch:
        raise PlanError(f"verify: the batch has {len(inputs)} samples, but the plan's global batch is "
                        f"{plan.global_batch}; pass one step's batch")


def _worker(model, plan, batch, loss_fn, lr) -> Report:
    from hybridpar.launch import init_distributed, shutdown_distributed

    init_distributed()
    try:
        return run_here(model, plan, batch, loss_fn, lr)
    finally:
        shutdown_distributed()


def run_here(model, plan: Plan, batch, loss_fn, lr: float) -> Report:
    """``verify``'s step on this rank of a process group of the plan's size: the same report on every rank."""
    from hybridpar import parallelize
    from hybridpar.ir.analysis import graph_of, model_output
    from hybridpar.mesh import build_mesh
    from hybridpar.spatial import shard, unshard

    plan = replace(plan, dtype="float64")
    model = copy.deepcopy(model).double()
    reference = copy.deepcopy(model)
    inputs, targets = (t.double() if t.is_floating_point() else t for t in batch)
    described = plan.describe()
    try:
        graph = graph_of(model, inputs, dtype="float64")
        mesh = build_mesh(plan.dims, dist.get_world_size())
        spatial = plan.dims.num_spatial > 1
        split_output = spatial and bool(graph.output) and graph.output[3]

        def parallel_loss(output, target):
            whole = unshard(output, mesh["spatial"], grid=plan.grid) if split_output else output
            return loss_fn(whole, target)

        parallel = parallelize(model, plan, mesh, loss_fn=parallel_loss, example_input=inputs, graph=graph)
    except HybridparError as err:
        return Report(described, refused=str(err))
    try:
        rows = slice(*plan.batch_rows(mesh["dp"].get_local_rank()))
        x, y = inputs[rows], targets[rows]
        x = shard(x, mesh["spatial"], grid=plan.grid) if spatial else x
        loss = parallel.train_step(x, y).double() * parallel.loss_weight
        dist.all_reduce(loss)
        loss = loss / dist.get_world_size()
        expected = loss_fn(model_output(reference(inputs)), targets)
        expected.backward()
        differences = [_difference("loss", "loss", loss.detach(), expected.detach(), TOLERANCE)]
        grads = parallel.gather_gradients()
        for name, param in reference.named_parameters():
            want = param.grad if param.grad is not None else torch.zeros_like(param)
            differences.append(_difference(name, "gradient", grads[name], want, TOLERANCE))
        for params in (parallel.parameters(), reference.parameters()):
            torch.optim.Adam(params, lr=lr, eps=STEP_EPS).step()
        state = parallel.full_state_dict()
        for name, value in reference.state_dict().items():
            if value.is_floating_point():
                differences.append(_difference(name, "after step", state[name], value, STEP_TOLERANCE))
    except HybridparError as err:  # a check of the runtime's own, at the first step (the same on every rank)
        return Report(described, refused=str(err))
    return Report(described, _floored(differences), loss=float(expected.detach()))


def _floored(differences: list[Difference]) -> tuple[Difference, ...]:
    """Each difference measured against at least ``FLOOR`` of the largest scale of its kind."""
    largest: dict[str, float] = {}
    for d in differences:
        largest[d.kind] = max(largest.get(d.kind, 0.0), d.scale)
    return tuple(replace(d, scale=max(d.scale, FLOOR * largest[d.kind])) for d in differences)


@torch.no_grad()
def _difference(name: str, kind: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> Difference:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return Difference(name, kind, math.inf, 0.0, tolerance)
    worst = float((got - want).abs().max()) if want.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    return Difference(name, kind, worst, scale, tolerance)


__all__ = ["Difference", "Report", "TOLERANCE", "verify"]
