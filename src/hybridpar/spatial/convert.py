"""``parallelize``: convert a model in place for spatial parallelism, and the context that runs it.

On each forward the root module learns the global input shape from every rank's slab shape (one
small all-gather), and the first time it sees that shape it traces the model on the meta device:
every converted layer records its global input and output shapes and plans its halos, and every
other torch function on a partitioned tensor is checked (``checks.Checker``). A mistake therefore
raises the same ``ValueError`` on every rank, before any halo is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from hybridpar.errors import GeometryError, MeshError, UnsupportedModuleError
from hybridpar.geometry import Grid
from hybridpar.ir import meta, rules
from hybridpar.mesh import flat_group
from hybridpar.spatial import checks
from hybridpar.spatial.base import SpatialLayer
from hybridpar.spatial.checks import PARTITIONED, REPLICATED
from hybridpar.spatial.collectives import gather_slabs
from hybridpar.spatial.halo import ExchangeStats, SpatialComm
from hybridpar.spatial.layers import LAYERS, Geometry

_MAX_DIMS = 8


@dataclass(frozen=True)
class LayerRecord:
    """What one call of a converted layer sees, for one global input shape."""

    status: str | None
    global_in: tuple[int, ...]
    local_in: tuple[int, ...]
    geo: Geometry


@dataclass
class Trace:
    records: dict[tuple[str, int], LayerRecord] = field(default_factory=dict)


class SpatialContext:
    """Shared by the converted layers of one model: the group, the grid and the traced geometry."""

    def __init__(self, module: nn.Module, comm: SpatialComm, norm_group: dist.ProcessGroup, overlap: bool | None):
        self.values = meta.Values()  # of the twin's small buffers (a batch norm's step counter) and inputs
        self.twin = meta.meta_copy(module, self.values)  # the model on the meta device: the trace touches no weight
        self.overlap = overlap
        self.comm = comm
        self.grid = comm.grid
        self.coords = comm.coords
        self.norm_group = norm_group
        self.paths: dict[int, str] = {}
        self.traces: dict[tuple, Trace] = {}
        self.current: Trace | None = None
        self.state: checks.TraceState | None = None
        self.calls: dict[str, int] = {}
        self.model_input: torch.Tensor | None = None
        self.reads_model_input = False

    def where(self, module: nn.Module) -> str:
        path = self.paths[id(module)] or "<root>"
        return f"layer '{path}' ({type(module).__bases__[-1].__name__})"

    def use_overlap(self, x: torch.Tensor, plan) -> bool:
        """Overlap a conv's halo exchange with its slab's conv? ``None`` (auto): on GPUs. On CPUs nothing
        runs while the halo travels and the thin border convs are slow (docs/benchmarks.md)."""
        return x.is_cuda if self.overlap is None else self.overlap

    def local_shape(self, shape: tuple[int, ...], placement=None) -> tuple[int, ...]:
        """This rank's part of a tensor of global ``shape`` split in slabs as ``placement`` says (the dim of each
        spatial axis; by default the volume's own, dims 2 and on)."""
        if self.grid.size == 1:
            return tuple(shape)
        placement = placement or tuple(range(2, len(shape)))
        out = list(shape)
        for axis, d in enumerate(placement):
            if d is not None and axis < self.grid.ndim:
                start, stop = self.grid.bounds(axis, shape[d])[self.coords[axis]]
                out[d] = stop - start
        return tuple(out)

    # -- forward of the root: global shape, trace once per shape --------------------------------

    def before_forward(self, module, args, kwargs):
        if not args or not isinstance(args[0], torch.Tensor):
            raise UnsupportedModuleError(
                "the spatially parallel model takes its partitioned input as the first positional argument"
            )
        x = args[0]
        shape = global_shape(x, self.comm, "the model input")
        modes = tuple(m.training for m in module.modules())
        key = (shape, x.dtype, modes)
        if key not in self.traces:
            self.traces[key] = self._trace(modes, shape, x.dtype, args, kwargs)
        self.current = self.traces[key]
        self.calls = {}

    def after_forward(self, module, args, kwargs, output):
        self.current = None

    def _trace(self, modes, shape, dtype, args, kwargs) -> Trace:
        """Run the meta twin of the model on the global shape, recording and checking every layer."""
        self.grid.check_shape(shape[2:], "the model input")
        for m, training in zip(self.twin.modules(), modes):
            m.training = training
        self.current = Trace()
        self.state = checks.TraceState(self.grid.parts, self.twin.training)
        self.calls = {}
        x = torch.empty(shape, dtype=dtype, device="meta")
        self.state.slabs.split(x, len(shape) - 2)
        self.model_input = x
        hooks = self._path_hooks(self.twin)
        try:
            with self.values, checks.Checker(self.state):
                self.twin(x, *tree_map(self._meta_arg, tuple(args[1:])), **tree_map(self._meta_arg, kwargs))
            return self.current
        finally:
            for h in hooks:
                h.remove()
            self.state, self.model_input = None, None

    def _meta_arg(self, t):
        """An argument of the model's forward besides its input, on the meta device for the trace (its value kept
        where it is small)."""
        if not isinstance(t, torch.Tensor):
            return t
        copy = torch.empty_like(t, device="meta")
        if t.numel() <= meta.VALUE_LIMIT and not t.is_meta:
            self.values.set(copy, t.detach().cpu())
        return copy

    def _path_hooks(self, root: nn.Module):
        def enter(module, args):
            self.state.paths.append(self.paths[id(module)])

        def leave(module, args, output):
            self.state.paths.pop()

        hooks = []
        for m in root.modules():
            hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        return hooks

    # -- converted layers ---------------------------------------------------------------------

    def call_layer(self, module, forward, args, kwargs, replicated=None):
        path = self.paths[id(module)]
        index = self.calls.get(path, 0)
        self.calls[path] = index + 1
        if self.current is None:
            raise UnsupportedModuleError(
                f"{self.where(module)} was called outside the forward of the model passed to "
                "hybridpar.spatial.parallelize; call the parallelized model itself"
            )
        if self.state is not None:
            return self._trace_layer(module, forward, args, kwargs, (path, index))
        record = self.current.records[(path, index)]
        x = args[0]
        if record.status == PARTITIONED:
            if tuple(x.shape) != record.local_in:
                raise GeometryError(
                    f"{self.where(module)}: got a slab of shape {tuple(x.shape)} but the traced model gives this "
                    f"rank a slab of {record.local_in} (global {record.global_in}); the forward must not "
                    "depend on anything but the input shape"
                )
            return module._hp_run(x, record.geo, self)
        if record.status == REPLICATED and replicated is not None:
            return replicated(x, self)
        return forward(*args, **kwargs)

    def _trace_layer(self, module, forward, args, kwargs, key):
        x = args[0]
        # one part (a batch norm summing its statistics over data parallelism): every tensor is all of its slab
        status = PARTITIONED if self.grid.size == 1 else self.state.status(x)
        self.state.suspended += 1
        try:
            out = forward(*args, **kwargs)
        finally:
            self.state.suspended -= 1
        canonical, placement = self.state.slabs.canonical(x), self.state.slabs.placement(x)
        self.state.check(self.state.slabs.module(module, x, out, self.paths[id(module)]))
        geo = None
        if status == PARTITIONED and (canonical or isinstance(module, nn.Dropout)):
            where = self.where(module)
            if getattr(module, "return_indices", False):
                raise UnsupportedModuleError(
                    f"{where}: return_indices=True gives indices into the local slab, not the global volume; "
                    "use return_indices=False"
                )
            if self.grid.size > 1:
                self.grid.check_shape(tuple(x.shape[2:]), where)
            if module._hp_output == PARTITIONED and self.grid.size > 1:
                self.grid.check_shape(tuple(out.shape[2:]), f"{where} output")
            self.reads_model_input = x is self.model_input
            geo = module._hp_plan(tuple(x.shape), tuple(out.shape), self)
        local = self.local_shape(tuple(x.shape), placement) if status == PARTITIONED else tuple(x.shape)
        self.current.records[key] = LayerRecord(status, tuple(x.shape), local, geo)
        return out


