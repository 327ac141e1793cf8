"""Cluster specs in and out of TOML: the planner's only file I/O. Every key is described in docs/cluster.md.

The file uses human units (GiB, GB/s = 1e9 bytes/s, TFLOP/s, microseconds); a ClusterSpec holds SI units.
Numbers are converted in decimal (``tomllib`` with ``parse_float=Decimal``), so spec -> TOML -> spec is exact.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

from hybridpar.errors import ClusterError
from hybridpar.plan.cluster import KINDS, MAX_DEVICES, PRESETS, ClusterSpec, GiB, Link
from hybridpar.plan.mixed import MixedCluster
from hybridpar.plan.rates import DTYPES, ConvRate, OpRate

# unit -> power of ten from the TOML number to SI ("GiB" is binary, handled apart)
EXP10 = {"GB/s": 9, "GFLOP/s": 9, "TFLOP/s": 12, "us": -6, "fraction": 0}
TOP = {  # key -> (ClusterSpec field, unit); tables are read by their own functions
    "name": ("name", "str"), "nodes": ("num_nodes", "int"), "devices_per_node": ("devices_per_node", "int"),
    "device_memory_gib": ("device_memory", "GiB"), "reserved_memory_gib": ("reserved_memory", "GiB"),
    "memory_bandwidth_gbs": ("memory_bandwidth", "GB/s"), "peak_tflops": ("peak_flops", "table"),
    "efficiency": ("efficiency", "table"), "intra_node": ("intra_node", "table"), "inter_node": ("inter_node", "table"),
    "conv_rates": ("conv_rates", "table"), "op_rates": ("op_rates", "table"),
    "fast_conv_min": ("fast_conv_min", "optional"), "slow_conv_rates": ("slow_conv_rates", "table"),
}
# keys of the optional rows: key -> (field, unit)
CONV_RATE = {"dtype": ("dtype", "str"), "in_channels": ("in_channels", "int"), "out_channels": ("out_channels", "int"),
             "positions": ("positions", "int"), "forward_gflops": ("forward", "GFLOP/s"),
             "input_grad_gflops": ("input_grad", "GFLOP/s"), "weight_grad_gflops": ("weight_grad", "GFLOP/s")}
OP_RATE = {"op": ("op", "str"), "bytes": ("bytes", "int"), "forward_gbs": ("forward", "GB/s"),
           "backward_gbs": ("backward", "GB/s")}
ROWS = {"conv_rates": (ConvRate, CONV_RATE), "slow_conv_rates": (ConvRate, CONV_RATE), "op_rates": (OpRate, OP_RATE)}
LINK = {  # key -> (Link field, unit, required)
    "bandwidth_gbs": ("bandwidth", "GB/s", True), "latency_us": ("latency", "us", True),
    "collective_bandwidth_gbs": ("collective_bandwidth", "GB/s", False),
    "collective_latency_us": ("collective_latency", "us", False),
    "sync_wait_us": ("sync_wait", "us", False),
    "all_gather_bandwidth_gbs": ("all_gather_bandwidth", "GB/s", False),
    "all_gather_latency_us": ("all_gather_latency", "us", False),
    "reduce_scatter_bandwidth_gbs": ("reduce_scatter_bandwidth", "GB/s", False),
    "reduce_scatter_latency_us": ("reduce_scatter_latency", "us", False),
}


def load_cluster(name_or_path: str | Path, mixed: bool = True) -> ClusterSpec | MixedCluster:
    """A preset by name (``"a100-80"``), or a ClusterSpec TOML file, or a mixed cluster's (``[[group]]`` tables
    of nodes, each a preset or a file beside it); errors name the file and the key."""
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ClusterError(f"{path}: no such file, and not a preset name; presets: {', '.join(PRESETS)}, "
                           f"or write one with `hybridpar calibrate`") from None
    except OSError as err:
        raise ClusterError(f"{path}: cannot read the cluster file ({err.strerror})") from None
    return cluster_from_toml(text, str(path), path.parent, mixed)


def cluster_from_toml(text: str, source: str = "cluster.toml", base: Path = Path(),
                      mixed: bool = True) -> ClusterSpec | MixedCluster:
    """A ClusterSpec (or, with ``mixed``, a mixed cluster: ``[[group]]`` tables, their files relative to ``base``)
    from TOML text; ``source`` (the file name) starts every error message."""
    try:
        table = tomllib.loads(text, parse_float=Decimal)
    except tomllib.TOMLDecodeError as err:
        raise ClusterError(f"{source}: not valid TOML ({err})") from None
    try:
        if "group" in table and not mixed:
            raise ClusterError("is a mixed cluster itself ([[group]] tables); a group names one kind of node")
        return _mixed(table, base) if "group" in table else _parse(table)
    except ClusterError as err:
        raise ClusterError(f"{source}: {err}") from None


def _mixed(table: dict, base: Path) -> MixedCluster:
    """``name`` and ``[[group]]`` tables of ``cluster`` (a preset, or a file relative to ``base``) and ``nodes``."""
    _check_keys(table, ("name", "group"), "", "a mixed cluster's top level")
    if not isinstance(table["group"], list):
        raise ClusterError(f"group = {_show(table['group'])}: expected [[group]] tables of cluster and nodes")
    groups = []
    for i, entry in enumerate(table["group"]):
        if not isinstance(entry, dict):
            raise ClusterError(f"group[{i}] = {_show(entry)}: expected a [[group]] table of cluster and nodes")
        _check_keys(entry, ("cluster", "nodes"), f"group[{i}].", "a [[group]]")
        name = _group_cluster(entry, f"group[{i}].")
        spec = load_cluster(name if name in PRESETS else base / name, mixed=False)
        groups.append(replace(spec, num_nodes=_value(entry, "nodes", f"group[{i}].", "int")))
    return MixedCluster(_value(table, "name", "", "str"), tuple(groups))


def _group_cluster(entry: dict, prefix: str) -> str:
    """A ``[[group]]``'s ``cluster``: a preset name or the path of a cluster TOML file."""
    value = entry.get("cluster", "")
    if "cluster" in entry and not (isinstance(value, str) and value):
        raise ClusterError(f"{prefix}cluster = {_show(value)}: give a preset name ({', '.join(PRESETS)}) or the path "
                           'of a cluster TOML file, as a string, e.g. cluster = "a100-80"')
    return _value(entry, "cluster", prefix, "str")


