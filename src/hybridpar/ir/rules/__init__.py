"""The rules of what runs exactly, in one place: the analysis, the search, ``validate``, ``check_plan`` and the
runtime all read them (pure Python: no torch). One module per kind
of rule (views, slabs, splits, regions, cuts); ``hybridpar.ir.rules.X`` names each rule.

- **Views** (``alias_dims``): where a view, reshape, transpose or index moves each dim of a tensor, so that a
  split of one layer's output (a column layer's features, the heads they hold) can be followed to every
  layer that reads it.
- **Spatial** (``spatial_rule``, ``SPATIAL_MODULES``): which modules the spatial runtime converts, and which
  functions are exact on slabs of a split volume (everything else mixes positions and is refused).
- **Tensor parallelism** (``tp_*``, ``check_assignment``, ``regions``): which layers split column-, row- or
  shard-wise, how a split travels through views to its readers, which layout changes the runtime makes
  (a column layer gathers its output, a row layer slices its input), what shares a parameter.
- **Pipelines** (``stage_interfaces``, ``stage_starts``, ``stage_groups``): which tensors cross a stage boundary,
  where a cut is impossible, how many stages a schedule runs and the micro-batches it takes.
- **Grids** (``check_grid``): whether every layer runs exactly on the slabs of a spatial grid.
"""

from hybridpar.ir.rules.cuts import (
    StageInterface,
    checkpointed_stages_refusal,
    crossing_sources,
    passes,
    stage_cut_refusal,
    stage_interfaces,
    stage_io,
)
from hybridpar.ir.rules.grid import check_grid
from hybridpar.ir.rules.regions import Region, regions, standalone
from hybridpar.ir.rules.sequence import sequence_splits
from hybridpar.ir.rules.slabs import (
    ATTENTION,
    CONCAT,
    DEFAULT_HINT,
    DROPOUT,
    GATHERING_MODULES,
    HINTS,
    LOCAL_ONLY,
    MIXING,
    POINTWISE,
    POSITION_WISE_MODULES,
    SOFTMAX,
    SPATIAL_MODULES,
    first_refusal,
    replicated_refusal,
    spatial_base,
    spatial_rule,
)
from hybridpar.ir.rules.splits import (
    FIELDS,
    LAYOUTS,
    SHARD_KINDS,
    SHARD_OPS,
    SPLIT,
    SPLITTABLE,
    TOKEN_WISE,
    TP_STRATEGIES,
    WHOLE,
    Split,
    check_assignment,
    check_shared,
    gathers,
    idle_tp_refusal,
    splits_dim,
    tp_refusal,
    weight_split,
)
from hybridpar.ir.rules.stages import (
    check_micro_batches,
    check_stage_count,
    holding_stages,
    legal_starts,
    own_units,
    pipeline_norm_refusal,
    some,
    stage_groups,
    stage_starts,
)
from hybridpar.ir.rules.views import (
    ALIASES,
    RESHAPES,
    SAME_DIMS,
    SHAPE_ONLY,
    TRANSPOSES,
    alias_dims,
    is_inplace,
    local_view_shape,
    view_sizes,
)

__all__ = ["ALIASES", "ATTENTION", "CONCAT", "DEFAULT_HINT", "DROPOUT", "FIELDS", "GATHERING_MODULES", "HINTS",
           "LAYOUTS", "LOCAL_ONLY", "MIXING", "POINTWISE", "POSITION_WISE_MODULES", "RESHAPES", "Region",
           "SAME_DIMS", "SHAPE_ONLY", "SHARD_KINDS", "SHARD_OPS", "SOFTMAX", "SPATIAL_MODULES", "SPLIT",
           "SPLITTABLE", "Split", "StageInterface", "TOKEN_WISE", "TP_STRATEGIES", "TRANSPOSES", "WHOLE",
           "alias_dims", "check_assignment", "check_grid", "check_micro_batches", "check_shared",
           "check_stage_count", "checkpointed_stages_refusal", "crossing_sources", "first_refusal", "gathers",
           "holding_stages", "idle_tp_refusal", "is_inplace", "legal_starts", "local_view_shape", "own_units", "passes",
           "pipeline_norm_refusal", "regions", "replicated_refusal", "sequence_splits", "some", "spatial_base",
           "spatial_rule", "splits_dim", "stage_cut_refusal", "stage_groups", "stage_interfaces", "stage_io",
           "stage_starts", "standalone", "tp_refusal", "view_sizes", "weight_split"]