def global_shape(x: torch.Tensor, comm: SpatialComm, what: str) -> tuple[int, ...]:
    """The global shape of a tensor whose slabs the spatial group holds; checked on every rank alike."""
    grid = comm.grid
    mine = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
    mine[0] = x.dim()
    mine[1 : 1 + x.dim()] = torch.tensor(x.shape)
    shapes = [torch.zeros_like(mine) for _ in range(grid.size)]
    dist.all_gather(shapes, mine, group=comm.group)
    shapes = [tuple(s[1 : 1 + int(s[0])].tolist()) for s in shapes]
    if len({len(s) for s in shapes}) != 1 or len(shapes[0]) != 2 + grid.ndim:
        raise GeometryError(
            f"{what}: slab shapes {shapes} across the spatial group; each rank must pass an "
            f"(N, C, *spatial) slab with {grid.ndim} spatial dims"
        )
    total = list(shapes[0][:2])
    for axis in range(grid.ndim):
        total.append(sum(shapes[grid.neighbour(0, axis, c)][2 + axis] for c in range(grid.parts[axis])))
    expected = [tuple(total[:2]) + tuple(b - a for a, b in grid.slab(tuple(total[2:]), r)) for r in range(grid.size)]
    if shapes != expected:
        raise GeometryError(
            f"{what}: slab shapes {shapes} do not tile a global {tuple(total)} split by grid {grid.parts}; "
            f"expected {expected}; make the slabs with hybridpar.spatial.shard"
        )
    return tuple(total)


