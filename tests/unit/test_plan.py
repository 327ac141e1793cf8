"""The planner: model analysis, cost terms, the exactness of every search step against brute force,
Plan JSON and validation. Single process, meta device: nothing here allocates a real activation."""

import dataclasses
import itertools
import math
import random

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from hybridpar.dims import ParallelDims
from hybridpar.errors import GeometryError, PlanError
from hybridpar.geometry import Window, plan_exchange, split_bounds
from hybridpar.ir import rules
from hybridpar.ir.rules import check_grid
from hybridpar.models import gpt
from hybridpar.plan import Plan, analyse, cost, graph_of, plan, preset, search_plans, validate
from hybridpar.plan.chains import Caches, best_chain, context, options_of
from hybridpar.plan.cluster import ClusterSpec, Link
from hybridpar.plan.options import layer_options
from hybridpar.plan.pricing import Problem, price
from hybridpar.plan.rates import ConvRate, OpRate
from hybridpar.plan.search import EXPLAINED
from hybridpar.plan.space import Constraints, Setting, meshes, micro_batch_counts
from hybridpar.plan.stages import StageCosts, StageSetting, Units, best_cuts
from hybridpar.plan.validate import chain_of
from support.models import Attention, TinyCosmoFlow, TinyUNet

REL = 1e-9  # the search and the brute force add the same float terms in other orders


def small_cluster(devices: int, per_node: int = 2, memory_gib: float = 80.0) -> ClusterSpec:
    base = preset("a100-80")
    spec = ClusterSpec(name="test", num_nodes=1, devices_per_node=per_node, device_memory=memory_gib * 2**30,
                       reserved_memory=0.5 * 2**30, peak_flops=base.peak_flops, efficiency=base.efficiency,
                       memory_bandwidth=base.memory_bandwidth, intra_node=base.intra_node,
                       inter_node=base.inter_node)
    return spec.with_devices(devices)


# --- analysis -------------------------------------------------------------------------------------

def test_analysis_records_flops_saved_bytes_and_halos():
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8**3, 5))
    g = analyse(model, (2, 2, 8, 8, 8))
    assert [layer.kind for layer in g.layers] == ["conv", "pointwise", "flatten", "linear"]
    with FlopCounterMode(display=False) as counter:
        model[0](torch.zeros(2, 2, 8, 8, 8))
    assert g.layers[0].flops == counter.get_total_flops()
    assert g.layers[3].flops == 2 * 2 * 4 * 8**3 * 5
    assert g.layers[0].halo == ((1, 1),) * 3
    # the conv keeps its input, ReLU its output; Linear's input is a view of that output: not counted again
    assert [layer.saved_bytes for layer in g.layers] == [2 * 2 * 512 * 4, 2 * 4 * 512 * 4, 0, 0]
    assert g.layers[3].param_bytes == (4 * 512 * 5 + 5) * 4
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert g.cut_points == (0, 1, 2)


def test_analysis_counts_attention_itself():
    model = Attention(d=16, heads=4)
    g = analyse(model, (2, 10, 16))
    att = next(layer for layer in g.layers if layer.kind == "attention")
    assert att.heads == 4
    assert att.flops == 4 * 2 * 4 * 10 * 10 * 4  # Q·Kᵀ and P·V, 2·B·H·L·L·E each
    qkv, out = 2 * 10 * 48 * 4, 2 * 10 * 16 * 4
    assert att.saved_bytes == qkv + out + 2 * 4 * 10 * 4  # q, k, v (one tensor), output, log-sum-exp
    assert g.layers[0].name == "qkv" and g.layers[-1].name == "proj"


def test_gpt_blocks_repeat_and_cut_between_blocks():
    with torch.device("meta"):
        model = gpt(num_layers=3, num_heads=4, d_model=32, seq_len=16, vocab_size=64)
    g = graph_of(model, torch.zeros(2, 16, dtype=torch.long))
    assert g.num_params == model.num_parameters()
    starts = {g.layers[i + 1].name for i in g.cut_points}
    assert {"blocks.1.ln_1", "blocks.2.ln_1", "ln_f"} <= starts
    assert not any(name.startswith("blocks.1.attn.proj") for name in starts)  # the residual crosses there
    def block(k):
        return [layer.signature for layer in g.layers if layer.owner.startswith(f"blocks.{k}.")]

    assert block(1) == block(2) and block(1)  # the blocks are priced once, alike


def test_unet_cannot_be_cut_across_a_skip_connection():
    g = analyse(TinyUNet(channels=1, width=4, classes=3), (1, 1, 8, 8, 8))
    cat = next(layer for layer in g.layers if layer.kind == "cat")
    skip = min(p for p in cat.inputs)
    assert skip in g.skip_sources
    assert not any(skip < c < cat.index for c in g.cut_points)  # after the skip source itself is fine