def cluster_to_toml(spec: ClusterSpec, comment: str = "") -> str:
    """The TOML text of ``spec`` (``comment``, if any, goes on top as ``#`` lines)."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()] + ([""] if comment else [])
    lines += [f"name = {_string(spec.name)}", f"nodes = {spec.num_nodes}",
              f"devices_per_node = {spec.devices_per_node}"]
    for key, (field, unit) in TOP.items():
        if unit in ("GiB", "GB/s"):
            lines.append(f"{key} = {_to_toml(getattr(spec, field), unit)}")
    if spec.fast_conv_min:
        lines.append(f"fast_conv_min = {spec.fast_conv_min}")
    lines += ["", "[peak_tflops]"]
    lines += [f"{d} = {_to_toml(spec.peak_flops[d], 'TFLOP/s')}" for d in DTYPES if d in spec.peak_flops]
    lines += ["", "[efficiency]"] + [f"{k} = {_to_toml(spec.efficiency[k], 'fraction')}" for k in KINDS]
    for section in ("intra_node", "inter_node"):
        link = getattr(spec, section)
        lines += ["", f"[{section}]"]
        for key, (field, unit, _) in LINK.items():
            if getattr(link, field):
                lines.append(f"{key} = {_to_toml(getattr(link, field), unit)}")
    for section, (_, keys) in ROWS.items():
        for row in getattr(spec, section):
            lines += ["", f"[[{section}]]"] + [f"{key} = {_row_value(getattr(row, field), unit)}"
                                               for key, (field, unit) in keys.items()]
    return "\n".join(lines) + "\n"


def _row_value(value, unit: str) -> str:
    return _string(value) if unit == "str" else str(value) if unit == "int" else _to_toml(value, unit)


def write_cluster(spec: ClusterSpec, path: str | Path, comment: str = "") -> None:
    """Write ``spec`` as TOML to ``path`` (replacing it; the caller decides whether that is allowed)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(cluster_to_toml(spec, comment))
    except OSError as err:
        raise ClusterError(f"{path}: cannot write the cluster file ({err.strerror})") from None


def _parse(table: dict) -> ClusterSpec:
    if "slow_conv_factor" in table:
        raise ClusterError("slow_conv_factor is no longer read: the slow conv kernel's rate depends on the conv's "
                           "shape, measured as [[slow_conv_rates]]; rerun `hybridpar calibrate` to write this file "
                           "anew")
    _check_keys(table, TOP, "", "the top level")
    values = {}
    for key, (field, unit) in TOP.items():
        if unit not in ("table", "optional"):
            values[field] = _value(table, key, "", unit)
    if "fast_conv_min" in table:
        values["fast_conv_min"] = _value(table, "fast_conv_min", "", "int")
    values["peak_flops"] = _peak_flops(_table(table, "peak_tflops"))
    values["efficiency"] = _efficiency(_table(table, "efficiency"))
    for section in ("intra_node", "inter_node"):
        values[section] = _link(_table(table, section), section)
    for section in ROWS:
        values[section] = _rows(table.get(section, []), section)
    if values["reserved_memory"] >= values["device_memory"]:
        raise ClusterError(f"reserved_memory_gib = {_to_toml(values['reserved_memory'], 'GiB')} leaves nothing of "
                           f"device_memory_gib = {_to_toml(values['device_memory'], 'GiB')}; make it smaller")
    return ClusterSpec(**values)


