"""Model analysis: one forward pass on the meta device gives the planner and the runtime the model's graph.

A *layer* is a leaf module (``Conv3d``, ``Linear``, ``LayerNorm``, ...) or a tensor operation called
between modules (the residual ``add``, ``scaled_dot_product_attention``, ``cat``). Views (``view``,
``transpose``, ``split``, ...) are not layers: a view of a layer's output is read as that output, with each
of its dims traced back to the output dim it holds whole blocks of (``Read.dims``), so that a split of the
output can be followed through the views (``hybridpar.ir.rules``). For each layer the trace records, for the
example batch:

- forward FLOPs (PyTorch's ``FlopCounterMode``; attention counted here as ``4·B·H·Lq·Lk·E``, since
  the counter misses the fused kernels of some backends) and the bytes the forward reads and writes;
- bytes of its output, of what autograd saves for backward (``saved_tensors_hooks``; a tensor saved
  twice counts once, parameters not at all) and of its parameters;
- its sliding windows (kernel, stride, padding, dilation per spatial dim), whence its halo widths;
- every tensor it reads (``reads``): which layer made it (or the input, a parameter, a constant), its
  shape, and where each of its dims comes from;
- whether it runs on slabs of a spatially split input, and what the spatial runtime would refuse
  (``rules.spatial_rule``, by the same rules as the runtime's check).

The graph also records the model's blocks in the order the forward calls them, what each call passes
and returns (``block_calls``: the interfaces of pipeline stages), and which parameters are one tensor under
several names or used by several layers (``shared``: tied embeddings, a module registered twice).

Nothing is allocated: parameters and activations live on the meta device (a copy: the caller's model is
never touched), with the real values of small parameter-free tensors kept beside them (``hybridpar.ir.meta``),
so that data-dependent Python in a forward takes the branch the real run takes, and CosmoFlow at 512³ or a
175B-parameter GPT analyse in seconds on a laptop.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hybridpar.errors import HybridparError, PlanError
from hybridpar.ir import meta, rules
from hybridpar.ir.calls import BlockCalls
from hybridpar.ir.graph import INPUT, BlockCall, Layer, ModelGraph
from hybridpar.ir.placements import PARTITIONED
from hybridpar.ir.trace import WHOLE_MODULES, LayerTrace, Tracer, is_leaf, module_kind
from hybridpar.ir.windows import windows_of

SPLITTABLE_TYPES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # exact types tensor parallelism splits
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def graph_of(model: nn.Module | ModelGraph, example_input, dtype: str = "float32") -> ModelGraph:
    """The layer graph of ``model`` for ``example_input`` (a tensor, or a shape: float volumes; give a
    tensor of ``torch.long`` for token ids, whose values a forward may branch on). ``dtype`` is that of the
    parameters and activations. The analysis runs on a meta copy: ``model`` is left as it is."""
    if isinstance(model, ModelGraph):
        return model
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if isinstance(example_input, torch.Tensor):
        shape, input_dtype = tuple(example_input.shape), example_input.dtype
        input_dtype = DTYPES[dtype] if input_dtype.is_floating_point else input_dtype
        return analyse(model, shape, DTYPES[dtype], input_dtype, example=example_input)
    return analyse(model, tuple(example_input), DTYPES[dtype], DTYPES[dtype])


def install_hooks(model: nn.Module, tracer: Tracer, calls: BlockCalls) -> list:
    handles = []
    paths = {id(m): p for p, m in model.named_modules()}
    inside_whole = set()
    block_names = set(calls.names)
    for path, module in model.named_modules():
        if any(path.startswith(w + ".") for w in inside_whole):
            continue
        if isinstance(module, WHOLE_MODULES):
            inside_whole.add(path)
        leaf = is_leaf(module)
        converted = leaf and rules.spatial_base(type(module)) is not None
        gathers = converted and rules.spatial_base(type(module)).__name__ in rules.GATHERING_MODULES
        block = path in block_names

        def pre(m, args, kwargs, leaf=leaf, converted=converted, block=block):
            path = paths[id(m)]
            if block:
                calls.enter(path, args, kwargs)
            tracer.module_stack.append(path)
            if leaf:
                if not tracer.inside_leaf:
                    kind = module_kind(m) or "other"
                    calls_so_far = tracer.counts[path] = tracer.counts.get(path, -1) + 1
                    name = path if calls_so_far == 0 else f"{path}#{calls_so_far}"  # a module called again
                    tracer.module_records[id(m)] = tracer.begin(name, kind, type(m).__name__, args, kwargs, m,
                                                                path=path)
                tracer.inside_leaf += 1
                tracer.converted += converted

        def post(m, args, kwargs, out, leaf=leaf, converted=converted, gathers=gathers, block=block):
            tracer.module_stack.pop()
            if leaf:
                tracer.inside_leaf -= 1
                tracer.converted -= converted
                if converted and args and isinstance(args[0], torch.Tensor):
                    tracer.refusals.extend(tracer.slabs.module(m, args[0], out, paths[id(m)]))
                if not tracer.inside_leaf:
                    tracer.end(tracer.module_records.pop(id(m)), out)
            with tracer.own():
                tracer.spread(args, kwargs, out)
            if block:
                calls.leave(paths[id(m)], out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles


def input_dtype_of(model: nn.Module) -> torch.dtype:
    """The input a model takes by default: token ids (``torch.long``) if its first module is an
    ``nn.Embedding``, else a float volume or sequence of the model's floating dtype."""
    first = next((m for m in model.modules() if not list(m.children())), None)
    if isinstance(first, nn.Embedding):
        return torch.long
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return param.dtype if param is not None else torch.float32


