"""Pipeline parallelism on PyTorch's ``torch.distributed.pipelining``: stages cut between a model's blocks,
built by hand as ``PipelineStage``s, run by its GPipe, 1F1B or interleaved 1F1B schedule.

A model's *blocks* are its top-level children, with an ``nn.Sequential`` or ``nn.ModuleList`` expanded into
its entries and a trunk that holds one (a Hugging Face ``model.model``) expanded into its own blocks
(``hybridpar.ir.analysis.blocks``; a GPT: ``embed``, ``blocks.0`` ... ``ln_f``, ``lm_head``; a Llama:
``model.embed_tokens``, ``model.rotary_emb``, ``model.layers.0`` ..., ``model.norm``, ``lm_head``). A stage
holds a run of them and runs **the model's own forward** on a copy of the model in which every block of
another stage is skipped: it stands in with zeros of the shapes the block returns (``StandIn``; in a model
that is a plain chain of blocks, ``ModelGraph.is_chain``, it passes its input on, and the stage's input is
the previous stage's output, slabs of a spatially split volume included). What a held
block is passed that the stage cannot compute (the previous stage's activation, and whatever else crosses:
rotary tables, masks; ``rules.stage_interfaces``) is replaced by the values the previous stage sent; what
later stages need is caught where the model passes it to a block this stage skips. Keyword inputs and
structured outputs (a ``CausalLMOutputWithPast``) therefore need nothing of the model: the last stage returns
the first tensor of the model's output. ``rules.stage_cut_refusal`` refuses the cuts this cannot make exact
(a block that returns something else than tensors, two activations that need gradients crossing, blocks not
called in order), before anything is built; the planner cuts only where it allows.

With ``S`` stages on ``pp`` ranks, rank ``r`` of the pp axis holds stage ``r`` (GPipe, 1F1B: ``S = pp``) or
stages ``r, r + pp, r + 2 pp, ...`` (interleaved 1F1B: ``S`` a multiple of ``pp``, at least ``2 pp``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.errors import PlanError
from hybridpar.ir import meta, rules
from hybridpar.ir.analysis import blocks, model_output
from hybridpar.ir.calls import structure
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.rules import some
from hybridpar.ir.types import SCHEDULES as PLAN_SCHEDULES

SCHEDULES = dict(zip(PLAN_SCHEDULES, (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)))
PLAIN = (int, float, bool, str, type(None))  # what a stand-in's block may be passed besides tensors for a meta run


class StandIn(nn.Module):
    """A block of another stage: holds no parameter, and returns zeros of the shapes the block returns (the
    model's own code between blocks runs on them; nothing the stage computes depends on them). It also
    catches, among what the model passes it, the values the next stages need. What the model's code reads of
    the block itself (its configuration, a submodule's weight dtype: Hugging Face's ViT asks its embedding's) it
    reads off a copy of the block on the meta device, which holds no memory and is not one of the stage's
    modules."""

    stands_in = True

    def __init__(self, name: str, run: StageRun, block: nn.Module):
        super().__init__()
        self.name, self.run = name, run
        object.__setattr__(self, "_block", block)
        self._shapes: dict[tuple, tuple] = {}

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)

    def forward(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        if self.run.graph.is_chain:  # the model is its blocks in a chain: pass the activation on, as the block
            # returns it (a dict, a tuple: the one tensor in it)
            activation = next(t for t in leaves if isinstance(t, torch.Tensor))
            return like_structure(self.run.calls[self.name][0].output, self.run.device, activation)
        call = self.run.next_call(self.name)
        for arg in call.args:
            if arg.value in self.run.wanted and arg.value not in self.run.caught:
                self.run.caught[arg.value] = leaves[arg.leaf]
        return like_structure(self._returns(leaves, spec, call.output), self.run.device)

    def _returns(self, leaves: list, spec, recorded: tuple) -> tuple:
        """The structure of what the block returns for these arguments: its meta copy run on them (shapes the
        model's code made from the micro-batch's, a mask of ``ones(batch, seq)``, come out as the real block's
        would), once per kind of arguments; where that needs values it does not have, or the block is passed an
        object it might change (a cache), the analysis' record."""
        if not all(isinstance(t, (torch.Tensor, *PLAIN)) for t in leaves):
            return recorded
        key = (spec, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves))
        if key not in self._shapes:
            block = object.__getattribute__(self, "_block")
            metas = [t.detach().to("meta") if isinstance(t, torch.Tensor) else t for t in leaves]
            try:
                args, kwargs = tree_unflatten(metas, spec)
                with torch.no_grad():
                    self._shapes[key] = structure(block(*args, **kwargs))
            except Exception:  # a block that branches on the values of its arguments
                self._shapes[key] = recorded
        return self._shapes[key]


def like_structure(structure: tuple, device: torch.device, tensor: torch.Tensor | None = None):
    """What ``structure`` (``hybridpar.ir.calls.structure``) describes, its tensors zeros (or ``tensor``, in a
    structure that holds one: a chain's activation passed on)."""
    kind, rest = structure[0], structure[1:]
    if kind == "tensor":
        shape, dtype = rest[:2]
        return tensor if tensor is not None else torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    if kind in ("tuple", "list"):
        items = [like_structure(s, device, tensor) for s in rest[0]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: like_structure(v, device, tensor) for k, v in rest[0]}
    return rest[0]


class StageRun:
    """What one stage module does around the model's forward: the values it received, those it must send."""

    def __init__(self, graph: ModelGraph, held: list[str], interface: rules.StageInterface, last: bool,
                 device: torch.device):
        self.graph, self.interface, self.last, self.device = graph, interface, last, device
        self.calls: dict[str, list] = {}
        for call in graph.block_calls:
            self.calls.setdefault(graph.blocks[call.block], []).append(call)
        self.held = set(held)
        self.wanted = set(interface.sends) - set(interface.receives)
        self.received: dict[int, torch.Tensor] = {}
        self.caught: dict[int, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        # what stood in for a value, and the value that replaced it: activation checkpointing calls a block again
        # in backward, with what it was first passed, after later micro-batches' forwards
        self.replaced = WeakIdKeyDictionary()

    def next_call(self, name: str):
        """The analysis' record of this call of block ``name``."""
        calls = self.calls[name]
        if len(calls) == 1:
            return calls[0]
        k = self.count.get(name, 0)
        self.count[name] = k + 1
        if k >= len(calls):
            raise PlanError(f"block {name!r} was called {k + 1} times in a stage's forward, {len(calls)} times in "
                            "the model's analysis: the forward must call its blocks alike at every step")
        return calls[k]

    def before(self, module, args, kwargs):
        """The stage module's forward pre-hook: ``args`` are what the previous stage sent (the first stage: the
        model input); the model then runs on an input of zeros."""
        self.count, self.caught = {}, {}
        if not self.interface.receives:
            return None
        self.received = dict(zip(self.interface.receives, args))
        dtype = getattr(torch, self.graph.input_dtype)
        return (torch.zeros(self.graph.input_shape, dtype=dtype, device=self.device),), {}

    def substitute(self, module, args, kwargs):
        """A held block's forward pre-hook: what it is passed from earlier stages, as they sent it (and, called
        again by activation checkpointing, what replaced those stand-ins the first time)."""
        leaves, spec = tree_flatten((args, kwargs))
        if any(isinstance(leaf, torch.Tensor) and leaf in self.replaced for leaf in leaves):
            return tree_unflatten([self.replaced.get(leaf, leaf) if isinstance(leaf, torch.Tensor) else leaf
                                   for leaf in leaves], spec)
        call = self.next_call(module.hp_block)
        changed = False
        for arg in call.args:
            if arg.value in self.received:
                value, stand_in = self.received[arg.value], leaves[arg.leaf]
                if not isinstance(stand_in, torch.Tensor) or stand_in.shape != value.shape:
                    raise PlanError(f"block {module.hp_block!r} was passed {type(stand_in).__name__} where the "
                                    f"analysis saw a tensor of shape {tuple(value.shape)}: the forward must pass its "
                                    "blocks alike at every step")
                self.replaced[stand_in] = value
                leaves[arg.leaf] = value
                changed = True
        return tree_unflatten(leaves, spec) if changed else None

    def after(self, module, args, kwargs, output):
        """The stage module's forward hook: the last stage returns the model's output tensor, the others what the
        next stage needs."""
        if self.last:
            return model_output(output)
        values = {**self.received, **self.caught}
        missing = [v for v in self.interface.sends if v not in values]
        if missing:
            raise PlanError(f"a pipeline stage did not see {len(missing)} of the values it must send; the model's "
                            "forward passes its blocks other tensors than in its analysis")
        sent = tuple(values[v].contiguous() for v in self.interface.sends)  # sent as laid out for the receiver
        return sent[0] if len(sent) == 1 else sent


def stage_module(model: nn.Module, graph: ModelGraph, groups: list[list[str]], stage: int,
                 device: torch.device) -> tuple[nn.Module, StageRun]:
    """A copy of ``model`` for stage ``stage`` of ``groups`` (the block names of each stage), in which the blocks
    of other stages stand in (``StandIn``; their parameters are not copied); ``connect`` it to its ``StageRun``
    once its own blocks are split. ``graph`` is the model's graph for one micro-batch."""
    keep = groups[stage]
    run = StageRun(graph, keep, rules.stage_interfaces(graph, groups)[stage], stage == len(groups) - 1, device)
    stand_ins = {id(module): StandIn(name, run, meta.meta_copy(module)) for name, module in blocks(model)
                 if name not in keep}
    return copy.deepcopy(model, memo=stand_ins), run


def connect(module: nn.Module, run: StageRun) -> None:
    """The hooks through which a stage module takes what the previous stage sent and returns what the next one
    needs (``StageRun``): on the module, and on each block it holds. A chain of blocks (``ModelGraph.is_chain``)
    needs none: its stage takes the previous stage's output as its input, the skipped blocks pass it on."""
    if run.graph.is_chain:  # what the model returns (a dict, a ModelOutput) is the activation in it
        module.register_forward_hook(lambda m, args, output: model_output(output).contiguous())
        return
    module.register_forward_pre_hook(run.before, with_kwargs=True)
    module.register_forward_hook(run.after, with_kwargs=True)
    for name, block in blocks(module):
        if name in run.held:
            block.hp_block = name
            # first: a held block that is itself split (a head cut off at lm_head) converts its input to a DTensor
            # in a hook of its own, which must see what the previous stage sent
            block.register_forward_pre_hook(run.substitute, with_kwargs=True, prepend=True)


def check_stages(model: nn.Module, graph: ModelGraph, groups: list[list[str]]) -> ModelGraph:
    """Run the stages' modules one after another on the meta device, each on what the one before sends, as
    they will run, so that a forward the stages cannot run (model code that needs a value a skipped block
    stands in for) fails here, before any communication, naming the stage. ``graph``: the model's for one
    micro-batch; returned with the shapes the stages were found to send."""
    sent: dict[int, tuple[int, ...]] = {}
    interfaces = rules.stage_interfaces(graph, groups)
    values = meta.Values()
    with values:
        copied = meta.meta_copy(model, values)
        x = torch.zeros(graph.input_shape, dtype=getattr(torch, graph.input_dtype), device="meta")
        values.set(x, torch.zeros(graph.input_shape, dtype=x.dtype))
        inputs = (x,)
        for stage in range(len(groups)):
            module, run = stage_module(copied, graph, groups, stage, torch.device("meta"))
            connect(module, run)
            try:
                out = module(*inputs)
            except Exception as err:  # the model's own code, on what a stage has
                held, why = some([repr(name) for name in groups[stage]]), " ".join(str(err).split())
                raise PlanError(f"pipeline stage {stage} (blocks {held}) does not run on its own "
                                f"({type(err).__name__}: {why}); cut the model at other blocks") from None
            inputs = out if isinstance(out, tuple) else (out,)
            sent.update((v, tuple(t.shape)) for v, t in zip(interfaces[stage].sends, inputs))
    return graph.with_shapes(sent)


def stages_of_rank(num_stages: int, pp: int, rank: int) -> list[int]:
    """The stage indices pp-rank ``rank`` holds (loop-style: ``rank, rank + pp, ...``)."""
    return list(range(rank, num_stages, pp))


def build_schedule(modules: dict[int, nn.Module], graph: ModelGraph, groups: list[list[str]], schedule: str,
                   micro_batches: int, loss_fn, group, device: torch.device, local):
    """The plan's ``schedule`` over this rank's stage ``modules`` (``{stage index: module}``). Each stage is told what
    it takes and returns (``rules.stage_io`` for one micro-batch, ``graph``; ``local(shape, made by a layer,
    partitioned)``: what this rank holds of a tensor of that global shape), so that the stages exchange no metadata
    and run no forward to find it, and the loss is computed on the real micro-batches only."""
    io = rules.stage_io(graph, groups)

    def examples(metas):
        return tuple(torch.empty(local(shape, made, part), dtype=getattr(torch, dtype), device=device)
                     .requires_grad_(grad) for shape, dtype, grad, made, part in metas)

    stages = [PipelineStage(module, index, len(groups), device, input_args=examples(io[index][0]),
                            output_args=examples(io[index][1]), group=group) for index, module in modules.items()]
    if schedule == "interleaved-1f1b":
        return SCHEDULES[schedule](stages, micro_batches, loss_fn=loss_fn)
    return SCHEDULES[schedule](stages[0], micro_batches, loss_fn=loss_fn)