def _peak_flops(table: dict) -> dict[str, float]:
    _check_keys(table, DTYPES, "peak_tflops.", "[peak_tflops]")
    if not table:
        raise ClusterError(f"[peak_tflops] is empty; give dense TFLOP/s for at least one of {', '.join(DTYPES)}")
    return {dtype: _value(table, dtype, "peak_tflops.", "TFLOP/s") for dtype in table}


def _efficiency(table: dict) -> dict[str, float]:
    _check_keys(table, KINDS, "efficiency.", "[efficiency]")
    values = {kind: _value(table, kind, "efficiency.", "fraction") for kind in KINDS}
    for kind, value in values.items():
        if value > 1:
            raise ClusterError(f"efficiency.{kind} = {table[kind]}: a fraction of peak, in (0, 1], e.g. 0.6")
    return values


def _rows(rows, section: str) -> tuple:
    """The optional ``[[conv_rates]]``, ``[[slow_conv_rates]]`` or ``[[op_rates]]`` rows."""
    kind, keys = ROWS[section]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ClusterError(f"{section} = {_show(rows)}: expected [[{section}]] tables")
    out = []
    for i, row in enumerate(rows):
        prefix = f"{section}[{i}]."
        _check_keys(row, keys, prefix, f"[[{section}]]")
        out.append(kind(**{field: _value(row, key, prefix, unit) for key, (field, unit) in keys.items()}))
    return tuple(out)


def _link(table: dict, section: str) -> Link:
    _check_keys(table, LINK, f"{section}.", f"[{section}]")
    values = {field: _value(table, key, f"{section}.", unit, required)
              for key, (field, unit, required) in LINK.items()}
    return Link(**{field: value for field, value in values.items() if value is not None or field != "sync_wait"})


def _check_keys(table: dict, allowed, prefix: str, where: str) -> None:
    unknown = [key for key in table if key not in allowed]
    if unknown:
        raise ClusterError(f"unknown key {prefix}{unknown[0]}; {where} takes {', '.join(allowed)}")


def _table(table: dict, key: str) -> dict:
    if key not in table:
        raise ClusterError(f"missing table [{key}]; see docs/cluster.md")
    if not isinstance(table[key], dict):
        raise ClusterError(f"{key} = {_show(table[key])}: expected a table [{key}]")
    return table[key]


def _value(table: dict, key: str, prefix: str, unit: str, required: bool = True):
    """``table[key]`` checked and converted to SI units; None when an optional key is absent."""
    full = prefix + key
    if key not in table:
        if required:
            raise ClusterError(f"missing key {full} ({_describe(unit)}); see docs/cluster.md")
        return None
    value = table[key]
    if unit == "str":
        if not isinstance(value, str) or not value:
            raise ClusterError(f"{full} = {_show(value)}: expected a non-empty string, e.g. \"a100-80\"")
        return value
    if unit == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ClusterError(f"{full} = {_show(value)}: expected a whole number >= 1")
        if key in ("nodes", "devices_per_node") and value > MAX_DEVICES:
            raise ClusterError(f"{full} = {value}: more than {MAX_DEVICES:,} devices (ten times the largest machines "
                               f"built); give the {key} of the cluster you mean")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, Decimal)):
        raise ClusterError(f"{full} = {_show(value)}: expected a number ({_describe(unit)})")
    zero_ok = key in ("reserved_memory_gib", "sync_wait_us")
    if not Decimal(value).is_finite() or value < 0 or (value == 0 and not zero_ok):
        bound = "a finite number >= 0" if zero_ok else "a finite number greater than 0"
        raise ClusterError(f"{full} = {_show(value)}: must be {bound} ({_describe(unit)})")
    return _from_toml(value, unit)


def _describe(unit: str) -> str:
    return {"GiB": "GiB, 2**30 bytes", "GB/s": "GB/s, 1e9 bytes/s", "TFLOP/s": "TFLOP/s, 1e12 FLOP/s",
            "GFLOP/s": "GFLOP/s, 1e9 FLOP/s",
            "us": "microseconds", "fraction": "a fraction of peak in (0, 1]", "int": "a whole number",
            "str": "a string"}[unit]


def _from_toml(value: int | Decimal, unit: str) -> float:
    if unit == "GiB":
        return float(value) * GiB  # exact: a power of two
    return float(Decimal(value).scaleb(EXP10[unit]))  # exact decimal shift, then one rounding


def _to_toml(x: float, unit: str) -> str:
    """The shortest decimal that reads back (by ``_from_toml``) as exactly ``x``."""
    number = Decimal(repr(float(x) / GiB)) if unit == "GiB" else Decimal(repr(float(x))).scaleb(-EXP10[unit])
    return format(number.normalize(), "f")


def _string(text: str) -> str:
    escaped = "".join(f"\\{c}" if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
                      for c in text)
    return f'"{escaped}"'


def _show(value) -> str:
    """A TOML value as it would appear in the file, for error messages."""
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)