def analyse(model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
            input_dtype: torch.dtype | None = None, example: torch.Tensor | None = None) -> ModelGraph:
    """The layer graph of ``model`` for an input of ``input_shape`` (batch first), traced on the meta
    device in training mode, on a copy of the model. ``input_dtype`` defaults to ``dtype`` (give
    ``torch.long`` for token ids); ``example`` (a real tensor of that shape) gives the input's values to a
    forward that branches on them (else zeros)."""
    if not input_shape or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in input_shape):
        raise PlanError(f"input shape {input_shape}: give positive sizes, batch first, e.g. (1, 4, 128, 128, 128)")
    input_dtype = input_dtype or dtype
    values = meta.Values()
    with values:
        copy = meta.meta_copy(model, values, dtype)
        copy.train()
        x = torch.zeros(input_shape, dtype=input_dtype, device="meta")
        if math.prod(input_shape) <= meta.VALUE_LIMIT:
            real = example if example is not None and not example.is_meta else \
                torch.zeros(input_shape, dtype=input_dtype)
            values.set(x, real.detach().to("cpu", input_dtype))
        volume = input_dtype.is_floating_point and len(input_shape) >= 3
        with FlopCounterMode(display=False) as counter:
            tracer = Tracer(copy, x, counter, volume)
            calls = BlockCalls(tracer, [name for name, _ in blocks(copy)])
            handles = install_hooks(copy, tracer, calls)
            try:
                with saved_tensors_hooks(tracer.pack, lambda t: t), tracer:
                    out = copy(x)
            except HybridparError:
                raise
            except meta.DataDependentError as err:
                where = tracer.module_stack[-1] if tracer.module_stack else "<root>"
                raise PlanError(f"the forward of {where!r} branches on a value computed from the weights ({err}); "
                                "hybridpar analyses a model without its weights: compute that branch from the "
                                "input or the configuration instead") from None
            except Exception as err:  # a model that does not run on this input: say which input
                raise PlanError(f"the model does not run on an input of shape {tuple(input_shape)} and dtype "
                                f"{str(input_dtype).removeprefix('torch.')} ({type(err).__name__}: {err}); give the "
                                "shape (and dtype: --input-dtype, or an example tensor) the model's forward "
                                "expects, batch first") from None
            finally:
                for h in handles:
                    h.remove()
    return _graph(copy, tracer, calls, tuple(input_shape), x, out)


