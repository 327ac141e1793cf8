"""What a rank runs for the zoo (``tests/clients/test_zoo.py``): a third-party model of ``support.zoo`` under a plan,
one float64 step against one process (the loss, every gradient, the parameters after one Adam step), or the error
that refused the plan before any communication; and the plans each model is tried under: the search's best three
for the world size, and a hand plan on every axis it has (data, sharded data, tensor, pipeline, spatial)."""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist

from hybridpar import parallelize
from hybridpar.errors import HybridparError
from hybridpar.ir.types import Plan
from support.equivalence import TOL, check_step, plan_mesh, replica_slice
from support.zoo import ZOO

BATCH = {"monai": 2}  # a step's global batch by library (else 4)
# float64 throughout; the parallel run sums the same products in other orders. A model that runs parts of its forward
# in float32 whatever its dtype (Gemma's and Cohere's norms; ModernBERT's rotary embedding, which casts queries and
# keys to float32) rounds those at 2^-24 (6e-8) relative, so its gradients agree to ~1e-7: 1e-5 still fails a wrong
# shard or a missed reduction (errors of 1e-3 and more). After Adam's first step a parameter moves by lr * g / (|g| +
# eps): a gradient that cancels to ~0 in exact arithmetic (a bias before a norm) is its rounding (up to ~1e-13 in
# these models' reductions) amplified by up to lr / eps = 1e4, so parameters agree to ~1e-9; a missed or misplaced
# step moves one by ~lr = 1e-2.
# The float32 models' gradients, 1e-7 apart, move a parameter through Adam's first step by up to ~1e-6 apart.
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-7)
ZOO_STEP_TOL = dict(rtol=1e-10, atol=1e-8)
FLOAT32_STEP_TOL = dict(rtol=1e-5, atol=1e-5)


def batch_size(name: str, world: int = 2) -> int:
    base = BATCH.get(ZOO[name].library, 4)
    return base * 2 if world == 4 else base


def build(name: str):
    torch.manual_seed(0)
    return ZOO[name].build().double()


def inputs(name: str, world: int = 2):
    return ZOO[name].batch(batch_size(name, world))


def run(name: str, plan_json: str) -> dict:
    """One step of ``name`` under the plan: ``{"exact": loss}``, or ``{"refused": message}`` where ``parallelize``
    refused it (a ``HybridparError``, raised before any communication). Anything else fails the rank."""
    from hybridpar.spatial import shard

    entry = ZOO[name]
    plan = Plan.from_json(plan_json)
    model = build(name)
    reference = copy.deepcopy(model)
    x, y = inputs(name, plan.world_size)
    mesh = plan_mesh(plan)
    spatial = plan.dims.num_spatial > 1
    dense = y.dim() >= x.dim() - 1  # a target per voxel (values, or class ids without a channel dim)
    loss_fn = spatial_loss(entry, mesh) if spatial and dense else entry.loss
    try:
        parallel = parallelize(model, plan, mesh, loss_fn=loss_fn, example_input=x)
    except HybridparError as err:
        return {"refused": str(err)}
    mine = replica_slice(parallel)
    x_mine, y_mine = x[mine], y[mine]
    if spatial:
        x_mine = shard(x_mine, mesh["spatial"], grid=plan.grid)
        if dense and y.dim() == x.dim():
            y_mine = shard(y_mine, mesh["spatial"], grid=plan.grid)
        elif dense:
            y_mine = shard(y_mine.unsqueeze(1), mesh["spatial"], grid=plan.grid).squeeze(1)
    loss = parallel.train_step(x_mine, y_mine)
    out = reference(x)
    first = out if isinstance(out, torch.Tensor) else next(t for t in (out.to_tuple() if hasattr(out, "to_tuple")
                                                                     else out) if isinstance(t, torch.Tensor))
    tol, step_tol = (FLOAT32_TOL, FLOAT32_STEP_TOL) if entry.float32_inside else (TOL, ZOO_STEP_TOL)
    return {"exact": check_step(parallel, reference, loss, entry.loss(first, y), tol=tol, step_tol=step_tol)}


