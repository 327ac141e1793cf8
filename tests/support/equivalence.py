"""One step of a ``ParallelModel`` against one process from the same weights and the same global batch (float64):
the loss, every gradient via ``gather_gradients()``, the parameters after one Adam step via
``full_state_dict()``; shared by the tests of ``hybridpar.parallelize`` on our models and on other libraries'."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpar.mesh import AXES
from hybridpar.parallel.state import original_name
from support import harness

# float64: the parallel run sums the same products in other orders (split matmuls, micro-batch means, all-reduces)
TOL = dict(rtol=1e-10, atol=1e-12)
# Adam's first step moves a parameter by lr * g / (|g| + eps), which near g = 0 amplifies a gradient's rounding by
# up to lr / eps: gradients that cancel to exactly 0 in exact arithmetic (a key bias; a conv bias before an instance
# norm, whose rounding in a 32^3 U-Net reaches 2e-15) would move by +-lr either way with PyTorch's eps = 1e-8.
# With eps = 1e-6 (STEP_EPS) the amplification is 1e4, so such parameters agree to ~1e-11 after the step, while
# every gradient above 1e-6 still takes a full Adam step; a wrong shard or a missed step moves a parameter by ~lr
STEP_TOL = dict(rtol=1e-10, atol=1e-10)
STEP_EPS = 1e-6


def plan_mesh(plan):
    return harness.mesh(tuple(plan.dims.sizes()[a] for a in AXES), AXES)


def replica_slice(parallel) -> slice:
    """This replica's samples of the global batch: even, or its share (``plan.shares``)."""
    return slice(*parallel.plan.batch_rows(parallel.mesh["dp"].get_local_rank()))


def check_step(parallel, reference, loss: torch.Tensor, expected: torch.Tensor, tol: dict = TOL,
               step_tol: dict = STEP_TOL) -> float:
    """The parallel step against one process's: the loss, every gradient, the parameters after one Adam
    step; and that the plan really split the parameters it says it splits."""
    plan = parallel.plan
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in parallel.parameters())
    whole = sum(p.numel() for p in reference.parameters())
    if plan.pp > 1:  # really split: no stage holds every layer (a stage may hold a copy of a tied weight)
        held = {original_name(n) for module in parallel.modules.values()
                for n, _ in module.named_parameters(remove_duplicate=False)}
        assert not {n for n, _ in reference.named_parameters(remove_duplicate=False)} <= held
    else:
        assert local < whole if plan.tp > 1 or plan.sharding else local == whole
    expected.backward()
    mean = loss.clone() * parallel.loss_weight  # an uneven share's loss weighs by its samples
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / dist.get_world_size(), expected.detach(), **tol)  # the global batch's loss
    grads = parallel.gather_gradients()
    assert set(grads) == {name for name, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():  # zeros for a parameter the forward does not use
        expected_grad = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(grads[name], expected_grad, **tol, msg=lambda m: f"gradient of {name}: {m}")
    for params in (parallel.parameters(), reference.parameters()):
        torch.optim.Adam(params, lr=1e-2, eps=STEP_EPS).step()
    state = parallel.full_state_dict()
    assert set(state) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, **step_tol, msg=lambda m: f"{name} after one Adam step: {m}")
    return loss.item()