def _graph(model: nn.Module, tracer: Tracer, calls: BlockCalls, input_shape, x, out) -> ModelGraph:
    layers = [_layer(r) for r in tracer.records]
    shared = _shared(model, layers)
    names = {name for group in shared for name in group}
    runs: dict[str, int] = {}
    for layer in layers:
        if layer.path:
            runs[layer.path] = runs.get(layer.path, 0) + 1
    layers = [dataclasses.replace(layer, shared=bool(names & set(layer.params)), repeated=runs.get(layer.path, 0) > 1)
              for layer in layers]
    consumers = [[] for _ in layers]
    for layer in layers:
        for p in layer.inputs:
            if p != INPUT:
                consumers[p].append(layer.index)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    order = calls.order + [n for n in calls.names if n not in calls.order]
    index = {name: i for i, name in enumerate(order)}
    block_calls = tuple(BlockCall(index[c.block], c.args, c.output, c.layers, c.returns, c.leaves)
                        for c in calls.calls if c.output is not None)
    return ModelGraph(tuple(layers), input_shape, x.numel() * x.element_size(), param_bytes, params,
                      tuple(tuple(c) for c in consumers), type(model).__name__, tuple(order), block_calls,
                      shared, str(x.dtype).removeprefix("torch."),
                      tuple(dict.fromkeys(tracer.refusals)),
                      outputs=tuple(dict.fromkeys(tracer.info[id(t)][0] for t in tracer._tensors(out)
                                                  if id(t) in tracer.info)),
                      unused=_unused(model, out),
                      output_values=tuple(tracer.values[id(t)] for t in tracer._tensors(out) if id(t) in tracer.values),
                      state=tuple(model.state_dict()), output=_output_meta(out, tracer))


def _output_meta(out, tracer: Tracer) -> tuple:
    """``(shape, dtype, requires_grad, partitioned, computed from the input)`` of the tensor a loss reads
    (``model_output``), or ``()``."""
    first = model_output(out, strict=False)
    if first is None:
        return ()
    return (tuple(first.shape), str(first.dtype).removeprefix("torch."), first.requires_grad,
            tracer.slabs.status(first) == PARTITIONED, id(first) in tracer.from_input)


