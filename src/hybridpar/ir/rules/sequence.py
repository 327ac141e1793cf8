"""Sequence parallelism (Korthikanti et al. 2022): which replicated layers may run on sequence shards, and how the
split layers around them gather and scatter the sequence (``sequence_splits``)."""

from __future__ import annotations

from dataclasses import replace

from hybridpar.errors import PlanError
from hybridpar.ir.rules.splits import LAYOUTS, TOKEN_WISE, WHOLE, Split
from hybridpar.ir.sources import INPUT


def sequence_splits(graph, wanted: list[str], splits: dict[str, Split]) -> dict[str, Split]:
    """Sequence parallelism (Korthikanti et al. 2022): every tensor that the plan keeps whole over tp is
    split along its sequence dim (``-2`` of ``(B, T, d)``) instead; column layers gather the sequence
    (all-gather), row layers and embeddings scatter their summed output along it (reduce-scatter), norms
    run as DTensor ``SequenceParallel``. So every replicated layer must work token by token, the model input
    may feed only row-split embeddings, and the model's output must come gathered from a column layer."""
    out = dict(splits)
    for layer, strategy in zip(graph.layers, wanted):
        readers = graph.consumers[layer.index]
        if strategy == "replicate":
            if layer.kind not in TOKEN_WISE or not readers:
                why = "it is the model's output" if not readers else f"it is not token-wise ({layer.kind})"
                raise PlanError(f"layer {layer.name!r} ({layer.op}) is replicated, so sequence parallelism would "
                                f"run it on a sequence shard, but {why}; split it, or turn sequence_parallel off")
            if layer.is_module and layer.num_params:
                out[layer.name] = Split("replicate", kind="norm", input_seq=len(layer.in_shape) - 2)
            continue
        split = out.get(layer.name)
        if strategy == "shard" or split is None:
            continue  # heads, activations: feature-split tensors, as without sequence parallelism
        if INPUT in layer.inputs and not (split.kind == "embedding" and strategy == "row"):
            raise PlanError(f"layer {layer.name!r} reads the model input; with sequence_parallel only "
                            "embeddings split by rows may (their output leaves split along the sequence)")
        if split.kind not in ("linear", "embedding") or (split.slice_input and split.kind == "linear"):
            raise PlanError(f"layer {layer.name!r} ({layer.op}, {strategy}): sequence parallelism splits Linear "
                            "and Embedding layers fed split features; turn sequence_parallel off")
        fields = {}
        if strategy == "column" and INPUT not in layer.inputs and layer.inputs:
            fields["input_seq"] = len(layer.in_shape) - 2
        if LAYOUTS[strategy][1] == WHOLE or split.gather_output:
            fields["output_seq"] = len(layer.out_shape) - 2 if readers else None
        out[layer.name] = replace(split, **fields)
    return out