def spatial_loss(entry, mesh):
    """The entry's loss over a spatially split output: the global mean, from each rank's slab."""
    from hybridpar.spatial import cross_entropy, mse_loss

    if entry.loss.__name__ == "value_loss":
        return lambda out, target: mse_loss(out, target, mesh["spatial"])
    return lambda out, target: cross_entropy(out, target, mesh["spatial"])


def world() -> int:
    return dist.get_world_size()


def hand_plans(name: str, world: int) -> dict[str, Plan]:
    """A plan on every axis the model may take at ``world`` ranks: data, sharded data, tensor (the splits
    ``pair_strategies`` finds), pipeline (cut at the middle block where a cut is allowed), spatial (volumes and
    images) and, at 4 ranks, their pairs. Plans the model cannot take are kept: they must be refused cleanly."""
    from hybridpar.ir.analysis import graph_of
    from hybridpar.parallel.tensor import pair_strategies

    x, _ = inputs(name, world)
    graph = graph_of(build(name), x, dtype="float64")
    shape = tuple(x.shape)
    base = dict(global_batch=shape[0], input_shape=shape, dtype="float64")
    starts = [graph.layers[i].name for i in graph.stage_starts]
    cut = (starts[len(starts) // 2],) if starts else (graph.layers[len(graph.layers) // 2].name,)
    tp = tuple(pair_strategies(graph, tp=2).items())
    spatial = (2,) + (1,) * (len(shape) - 3) if len(shape) >= 4 and x.is_floating_point() else None
    plans = {"dp2": dict(dp=2), "fsdp2": dict(dp=2, sharding=3), "tp2": dict(tp=2, layers=tp),
             "pp2": dict(pp=2, micro_batches=2, stages=cut)}
    if spatial:
        plans["spatial2"] = dict(spatial=spatial)
    if world == 4:
        plans = {"dp2-tp2": dict(dp=2, tp=2, layers=tp), "tp2-pp2": dict(tp=2, pp=2, micro_batches=2, stages=cut,
                                                                       layers=tp),
                 "dp2-pp2": dict(dp=2, pp=2, micro_batches=2, stages=cut)}
        if spatial:
            plans["dp2-spatial2"] = dict(dp=2, spatial=spatial)
    return {key: Plan(**base, **fields) for key, fields in plans.items()}


def searched_plans(name: str, world: int, top: int = 3) -> dict[str, Plan]:
    """The search's best ``top`` plans for ``world`` A100s (the whole space), keyed by what they are."""
    from hybridpar.plan import preset, search_plans

    x, _ = inputs(name, world)
    found = search_plans(build(name), x, preset("a100-80").with_devices(world), top=top, dtype="float64").plans
    return {f"search{i}": plan for i, plan in enumerate(found)}


def outcome(results: list[dict]) -> tuple[str, str]:
    """``("exact" | "refused", detail)`` from every rank's result: the same verdict (and message) on each."""
    kinds = {next(iter(r)) for r in results}
    assert len(kinds) == 1, f"ranks disagree: {results}"
    kind = kinds.pop()
    if kind == "refused":
        messages = {r["refused"] for r in results}
        assert len(messages) == 1, f"ranks refused with different messages: {messages}"
        return kind, messages.pop()
    return kind, json.dumps([r["exact"] for r in results])


def plans_of(name: str, world: int) -> dict[str, Plan]:
    """The hand plans and the search's three best, each once (the search may propose a hand plan too)."""
    out, seen = {}, set()
    for key, plan in {**hand_plans(name, world), **searched_plans(name, world)}.items():
        if plan.to_json() not in seen:
            seen.add(plan.to_json())
            out[key] = plan
    return out