def _shared(model: nn.Module, layers: list[Layer]) -> tuple[tuple[str, ...], ...]:
    """Names of each parameter registered under several names or used by several layers."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tensor = {name: key for key, group in names.items() for name in group}
    users: dict[int, int] = {}
    for layer in layers:
        for key in {tensor[name] for name in layer.params if name in tensor}:
            users[key] = users.get(key, 0) + 1
    return tuple(tuple(group) for key, group in names.items() if len(group) > 1 or users.get(key, 0) > 1)


def _unused(model: nn.Module, out) -> tuple[str, ...]:
    """Parameters (first names) that get no gradient from the output a loss reads (``model_output``: the
    forward's first tensor): a module the forward never calls, or one whose output it computes and drops (an
    auxiliary head switched off, a branch left unused). Found by walking the autograd graph of that output, so
    that every rank knows before the first step which gradients none of them will have."""
    reached: set[int] = set()
    first = model_output(out, strict=False)
    stack = [first.grad_fn] if first is not None and first.grad_fn is not None else []
    seen: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(f for f, _ in fn.next_functions)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            groups.setdefault(id(p), []).append(name)
    return tuple(names[0] for key, names in groups.items() if key not in reached)


def model_output(output, strict: bool = True) -> torch.Tensor | None:
    """The tensor a model's output holds first, which the loss reads: the output itself, or the logits of a Hugging
    Face ``ModelOutput`` (its first tensor), or the first tensor of a tuple or dict. ``strict``: an output with no
    tensor in it is a ``PlanError`` (else ``None``)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        if strict:
            raise PlanError(f"the model returned {type(output).__name__} with no tensor in it; return the output "
                            "tensor")
        return None
    return tensors[0]


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks, ``(name, module)`` in the order they are registered: its children, with a container
    (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) expanded into its entries, and a module that holds a
    trunk (an ``nn.ModuleList`` reached through modules that are not containers: a Hugging Face ``model.model``,
    an encoder, a decoder, the model a wrapper holds) expanded into its own blocks, at any depth; the entries of a
    container are blocks as they are (a decoder layer that holds its experts stays one block, an ``nn.Sequential``
    entry too), but for lists and dicts, which have no forward of their own. A module
    registered twice counts once, under its first name (as ``named_modules`` names it). A model pipelines if its
    forward calls these one after another (``ModelGraph.blocks`` has the order of the calls); what is registered
    on an expanded module (a wrapper's scale, a ViT's class token) is held by every stage (``rules.copies``)."""
    out, seen = [], set()
    for name, child in _block_candidates(model, ""):
        if id(child) not in seen:
            seen.add(id(child))
            out.append((name, child))
    return out


def _block_candidates(module: nn.Module, prefix: str, entries: bool = False) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or (isinstance(child, nn.Sequential) and not entries):
            out.extend(_block_candidates(child, path + ".", entries=True))
        elif not entries and _holds_trunk(child):
            out.extend(_block_candidates(child, path + "."))
        else:
            out.append((path, child))
    return out


def _holds_trunk(module: nn.Module) -> bool:
    """Whether ``module`` holds an ``nn.ModuleList`` through modules that are not containers."""
    return any(type(c) is nn.ModuleList or (not isinstance(c, CONTAINERS) and _holds_trunk(c))
               for c in module.children())


def _layer(r: LayerTrace) -> Layer:
    module = r.module
    kind = r.kind
    params = list(module.parameters()) if module is not None else []
    if kind == "other" and module is not None and _elementwise(module, r.functions, params):
        kind = "pointwise"
    names = r.params
    if module is not None:
        names = tuple(f"{r.path}.{n}" for n, _ in module.named_parameters())
    extra = _module_features(module, len(r.out) - 2) if module is not None else {}
    if kind == "attention" and r.heads:
        extra.update(heads=r.heads, kv_heads=r.kv_heads)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return Layer(
        index=r.index, name=r.name, kind=kind, op=r.op, inputs=r.inputs,
        in_shape=r.in_shapes[0] if r.in_shapes else (), out_shape=r.out, dtype_bytes=r.dtype_bytes,
        flops=float(r.flops), bytes_moved=float(r.in_bytes + r.out_bytes + param_bytes),
        out_bytes=r.out_bytes, saved_bytes=r.saved, param_bytes=param_bytes,
        num_params=sum(p.numel() for p in params), spatial_in=r.spatial_in,
        has_weight=any(p.requires_grad for p in params), reads=r.reads, args=r.args, params=names,
        exact=module is not None and type(module) in SPLITTABLE_TYPES, outputs=r.outputs,
        path=r.path, inplace=_inplace(r), **extra,
    )


def _inplace(r: LayerTrace) -> bool:
    """Whether the layer writes into a tensor it reads: an in-place function (``relu_``, ``x += y``), a call with
    ``inplace=True``, a module built so (``nn.ReLU(inplace=True)``)."""
    return (any(rules.is_inplace(f) for f in r.functions | {r.op}) or dict(r.args).get("inplace") is True
            or getattr(r.module, "inplace", False) is True)


def _elementwise(module: nn.Module, functions: set, params: list) -> bool:
    """A module that works value by value (an activation, dropout, identity): every function it calls is
    pointwise, and any parameter it has is one value (PReLU's). Softmax, GLU or a per-channel PReLU are not."""
    if isinstance(module, (nn.Dropout, nn.Identity)):
        return True
    return bool(functions) and functions <= rules.POINTWISE and all(p.numel() == 1 for p in params)


def _module_features(module: nn.Module, num_spatial: int) -> dict:
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return {"windows": windows_of(module, num_spatial), "boundary": module.padding_mode,
                "channels": (module.in_channels, module.out_channels), "groups": module.groups}
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return {"channels": (module.in_channels, module.out_channels), "groups": module.groups}
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return {"windows": windows_of(module, num_spatial)}
    if isinstance(module, nn.Linear):
        return {"channels": (module.in_features, module.out_features)}
    if isinstance(module, nn.Embedding):
        return {"channels": (module.num_embeddings, module.embedding_dim)}
    if isinstance(module, nn.MultiheadAttention):
        return {"heads": module.num_heads, "kv_heads": module.num_heads,
                "channels": (module.embed_dim, module.embed_dim)}
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return {"channels": (module.num_features, module.num_features)}
    return {}


__all__ = ["DTYPES", "analyse", "blocks", "graph_of", "input_dtype_of", "model_output"]
