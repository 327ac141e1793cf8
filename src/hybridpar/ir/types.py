"""The Plan: what the runtime applies, as frozen dataclasses and JSON with a schema version.

A plan written by hand and a plan found by the search are the same type and pass the same
validation (``hybridpar.plan.validate``). ``layers`` names how each layer uses the ``tp`` axis:

- ``replicate``: every tp rank computes the whole layer;
- ``column``: output features / filters split (conv: filter parallelism; linear: Megatron's column);
- ``row``: input features / channels split, outputs summed (conv: channel parallelism; linear: row);
- ``shard``: works on channel- or head-split activations as they come (pointwise, batch norm, pooling,
  attention heads).

Layers not listed replicate. ``shares`` gives the samples of each data-parallel replica per step (uneven: a
slower replica takes fewer) and ``slabs`` the weights of each spatial part's rows per spatial dim (a slower
device holds a thinner slab); both empty: even. ``stages`` gives the first layer of each pipeline stage after the
first, and ``schedule`` how the stages run the micro-batches: ``gpipe`` (all forwards, then all backwards), ``1f1b``
(one forward, one backward: at most ``pp`` micro-batches in flight) or ``interleaved-1f1b`` (``v`` stages per
pp rank, ``pp * v`` in all, which shrinks the bubble ``v`` times).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from hybridpar.dims import ParallelDims
from hybridpar.errors import GeometryError, PlanError
from hybridpar.geometry import Grid, even_weights

SCHEMA_VERSION = 1
TP_STRATEGIES = ("replicate", "column", "row", "shard")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
BUCKET_BYTES = 25 * 2**20  # data parallelism's gradient bucket: DDP's default, and the runtime's own bucketed
# all-reduce; the cost model prices the last bucket as the all-reduce left after backward ends
SHARDING_NAMES = {0: "none (DDP)", 1: "optimizer state (ZeRO-1)", 2: "+ gradients (ZeRO-2)", 3: "+ parameters (FSDP)"}


@dataclass(frozen=True)
class Prediction:
    """What the cost model expects of a plan (per step, per device)."""

    step_time: float
    compute_time: float
    memory: dict = field(default_factory=dict)  # bytes by kind, with "total"
    communication: dict = field(default_factory=dict)  # exposed seconds by kind
    samples_per_second: float = 0.0


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    spatial: tuple[int, ...] = (1,)
    slabs: tuple[tuple[int, ...], ...] = ()  # per spatial dim, each part's weight (rows in proportion); () even
    tp: int = 1
    pp: int = 1
    global_batch: int = 1
    shares: tuple[int, ...] = ()  # samples of each dp replica per step, summing to global_batch; () even
    micro_batches: int = 1
    sharding: int = 0  # ZeRO level over the dp x spatial ranks: 0 DDP, 1, 2, 3 FSDP
    checkpointing: bool = False
    stages: tuple[str, ...] = ()  # first layer of each stage after the first
    schedule: str = "1f1b"  # gpipe, 1f1b, or interleaved-1f1b (several stages per pp rank)
    layers: tuple[tuple[str, str], ...] = ()  # (layer name, tp strategy) for layers that do not replicate
    sequence_parallel: bool = False  # replicated token-wise layers run on sequence shards (Megatron-SP)
    optimizer: str = "adam"
    dtype: str = "float32"
    model: str = ""
    input_shape: tuple[int, ...] = ()
    cluster: str = ""
    prediction: Prediction | None = None

    def __post_init__(self):
        object.__setattr__(self, "spatial", tuple(self.spatial))
        # weights or shares alike are the even split (one form), where they fit the degrees: else kept, and refused
        slabs = tuple(tuple(w) for w in self.slabs)
        fit = len(slabs) == len(self.spatial) and all(len(w) in (0, p) for w, p in zip(slabs, self.spatial))
        object.__setattr__(self, "slabs", () if fit and all(even_weights(w) for w in slabs) else slabs)
        shares = tuple(self.shares)
        fit = len(shares) == self.dp and sum(shares) == self.global_batch
        object.__setattr__(self, "shares", () if fit and even_weights(shares) else shares)
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "layers", tuple(tuple(p) for p in self.layers))
        object.__setattr__(self, "input_shape", tuple(self.input_shape))

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(dp=self.dp, spatial=self.spatial, tp=self.tp, pp=self.pp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def grid(self) -> Grid:
        """The spatial grid with its slab weights (a ``PlanError`` where they do not fit ``spatial``)."""
        try:
            return Grid(self.spatial, self.slabs)
        except GeometryError as err:
            raise PlanError(f"plan slabs: {err}") from None

    def check_uneven(self) -> None:
        """Refuse ``shares`` and ``slabs`` that do not fit the plan's degrees and batch (a ``PlanError``): the rule
        of the planner's ``validate`` and of ``hybridpar.parallelize`` alike."""
        self.grid  # noqa: B018 (the slab weights are checked as the grid is built)
        if not self.shares:
            return
        shares = list(self.shares)
        if len(shares) != self.dp or sum(shares) != self.global_batch:
            raise PlanError(f"shares = {shares}: give dp={self.dp} sample counts that sum to global_batch = "
                            f"{self.global_batch}, or none for even shares")
        if self.pp > 1:
            raise PlanError(f"shares = {shares} with pp={self.pp}: uneven data-parallel shares are not run under "
                            "pipeline stages (every replica's stages are shaped for one micro-batch size); drop "
                            "shares, or give a slower device fewer layers with stages")

    def batch_rows(self, replica: int) -> tuple[int, int]:
        """``[start, stop)`` of data-parallel replica ``replica``'s samples in a step's global batch: ``shares``
        in order, or equal parts."""
        shares = self.shares or (self.global_batch // self.dp,) * self.dp
        start = sum(shares[:replica])
        return start, start + shares[replica]

    def loss_weight(self, replica: int) -> float:
        """What replica ``replica``'s mean loss is scaled by, so that the dp replicas' mean of gradients (DDP's,
        FSDP's) is the global batch's mean: its share of the batch times ``dp`` (1 for even shares)."""
        start, stop = self.batch_rows(replica)
        return (stop - start) * self.dp / self.global_batch if self.shares else 1.0

    def strategy(self, layer: str) -> str:
        return dict(self.layers).get(layer, "replicate")

    def describe(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.shares:
            parts[0] += " shares " + _ratio(self.shares)
        if any(p > 1 for p in self.spatial):
            parts.append("spatial=" + "x".join(map(str, self.spatial)))
            parts += [f"slabs[{axis}] " + _ratio(w) for axis, w in enumerate(self.slabs) if w]
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + (" sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"pp={self.pp} (m={self.micro_batches})")
        if self.sharding:
            parts.append(f"zero={self.sharding}")
        if self.checkpointing:
            parts.append("ckpt")
        return " ".join(parts)

    def to_dict(self) -> dict:
        out = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        out["layers"] = {name: s for name, s in self.layers}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_dict(data: dict, where: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"{where}: expected a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"{where}: schema_version {version!r}; this hybridpar reads version {SCHEMA_VERSION} "
                            "(re-run `hybridpar plan` to write a current plan)")
        known = set(Plan.__dataclass_fields__)
        unknown = sorted(set(data) - known - {"schema_version"})
        if unknown:
            raise PlanError(f"{where}: unknown key {unknown[0]!r}; a plan has {', '.join(sorted(known))}")
        values = dict(data)
        values.pop("schema_version")
        layers = values.get("layers", {})
        if not isinstance(layers, dict):
            raise PlanError(f"{where}: layers must map layer names to one of {', '.join(TP_STRATEGIES)}")
        values["layers"] = tuple(layers.items())
        _check_types(values, where)
        if values.get("prediction") is not None:
            values["prediction"] = _prediction(values["prediction"], where)
        try:
            return Plan(**values)
        except TypeError as err:
            raise PlanError(f"{where}: {err}") from None

    @staticmethod
    def from_json(text: str, where: str = "plan") -> Plan:
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except (json.JSONDecodeError, RecursionError) as err:
            problem = str(err) if isinstance(err, ValueError) else "nested too deeply"
            raise PlanError(f"{where}: not valid JSON ({problem})") from None
        except ValueError as err:  # from the two hooks
            raise PlanError(f"{where}: {err}") from None
        return Plan.from_dict(data, where)


def _ratio(values: tuple[int, ...]) -> str:
    """``5:3``; a run of three or more alike as ``value*count`` (``1*16:3*16``)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return ":".join(f"{v}*{n}" if n >= 3 else ":".join([str(v)] * n) for v, n in runs)


def _unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    duplicate = next((key for key in keys if keys.count(key) > 1), None)
    if duplicate is not None:
        raise ValueError(f"key {duplicate!r} appears twice in one object; keep one")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON number; give a finite number")


def _prediction(data: dict, where: str) -> Prediction:
    """The ``prediction`` object of a plan file: known fields of the right types (finite numbers)."""
    known = Prediction.__annotations__
    for key, value in data.items():
        if key not in known:
            raise PlanError(f"{where}: unknown key prediction.{key}; a prediction has {', '.join(known)}")
        numbers = [value] if known[key] == "float" else (value.values() if isinstance(value, dict) else [None])
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise PlanError(f"{where}: prediction.{key} = {json.dumps(value, default=str)}: expected "
                            + ("a number" if known[key] == "float" else "an object of numbers"))
    missing = [f for f in ("step_time", "compute_time") if f not in data]
    if missing:
        raise PlanError(f"{where}: prediction has no {missing[0]}; give it, or remove prediction")
    return Prediction(**data)


FIELD_TYPES = {"dp": "count", "tp": "count", "pp": "count", "global_batch": "count", "micro_batches": "count",
               "sharding": "int", "spatial": "counts", "slabs": "count lists",
               "shares": "counts", "input_shape": "counts", "checkpointing": "bool",
               "stages": "names", "schedule": "str", "layers": "pairs", "sequence_parallel": "bool",
               "optimizer": "str", "dtype": "str", "model": "str", "cluster": "str", "prediction": "object"}


def _counts(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)


FIELD_CHECKS = {
    "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "counts": _counts,
    "count lists": lambda v: isinstance(v, (list, tuple)) and all(_counts(w) for w in v),
    "bool": lambda v: isinstance(v, bool),
    "names": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
    "pairs": lambda v: all(isinstance(a, str) and isinstance(b, str) for a, b in v),
    "str": lambda v: isinstance(v, str),
    "object": lambda v: v is None or isinstance(v, dict),
}
EXPECTED = {"count": "a whole number >= 1", "int": "a whole number", "counts": "a list of whole numbers >= 1",
            "count lists": "a list of lists of whole numbers >= 1", "bool": "true or false",
            "names": "a list of layer names", "pairs": "an object mapping layer names to strategies",
            "str": "a string", "object": "an object"}


def _check_types(values: dict, where: str) -> None:
    """Each field of a plan read from JSON has the JSON type it needs, or a PlanError names it."""
    for key, value in values.items():
        kind = FIELD_TYPES[key]
        if not FIELD_CHECKS[kind](value):
            raise PlanError(f"{where}: {key} = {json.dumps(value, default=str)}: expected {EXPECTED[kind]}")