def test_analysis_leaves_a_real_model_alone():
    model = TinyCosmoFlow(size=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    analyse(model, (1, 2, 16, 16, 16))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_shape_the_model_cannot_take_is_named():
    with pytest.raises(PlanError, match=r"\(1, 3, 16, 16, 16\)"):
        analyse(TinyCosmoFlow(size=16, channels=2), (1, 3, 16, 16, 16))


# --- cost terms -----------------------------------------------------------------------------------

def test_collective_formulas():
    group = cost.Group(4, Link(bandwidth=1e9, latency=1e-6))
    assert cost.all_reduce_time(8e6, group) == pytest.approx(4e-6 + 1.5 * 8e6 / 1e9)  # log2(4) = 2 < 3 steps
    assert cost.all_gather_time(8e6, group) == pytest.approx(2e-6 + 0.75 * 8e6 / 1e9)
    assert cost.reduce_scatter_time(8e6, group) == cost.all_gather_time(8e6, group)  # half a ring each
    measured = cost.Group(4, Link(bandwidth=1e9, latency=1e-6, reduce_scatter_bandwidth=0.25e9,
                                  reduce_scatter_latency=5e-6, all_gather_latency=3e-6))
    assert cost.reduce_scatter_time(8e6, measured) == pytest.approx(10e-6 + 0.75 * 8e6 / 0.25e9)  # its own rates
    assert cost.all_gather_time(8e6, measured) == pytest.approx(6e-6 + 0.75 * 8e6 / 1e9)  # bandwidth: all-reduce's
    assert cost.gradient_sync_time(8e6, measured, 1.0, 2) > cost.gradient_sync_time(8e6, measured, 1.0, 0)
    assert [cost.collective_steps(n) for n in (1, 2, 3, 4, 5, 1024)] == [0, 1, 2, 2, 3, 10]
    assert cost.send_time(1e6, group.link) == pytest.approx(1e-6 + 1e-3)
    assert cost.all_reduce_time(8e6, cost.Group(1, group.link)) == 0.0
    assert cost.pipeline_time([1.0, 3.0, 2.0], 4) == 3 * 3.0 + 6.0
    assert [cost.micro_batches_in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert cost.model_state_memory(100.0, 0, 4, "adam") == (100.0, 100.0, 200.0)
    assert cost.model_state_memory(100.0, 3, 4, "adam") == (25.0, 25.0, 50.0)
    assert cost.model_state_memory(100.0, 1, 4, "sgd") == (100.0, 100.0, 25.0)


def test_ranks_that_meet_wait_once_per_meeting():
    link = Link(bandwidth=1e9, latency=1e-6, sync_wait=1e-3)
    group = cost.Group(4, link)
    assert cost.all_reduce_time(8e6, group) == pytest.approx(4e-6 + 1.5 * 8e6 / 1e9)  # the operations themselves
    assert cost.halo_exchange_time((1e6, 0.0, 1e6), link) == pytest.approx(2 * (1e-6 + 1e-3))
    plain = cost.gradient_sync_time(8e6, cost.Group(4, Link(bandwidth=1e9, latency=1e-6)), 1.0, 0)
    assert cost.gradient_sync_time(8e6, group, 1.0, 0) == pytest.approx(plain + 1e-3)
    # a layer whose passes communicate waits once per pass (its exchanges along both split dims follow one
    # another at once), a split normalisation twice per pass (sums, then sums of squares), the first conv
    # only in forward (its input needs no gradient)
    graph = graph_of(TinyUNet(width=4), (2, 1, 16, 16, 16))
    spec = dataclasses.replace(small_cluster(4), intra_node=link, inter_node=link)
    ctx = _ctx(graph, spec, grid=(2, 2, 1), tp=1, micro_batch=2)
    meetings = {}
    for layer in graph.layers:
        option = layer_options(layer, graph, ctx)[0]
        if any(option.comm.get(k) for k in ("halo", "spatial")):
            meetings.setdefault(layer.kind, set()).add(round(option.comm["sync"] / 1e-3, 9))
        else:
            assert "sync" not in option.comm, layer.name
    first = graph.layers[0]
    assert first.kind == "conv" and layer_options(first, graph, ctx)[0].comm["sync"] == pytest.approx(1e-3)
    assert meetings["group_norm"] == {4} and meetings["conv"] == {1, 2}


def test_fsdp_gathers_once_per_wrapped_block():
    """FSDP gathers each top-level block's parameters (``parallelize`` wraps the blocks), not each layer's:
    a GPT block of six weighted layers is one gather, before forward and before backward, ranks meeting."""
    link = Link(bandwidth=1e9, latency=1e-6, sync_wait=1e-3)
    group = cost.Group(4, link)
    one = cost.fsdp_gather_time(4e6, group)
    assert one == pytest.approx(2 * (cost.all_gather_time(4e6, group) + 1e-3))
    assert cost.fsdp_gather_time(4e6, group, gathers=3) == pytest.approx(one + 2 * 2 * (2e-6 + 1e-3))
    assert cost.fsdp_gather_time(4e6, cost.Group(1, link)) == 0.0
    with torch.device("meta"):
        model = gpt(num_layers=3, num_heads=4, d_model=32, seq_len=16, vocab_size=64)
    g = graph_of(model, torch.zeros(8, 16, dtype=torch.long))
    chain = best_chain(g, _ctx(g, small_cluster(4), grid=(1,), tp=1, micro_batch=2))
    units = Units.of(chain, rules.legal_starts(g, lambda i: chain.layouts[i] != "R"), g.block_index)
    block = units.starts.index(next(i for i, layer in enumerate(g.layers) if layer.name == "blocks.1.ln_1"))
    weighted = sum(1 for o in chain.options[units.starts[block]:units.starts[block + 1]] if o.params)
    assert units.param_blocks[block] == 1 and weighted >= 6


def test_gradient_sync_by_sharding_level():
    group = cost.Group(4, Link(bandwidth=1e9, latency=1e-6))
    big = 1e9  # far more than one bucket, far slower than the backward below
    ddp = cost.gradient_sync_time(big, group, 0.1, 0)
    assert ddp == pytest.approx(cost.all_reduce_time(big, group) - 0.1 + cost.all_reduce_time(cost.BUCKET_BYTES, group))
    zero2 = cost.gradient_sync_time(big, group, 0.1, 2)
    gather = cost.all_gather_time(big, group)
    assert zero2 == pytest.approx(cost.reduce_scatter_time(big, group) - 0.1
                                  + cost.reduce_scatter_time(cost.BUCKET_BYTES, group) + gather)
    assert cost.gradient_sync_time(big, group, 0.1, 3) == pytest.approx(zero2 - gather)
    assert cost.gradient_sync_time(big, cost.Group(1, group.link), 0.1, 0) == 0.0


def test_layer_times_use_the_measured_rates():
    rows = tuple(ConvRate("float32", cin, cout, positions, 4e9, 2e9, 1e9)
                 for cin, cout, positions in itertools.product((1, 64), (4, 64), (2**10, 2**20)))
    spec = dataclasses.replace(small_cluster(1), conv_rates=rows,
                               op_rates=(OpRate("MaxPool3d", 2**20, 1e9, 4e9), OpRate("Conv3d", 2**20, 1e9, 1e9)))
    flops, moved = 8e9, 2**20
    # a conv: forward, input gradient, weight gradient at their own rates (each at least its bytes' time)
    times = cost.layer_times("conv", "Conv3d", flops, moved, spec, "float32", has_weight=True, input_grad=True,
                             channels=(16, 16), positions=2**15)
    assert times == pytest.approx((2.0, 4.0 + 8.0))
    first = cost.layer_times("conv", "Conv3d", flops, moved, spec, "float32", has_weight=True, input_grad=False,
                             channels=(16, 16), positions=2**15)
    assert first == pytest.approx((2.0, 8.0))  # the first layer: the weight gradient only
    tiny = cost.layer_times("conv", "Conv3d", 1.0, moved, spec, "float32", has_weight=True, input_grad=True,
                            channels=(16, 16), positions=2**15)
    assert tiny == pytest.approx((moved / 1e9, 2 * moved / 1e9))  # a 1x1 conv: its bytes set the time
    # a 3x3x3 conv on rates measured on its kernel: they include its memory traffic (the op's rows come from a
    # 1x1 conv); the same conv where no rates were measured is floored by the memory bandwidth
    wide = cost.layer_times("conv", "Conv3d", 1.0, moved, spec, "float32", has_weight=True, input_grad=True,
                            channels=(16, 16), positions=2**15, kernel=(3, 3, 3))
    assert wide == pytest.approx((1.0 / 4e9, 1.0 / 2e9 + 1.0 / 1e9))
    bare = dataclasses.replace(spec, conv_rates=())
    assert not bare.has_conv_rates("float32") and spec.has_conv_rates("float32")
    assert cost.layer_times("conv", "Conv3d", 1.0, moved, bare, "float32", has_weight=True, input_grad=True,
                            kernel=(3, 3, 3)) == pytest.approx(tiny)
    # a memory-bound layer at its op's rates; an op without rows at the memory bandwidth
    pool = cost.layer_times("pool", "MaxPool3d", 0, moved, spec, "float32", has_weight=False, input_grad=True)
    assert pool == pytest.approx((moved / 1e9, moved / 4e9))
    relu = cost.layer_times("pointwise", "ReLU", 0, moved, spec, "float32", has_weight=False, input_grad=False)
    assert relu == pytest.approx((moved / spec.memory_bandwidth, 0.0))


def test_the_spatial_runtime_pays_its_copies_and_its_split_norms():
    graph = graph_of(TinyUNet(width=4), (2, 1, 16, 16, 16))
    spec = small_cluster(2)
    whole, split = (_ctx(graph, spec, grid=grid, tp=1, micro_batch=2) for grid in ((1, 1, 1), (2, 1, 1)))
    by_name = {layer.name: layer for layer in graph.layers}
    bandwidth = spec.memory_bandwidth
    conv = by_name["mid.0"]  # (2, 4, 8, 8, 8) -> (2, 8, 8, 8, 8), k = 3: a half gets one 8 x 8 row from its neighbour
    slab = layer_options(conv, graph, split)[0]
    moved = (conv.bytes_moved - conv.param_bytes) / 2 + conv.param_bytes
    half = cost.layer_times("conv", "Conv3d", conv.flops / 2, moved,
                            spec, "float32", has_weight=True, input_grad=True, channels=(4, 8), positions=2 * 8**3 / 2)
    copy = 2 * (2 * 4 * 4 * 8 * 8 * 4 + 2 * 4 * 8 * 8 * 4) / bandwidth  # read + write of the slab and its halo
    assert (slab.forward, slab.time - slab.forward - sum(slab.comm.values())) == pytest.approx((half[0] + copy,
                                                                                                 half[1] + copy))
    norm = by_name["enc.1"]  # affine InstanceNorm3d
    plain, slab = (layer_options(norm, graph, ctx)[0] for ctx in (whole, split))
    fused = (norm.bytes_moved - norm.param_bytes) / 2  # the half a rank holds
    assert slab.forward == pytest.approx((4 + 2) * fused / bandwidth)
    assert plain.forward == pytest.approx(norm.bytes_moved / bandwidth)


def test_groups_span_nodes_by_their_stride():
    spec = small_cluster(8, per_node=4)
    assert cost.Group.of(spec, 4, 1).link is spec.intra_node
    assert cost.Group.of(spec, 2, 4).link is spec.inter_node
    assert cost.Group.of(spec, 2, 2).link is spec.intra_node


def test_grid_check_follows_the_runtime_rule():
    """The closed form of ``check_grid`` refuses exactly the splits whose halo ``plan_exchange`` refuses."""
    for size, parts, kernel, stride, pad in itertools.product((4, 6, 9, 16), (2, 3, 4, 8), (1, 3, 5, 7),
                                                                (1, 2), (0, 1, 2, 3)):
        if parts > size or pad > kernel // 2 * 2:
            continue
        conv = nn.Conv1d(1, 1, kernel, stride=stride, padding=pad)
        try:
            g = analyse(conv, (1, 1, size))
        except PlanError:
            continue  # the conv itself does not fit the input
        out = g.layers[0].out_shape[2]
        window = Window(kernel, stride, pad)
        needs = tuple(window.need(*b) for b in split_bounds(out, parts))
        try:
            for part in range(parts):
                plan_exchange(axis=0, size=size, bounds=split_bounds(size, parts), needs=needs, boundary="zeros",
                              part=part, where="x")
            runtime_ok = out >= parts
        except GeometryError:
            runtime_ok = False
        try:
            check_grid(g, (parts,))
            planner_ok = True
        except PlanError:
            planner_ok = False
        assert planner_ok == runtime_ok, (size, parts, kernel, stride, pad)


# --- exactness of the search against brute force --------------------------------------------------

def _ctx(graph, spec, dp=1, grid=(1,), tp=2, micro_batch=2):
    return context(spec, Constraints(global_batch=micro_batch * dp), ParallelDims(dp=dp, spatial=grid, tp=tp),
                   micro_batch)


def _brute_force_chain(graph, ctx):
    """Every assignment of the strategies each layer may take; those the rules refuse (``chain_of`` raises, as
    ``check_plan`` would) are not plans."""
    cache = Caches()
    choices = [[o.strategy for o in options_of(layer, graph, ctx, cache)] for layer in graph.layers]
    best, legal = math.inf, 0
    for combo in itertools.product(*choices):
        try:
            chain = chain_of(graph, ctx, {layer.name: s for layer, s in zip(graph.layers, combo) if s != "replicate"},
                             cache)
        except PlanError:
            continue
        if rules.idle_tp_refusal(graph, ctx.tp, combo):
            continue  # every tp rank would repeat all the work: not a plan
        legal += 1
        best = min(best, chain.total_time)
    return best, legal


@pytest.mark.parametrize("name", ["mlp", "cnn", "attention", pytest.param("gpt", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tp", [2, 4])
def test_per_layer_strategies_are_exact(name, tp):
    models = {
        "mlp": (lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                      nn.Linear(64, 8)), (4, 64)),
        "cnn": (lambda: TinyCosmoFlow(size=16, channels=4, width=8), (2, 4, 16, 16, 16)),
        "attention": (lambda: Attention(d=32, heads=4), (2, 64, 32)),
        "gpt": (lambda: gpt(num_layers=1, num_heads=4, d_model=32, seq_len=32, vocab_size=64),
                torch.zeros(2, 32, dtype=torch.long)),
    }
    factory, example = models[name]
    graph = graph_of(factory(), example)
    spec = small_cluster(8, per_node=8)
    for micro_batch in (1,) if name == "gpt" else (1, 64):  # gpt: 6,912 assignments per case
        ctx = _ctx(graph, spec, tp=tp, micro_batch=micro_batch)
        found = best_chain(graph, ctx)
        total = sum(found.layer_time(i) for i in range(len(graph.layers)))
        oracle, count = _brute_force_chain(graph, ctx)
        assert count > 1
        assert total == pytest.approx(oracle, rel=REL)
        again = chain_of(graph, ctx, {graph.layers[i].name: o.strategy for i, o in enumerate(found.options)})
        assert sum(again.layer_time(i) for i in range(len(graph.layers))) == pytest.approx(total, rel=REL)


def test_megatron_pattern_is_found_for_attention():
    """A fused projection is split by heads where its layout gives each rank whole heads; where it holds q, k
    and v one after another, a split by output features would give a rank a piece of q only: attention is
    then not split (the runtime would refuse it)."""
    for layout, split in (("heads", True), ("sections", False)):
        graph = graph_of(Attention(d=1024, heads=16, layout=layout), (8, 512, 1024))
        found = best_chain(graph, _ctx(graph, small_cluster(8, per_node=8), tp=4, micro_batch=8))
        strategies = {graph.layers[i].name: o.strategy for i, o in enumerate(found.options)}
        attention = next(s for n, s in strategies.items() if "scaled_dot_product_attention" in n)
        assert (strategies["qkv"], attention, strategies["proj"]) == (("column", "shard", "row") if split else
                                                                      (strategies["qkv"], "replicate",
                                                                       strategies["proj"])), layout


def _random_units(n, rng):
    def values(lo, hi):
        return tuple(rng.uniform(lo, hi) for _ in range(n))

    return Units(tuple(range(n)), values(0.1, 1), values(0, 0.3), values(0, 0.6), values(0, 4e9), (1,) * n,
                 values(0, 8e9), values(0, 2e9), values(0, 1e9), values(0, 1e9), values(0, 5e9))


def test_pipeline_cuts_are_exact():
    spec = preset("a100-80")
    checked = 0
    for trial in range(150):
        rng = random.Random(trial)
        n = rng.randint(2, 9)
        k = rng.randint(2, min(n, 4))
        setting = StageSetting(spec, k, rng.randint(k, 3 * k), rng.choice([0, 1, 2, 3]), rng.random() < 0.5,
                               "adam", cost.Group(8, spec.intra_node), spec.inter_node)
        costs = StageCosts(_random_units(n, rng), setting)
        limit = rng.uniform(20e9, 120e9)
        best = math.inf
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = list(zip((0,) + cuts, cuts + (n,)))
            if all(costs.memory(a, b, s).total <= limit for s, (a, b) in enumerate(bounds)):
                best = min(best, cost.pipeline_time([costs.stage_time(a, b) for a, b in bounds],
                                                    setting.micro_batches))
        got = best_cuts(costs, limit)
        if got is None:
            assert best == math.inf
            continue
        bounds = list(zip((0,) + got, got + (n,)))
        assert all(costs.memory(a, b, s).total <= limit for s, (a, b) in enumerate(bounds))
        value = cost.pipeline_time([costs.stage_time(a, b) for a, b in bounds], setting.micro_batches)
        assert value == pytest.approx(best, rel=REL)
        checked += 1
    assert checked > 100


def _brute_force_search(graph, spec, c):
    """Every mesh, micro-batch count, ZeRO level, checkpointing and legal cut, priced by ``price``."""
    best = (math.inf, None)
    problem = Problem(graph, spec, c)
    for dims in meshes(spec.num_devices, graph, c, spec.devices_per_node):
        dp, grid, tp, pp = dims.dp, dims.spatial, dims.tp, dims.pp
        try:
            check_grid(graph, grid)
        except PlanError:
            continue
        per_replica = c.global_batch // dp
        for m in micro_batch_counts(per_replica, pp, c):
            for z in (c.sharding if dp * math.prod(grid) > 1 else (0,)):
                chain = best_chain(graph, context(spec, c, dims, per_replica // m, sharding=z))
                if rules.idle_tp_refusal(graph, tp, [o.strategy for o in chain.options]):
                    continue  # every tp rank would repeat all the work: not a plan
                starts = rules.legal_starts(graph, lambda i: chain.layouts[i] != "R")[1:]
                for ckpt in c.checkpointing:
                    for cuts in itertools.combinations(starts, pp - 1):
                        step, memory, _ = price(problem, dims, Setting(m, z, ckpt), chain, cuts)
                        if max(mem.total for mem in memory) <= spec.device_memory and step < best[0]:
                            best = (step, (dims, m, z, ckpt, cuts))
    return best


@pytest.mark.parametrize("memory_gib", [80.0, 0.5005, 0.50003])
@pytest.mark.parametrize("top", [1, 5])
def test_search_agrees_with_brute_force(memory_gib, top):
    """Small enough to enumerate: 8 devices on 2-device nodes, a CNN with tp-splittable convs and many cut
    points, and memory limits that rule out more and more candidates."""
    graph = graph_of(TinyCosmoFlow(size=16, channels=2, width=4), (1, 2, 16, 16, 16))
    spec = small_cluster(8, per_node=2, memory_gib=memory_gib)
    c = Constraints(global_batch=8, top=top, max_micro_batches=2)
    oracle, _ = _brute_force_search(graph, spec, c)
    result = search_plans(graph, None, spec, global_batch=8, top=top, max_micro_batches=2)
    if oracle == math.inf:
        assert not result.plans
        return
    assert result.plans[0].prediction.step_time == pytest.approx(oracle, rel=REL)
    assert len(result.plans) <= top


def test_each_family_is_explained_alike_whatever_top():
    """A family's row in ``rejected`` is its best plan, exactly (its own search finds no faster one), when that is
    within ``EXPLAINED`` times the fastest, and the same for any ``top``."""
    graph = graph_of(TinyCosmoFlow(size=16, channels=2, width=4), (1, 2, 16, 16, 16))
    spec = small_cluster(8, per_node=2)
    runs = [search_plans(graph, None, spec, global_batch=8, top=top, max_micro_batches=2) for top in (1, 3, 100)]
    assert runs[0].rejected == runs[1].rejected == runs[2].rejected
    fastest = runs[0].plans[0].prediction.step_time
    rows = {"best": 0, "slower": 0}
    for name, why in runs[0].rejected.items():
        alone = search_plans(graph, None, spec, global_batch=8, top=1, max_micro_batches=2, families=(name,))
        best = alone.plans[0].prediction.step_time
        if why.startswith("best "):
            assert why.startswith(f"best {alone.plans[0].describe()}: {best * 1e3:.4g} ms"), (name, why)
            rows["best"] += 1
        else:
            assert why.startswith(f"{EXPLAINED:g}x the fastest or slower") and best >= EXPLAINED * fastest, (name, why)
            rows["slower"] += 1
    assert rows["best"] >= 3 and rows["slower"] >= 1, rows


# --- plans ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cnn_graph():
    return graph_of(TinyCosmoFlow(size=16, channels=2, width=4), (1, 2, 16, 16, 16))


def test_plan_round_trips_through_json(cnn_graph):
    spec = small_cluster(8, per_node=8)
    found = plan(cnn_graph, None, spec, global_batch=8, pp=2)
    again = Plan.from_json(found.to_json())
    assert again == found
    assert validate(again, cnn_graph, spec).prediction == found.prediction


def test_plan_json_errors():
    with pytest.raises(PlanError, match="schema_version"):
        Plan.from_json('{"schema_version": 99}')
    with pytest.raises(PlanError, match="unknown key 'dpp'"):
        Plan.from_json('{"schema_version": 1, "dpp": 2}')
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{", where="plan.json")


@pytest.mark.parametrize("change, message", [
    (dict(dp=3), r"dp=3 .* 3 devices, but the cluster has 4"),
    (dict(global_batch=6, dp=4), r"global_batch = 6 does not split into dp=4"),
    (dict(layers=(("features.9", "column"),)), r"layer 'features.9' is not in the model \(TinyCosmoFlow\)"),
    (dict(tp=4, dp=1, layers=(("features.0", "row"),)), r"layer 'features.0': in_channels=2 does not split into 4"),
    (dict(tp=2, dp=2, layers=(("head.0", "shard"),)), r"layer 'head.0' \(Flatten\) cannot run 'shard'"),
    (dict(tp=2, dp=2, sharding=3, layers=(("features.0", "column"),)),
     r"layer 'features.0' \(Conv3d\) cannot run 'column': FSDP / ZeRO \(sharding > 0\) does not run channel-split"),
    (dict(tp=2, dp=1, spatial=(2, 1, 1), layers=(("head.1", "column"),)),
     r"layer 'head.1' \(Linear\) cannot run 'column': a spatially split model keeps its dense layers whole"),
    (dict(pp=2, dp=2, micro_batches=2, stages=()), r"pp=2 needs 1 stage boundaries"),
    (dict(pp=2, dp=2, micro_batches=2, stages=("nope",)), r"'nope' is not a layer"),
])
def test_validation_names_what_is_wrong(cnn_graph, change, message):
    spec = small_cluster(4, per_node=4)
    hand = Plan(**{"dp": 4, "global_batch": 8, **change})
    with pytest.raises(PlanError, match=message):
        validate(hand, cnn_graph, spec)


def test_the_search_splits_only_what_the_runtime_runs(cnn_graph):
    """Convolutions split by channels only under DDP (sharding 0), dense layers only without spatial splits:
    what ``hybridpar.parallelize`` refuses, the search never proposes."""
    spec = small_cluster(8, per_node=8)
    c = Constraints(global_batch=8)
    conv, dense = (next(layer for layer in cnn_graph.layers if layer.kind == kind) for kind in ("conv", "linear"))

    def strategies(layer, grid, sharding):
        ctx = context(spec, c, ParallelDims(dp=2, spatial=grid, tp=2), 4, sharding=sharding)
        return {o.strategy for o in layer_options(layer, cnn_graph, ctx)}

    assert strategies(conv, (1, 1, 1), 0) == strategies(dense, (1, 1, 1), 3) == {"replicate", "column", "row"}
    assert strategies(conv, (1, 1, 1), 1) == strategies(conv, (1, 1, 1), 3) == {"replicate"}
    assert strategies(conv, (2, 1, 1), 0) == {"replicate", "column", "row"}
    assert strategies(dense, (2, 1, 1), 0) == {"replicate"}


def test_validation_refuses_a_stage_inside_a_skip():
    g = analyse(TinyUNet(channels=1, width=4, classes=3), (1, 1, 8, 8, 8))
    cat = next(layer for layer in g.layers if layer.kind == "cat")
    inside = g.layers[cat.index - 1].name
    hand = Plan(dp=1, pp=2, micro_batches=2, global_batch=2, stages=(inside,))
    with pytest.raises(PlanError, match=f"a stage cannot start at '{inside}': 2 tensors that need a gradient cross"):
        validate(hand, g, small_cluster(2, per_node=2))


def test_validation_refuses_a_plan_that_does_not_fit(cnn_graph):
    spec = small_cluster(1, per_node=1, memory_gib=0.5001)
    with pytest.raises(PlanError, match=r"stage 0 \(from layer 'features.0'\) needs .* GiB per device"):
        validate(Plan(global_batch=64), cnn_graph, spec)


def test_no_plan_says_what_would_fit(cnn_graph):
    spec = small_cluster(1, per_node=1, memory_gib=0.52)
    with pytest.raises(PlanError) as err:
        plan(cnn_graph, None, spec, global_batch=64)
    text = str(err.value)
    assert "no plan fits 1 test devices" in text and "would fit with" in text and "global batch of" in text


def test_the_search_explains_the_families_that_lose(cnn_graph):
    result = search_plans(cnn_graph, None, small_cluster(8, per_node=8), global_batch=8)
    assert result.plans and result.num_candidates > 10
    assert set(result.rejected) >= {"dp", "dp x pp"}
    assert all(isinstance(v, str) and v for v in result.rejected.values())


def test_no_pipelines_for_batch_norm():
    """A pipeline takes batch-norm statistics per micro-batch: the search leaves pipelines out and says why."""
    graph = graph_of(TinyCosmoFlow(size=16, channels=2, width=4, batch_norm=True), (1, 2, 16, 16, 16))
    result = search_plans(graph, None, small_cluster(8, per_node=8), global_batch=8, top=50)
    assert result.plans and all(p.pp == 1 for p in result.plans)
    assert "would take its statistics over each of the 2 micro-batches of a pipeline" in result.rejected["dp x pp"]


def test_gpt3_175b_analyses_on_the_meta_device():
    with torch.device("meta"):
        model = gpt(preset="gpt3-175b")
    g = graph_of(model, torch.zeros(1, 2048, dtype=torch.long), "bfloat16")
    assert g.num_params == model.num_parameters() > 175e9
    assert len(g.layers) == 4 + 96 * 12 + 2
    assert sum(1 for layer in g.layers if layer.kind == "attention") == 96
    # the 96 blocks are priced as one: their layers' signatures repeat
    assert len({layer.signature for layer in g.layers}) < 30


@pytest.mark.parametrize("text, message", [
    ('{"schema_version": 1, "dp": "2"}', r'p.json: dp = "2": expected a whole number >= 1'),
    ('{"schema_version": 1, "spatial": [2, 0]}', r"spatial = \[2, 0\]: expected a list of whole numbers"),
    ('{"schema_version": 1, "checkpointing": 1}', r"checkpointing = 1: expected true or false"),
    ('{"schema_version": 1, "layers": {"fc": 2}}', r"layers = .*: expected an object mapping layer names"),
    ('{"schema_version": 1, "dp": 2, "dp": 4}', r"p.json: key 'dp' appears twice in one object; keep one"),
    ('{"schema_version": 1, "prediction": {"step_time": NaN}}', r"p.json: NaN is no JSON number"),
    ('{"schema_version": 1, "prediction": {"step_time": 1, "compute_time": 1, "speed": 2}}',
     r"p.json: unknown key prediction.speed; a prediction has step_time, compute_time"),
    ('{"schema_version": 1, "prediction": {"step_time": "1", "compute_time": 1}}',
     r'prediction.step_time = "1": expected a number'),
    ('{"schema_version": 1, "prediction": {"step_time": 1, "compute_time": 1, "memory": {"total": []}}}',
     r"prediction.memory = .*: expected an object of numbers"),
    ('{"schema_version": 1, "prediction": {"compute_time": 1}}', r"prediction has no step_time"),
    ('{"schema_version": 1, "layers": ' + "[" * 100_000 + "]" * 100_000 + "}", r"not valid JSON \(nested too"),
])
def test_plan_json_types_are_checked(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text, where="p.json")


def test_pipeline_schedules_are_priced():
    """GPipe holds every micro-batch's activations; interleaved 1F1B (two stages per rank) shrinks the bubble
    and holds both of a rank's stages; a stage boundary inside a block is refused, as the runtime would."""
    with torch.device("meta"):
        model = gpt(num_layers=4, num_heads=8, d_model=1024, seq_len=512, vocab_size=512)  # compute-bound
    g = graph_of(model, torch.zeros(8, 512, dtype=torch.long))
    spec = small_cluster(2, per_node=2)
    base = dict(pp=2, global_batch=8, micro_batches=4)
    one = validate(Plan(**base, stages=("blocks.2.ln_1",)), g, spec).prediction
    gpipe = validate(Plan(**base, stages=("blocks.2.ln_1",), schedule="gpipe"), g, spec).prediction
    interleaved = validate(Plan(**base, stages=("blocks.1.ln_1", "blocks.2.ln_1", "blocks.3.ln_1"),
                                schedule="interleaved-1f1b"), g, spec).prediction
    assert gpipe.step_time == one.step_time and gpipe.memory["activations"] > one.memory["activations"]
    assert interleaved.step_time < one.step_time
    with pytest.raises(PlanError, match="interleaved-1f1b with pp=2 needs a multiple of 2 stages"):
        validate(Plan(**base, stages=("blocks.1.ln_1", "blocks.2.ln_1"), schedule="interleaved-1f1b"), g, spec)
    with pytest.raises(PlanError, match="a stage cannot start at 'blocks.1.attn.qkv': stages start where a block"):
        validate(Plan(**base, stages=("blocks.1.attn.qkv",)), g, spec)


def test_interleaved_time_reduces_to_1f1b():
    from hybridpar.plan import cost

    assert cost.interleaved_pipeline_time([1.0, 1.0], 4, 2) == cost.pipeline_time([1.0, 1.0], 4) == 5.0
    assert cost.interleaved_pipeline_time([0.5] * 4, 4, 2) == pytest.approx(4.5)  # bubble halved


def test_sequence_parallelism_is_priced():
    """With sequence parallelism the replicated norms, dropouts and residual adds keep 1/tp of their
    activations (each rank holds its share of the tokens); the split layers are as before."""
    from hybridpar.parallel.tensor import pair_strategies

    with torch.device("meta"):
        model = gpt(num_layers=2, num_heads=8, d_model=512, seq_len=256, vocab_size=512)
    g = graph_of(model, torch.zeros(8, 256, dtype=torch.long))
    layers = tuple(pair_strategies(g, tp=4).items())
    spec = small_cluster(4, per_node=4)
    plain = validate(Plan(tp=4, global_batch=8, layers=layers), g, spec).prediction
    sp = validate(Plan(tp=4, global_batch=8, layers=layers, sequence_parallel=True), g, spec).prediction
    assert sp.memory["activations"] < plain.memory["activations"]
    assert sp.memory["parameters"] == plain.memory["parameters"]
    assert sp.step_time <= plain.step_time


def test_checkpoint_interval_is_dalys_refinement_of_youngs():
    from hybridpar.plan.cost import checkpoint_interval

    # a 10 s save, a failure every 10 hours: Young sqrt(2 * 10 * 36000) = 848.5 s; Daly's terms by hand
    young = math.sqrt(2 * 10 * 36_000)
    ratio = 10 / 72_000
    assert checkpoint_interval(10, 36_000) == pytest.approx(young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 10)
    assert checkpoint_interval(10, 36_000) == pytest.approx(841.8, abs=0.1)
    assert checkpoint_interval(100, 40) == 40  # saving takes longer than failures allow: every mtbf