def _convert(module: nn.Module, ctx: SpatialContext) -> None:
    """Each layer of a kind the spatial runtime runs on slabs becomes its spatial version; with one part (a grid of
    ones: batch-norm statistics summed over data parallelism only), the batch norms alone."""
    for path, m in module.named_modules():
        ctx.paths[id(m)] = path
        if isinstance(m, SpatialLayer):
            raise UnsupportedModuleError(f"module '{path or '<root>'}' is already spatially parallel")
        kind = _layer_kind(type(m))
        if kind is None or (ctx.grid.size == 1 and not isinstance(m, nn.modules.batchnorm._BatchNorm)):
            continue
        m.__class__ = _subclass(kind, type(m))
        m._hp_ctx = ctx


def _layer_kind(cls: type) -> type | None:
    """The spatial version of ``cls``: of a supported layer, or of a subclass that keeps its ``forward``
    (one that overrides it is traced and checked function by function instead): ``rules.spatial_base``."""
    base = rules.spatial_base(cls)
    return LAYERS[base] if base is not None else None


_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(kind: type, base: type) -> type:
    key = (kind, base)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Spatial{base.__name__}", (kind, base), {})
    return _CLASSES[key]


def parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    grid: tuple[int, ...] | Grid,
    batch_norm_mesh: DeviceMesh | None = None,
    overlap: bool | None = None,
) -> nn.Module:
    """Convert ``module`` in place so that each rank of the 1-D ``mesh`` computes its slab exactly.

    ``grid`` gives parts per spatial dim (row-major over the mesh), or is a ``Grid`` whose slab weights
    size the slabs unevenly (a slower device gets fewer rows). Batch-norm statistics are
    summed over ``batch_norm_mesh`` (default: ``mesh``); pass a mesh spanning data parallelism
    too to normalise over the global batch. ``overlap`` makes convolutions compute their interior
    while the halo is in flight (``None``: where it pays, see ``SpatialContext.use_overlap``).
    Parameter names and shapes are unchanged.
    """
    comm = _comm(mesh, grid)
    norm = batch_norm_mesh or mesh
    norm_group = norm.get_group() if norm.ndim == 1 else flat_group(norm, tuple(norm.mesh_dim_names))
    ctx = SpatialContext(module, comm, norm_group, overlap)
    _convert(module, ctx)
    _convert(ctx.twin, ctx)
    module.register_forward_pre_hook(ctx.before_forward, with_kwargs=True)
    module.register_forward_hook(ctx.after_forward, with_kwargs=True)
    return module


def exchange_stats(module: nn.Module) -> ExchangeStats:
    """Bytes and messages this rank sent in halo exchanges of a parallelized ``module``, and the seconds it waited
    for halos."""
    for m in module.modules():
        if isinstance(m, SpatialLayer):
            return m._hp_ctx.comm.stats
    raise UnsupportedModuleError("exchange_stats: the module has no spatially parallel layer")


def _comm(mesh: DeviceMesh, grid) -> SpatialComm:
    grid_ = grid if isinstance(grid, Grid) else Grid(tuple(grid))
    if mesh.ndim != 1:
        raise MeshError(f"spatial mesh has {mesh.ndim} axes {mesh.mesh_dim_names}; pass its 1-D spatial sub-mesh")
    if mesh.size() != grid_.size:
        raise MeshError(f"grid {grid_.parts} has {grid_.size} parts but the spatial mesh has {mesh.size()} ranks")
    return SpatialComm.from_group(mesh.get_group(), grid_)


def shard(x: torch.Tensor, mesh: DeviceMesh, *, grid: tuple[int, ...] | Grid) -> torch.Tensor:
    """This rank's slab of a global ``(N, C, *spatial)`` tensor (a copy)."""
    comm = _comm(mesh, grid)
    comm.grid.check_shape(tuple(x.shape[2:]), "shard")
    for axis, (lo, hi) in enumerate(comm.grid.slab(tuple(x.shape[2:]), comm.rank)):
        x = x.narrow(2 + axis, lo, hi - lo)
    return x.clone()


def unshard(x_local: torch.Tensor, mesh: DeviceMesh, *, grid: tuple[int, ...] | Grid) -> torch.Tensor:
    """The global tensor on every rank, from each rank's slab (differentiable)."""
    comm = _comm(mesh, grid)
    shape = global_shape(x_local, comm, "unshard")
    return gather_slabs(x_local, comm, shape[2:])

