"""The rules of what runs exactly, in one place: the analysis, the search, ``validate``, ``check_plan`` and the
runtime all read them (pure Python: no torch). One module per kind
of rule (views, slabs, splits, regions, cuts); ``hybridpar.plan.rules.X`` names each rule.

- **Views** (``alias_dims``): where a view, reshape, transpose or index moves each dim of a tensor, so that a
  split of one layer's output (a column layer's features, the heads they hold) can be followed to every
  layer that reads it.
- **Spatial** (``spatial_refusals``, ``SPATIAL_MODULES``): which modules the spatial runtime converts, and which
  functions are exact on slabs of a split volume (everything else mixes positions and is refused).
- **Tensor parallelism** (``tp_*``, ``check_assignment``, ``regions``): which layers split column-, row- or
  shard-wise, how a split travels through views to its readers, which layout changes the runtime makes
  (a column layer gathers its output, a row layer slices its input), what shares a parameter.
- **Pipelines** (``stage_interfaces``): which tensors cross a stage boundary, and where a cut is impossible.
"""

from hybridpar.plan.rules.cuts import (
    StageInterface,
    checkpointed_stages_refusal,
    crossing_sources,
    passes,
    stage_cut_refusal,
    stage_interfaces,
)
from hybridpar.plan.rules.regions import Region, regions, standalone
from hybridpar.plan.rules.slabs import (
    ATTENTION,
    CONCAT,
    DEFAULT_HINT,
    DROPOUT,
    GATHERING_MODULES,
    HINTS,
    LOCAL_ONLY,
    MIXING,
    POINTWISE,
    SOFTMAX,
    SPATIAL_MODULES,
    first_refusal,
    replicated_refusal,
    spatial_base,
    spatial_refusals,
)
from hybridpar.plan.rules.splits import (
    FIELDS,
    LAYOUTS,
    SHARD_KINDS,
    SHARD_OPS,
    SPLIT,
    SPLITTABLE,
    TOKEN_WISE,
    TP_STRATEGIES,
    WHOLE,
    check_assignment,
    check_shared,
    gathers,
    idle_tp_refusal,
    splits_dim,
    tp_refusal,
    weight_split,
)
from hybridpar.plan.rules.views import ALIASES, RESHAPES, SAME_DIMS, SHAPE_ONLY, TRANSPOSES, alias_dims

__all__ = ["ALIASES", "ATTENTION", "CONCAT", "DEFAULT_HINT", "DROPOUT", "FIELDS", "GATHERING_MODULES", "HINTS",
           "LAYOUTS", "LOCAL_ONLY", "MIXING", "POINTWISE", "RESHAPES", "Region", "SAME_DIMS", "SHAPE_ONLY",
           "SHARD_KINDS", "SHARD_OPS", "SOFTMAX", "SPATIAL_MODULES", "SPLIT", "SPLITTABLE", "StageInterface",
           "TOKEN_WISE", "TP_STRATEGIES", "TRANSPOSES", "WHOLE", "alias_dims", "check_assignment", "check_shared",
           "checkpointed_stages_refusal", "crossing_sources", "first_refusal", "gathers", "idle_tp_refusal", "passes",
           "regions", "replicated_refusal", "spatial_base", "spatial_refusals", "splits_dim", "stage_cut_refusal",
           "stage_interfaces", "standalone", "tp_refusal", "weight_split"]
