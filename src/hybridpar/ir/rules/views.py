"""Views: where a view, reshape, transpose or index moves each dim of a tensor (``alias_dims``), so that a split
of one layer's output (a column layer's features, the heads they hold) can be followed to every layer that reads it."""

from __future__ import annotations

SAME_DIMS = frozenset("contiguous clone to type float double half bfloat16 detach detach_ requires_grad_ "
                      "type_as cpu cuda".split())
RESHAPES = frozenset("view view_as reshape reshape_as flatten unflatten".split())
TRANSPOSES = frozenset("T H mT mH".split())  # properties: all dims reversed (T, H), the last two swapped (mT, mH)
ALIASES = SAME_DIMS | RESHAPES | TRANSPOSES | frozenset(
    """transpose swapaxes swapdims t permute movedim unsqueeze squeeze expand expand_as __getitem__ narrow select
    split split_with_sizes chunk unbind data""".split())
# tensors that take only the shape, dtype and device of their input: constants, not layers
SHAPE_ONLY = frozenset("""new_ones new_zeros new_empty new_full zeros_like ones_like empty_like full_like rand_like
    randn_like randint_like""".split())


def call_arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def wrap_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def alias_dims(name: str, args: tuple, kwargs: dict, src: tuple, in_shape: tuple[int, ...],
               out_shape: tuple[int, ...]) -> tuple:
    """``src`` holds, for each dim of the input (``args[0]``), what that dim carries (or ``None``); the result
    says the same of each dim of one output of the view ``name``: the carried thing moves with whole contiguous
    blocks of its dim (a reshape moves it to the outermost output dim of its group), and is lost (``None``)
    where the view cuts a dim into pieces or mixes it into an inner position."""
    n, m = len(in_shape), len(out_shape)
    if name in SAME_DIMS or name == "data":
        return tuple(src) if n == m else (None,) * m
    if name in RESHAPES:
        return _regroup(src, in_shape, out_shape)
    if name in ("T", "H") or (name == "t" and n == 2):
        return tuple(reversed(src))
    if name in ("transpose", "swapaxes", "swapdims", "mT", "mH"):
        a, b = ((wrap_dim(d, n) for d in (call_arg(args, kwargs, 1, "dim0", 0), call_arg(args, kwargs, 2, "dim1", 1)))
                if name not in ("mT", "mH") else (n - 2, n - 1))
        out = list(src)
        out[a], out[b] = out[b], out[a]
        return tuple(out)
    if name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:] or kwargs.get("dims")
        return tuple(src[wrap_dim(d, n)] for d in order)
    if name == "movedim":
        source, dest = call_arg(args, kwargs, 1, "source"), call_arg(args, kwargs, 2, "destination")
        source, dest = ([source], [dest]) if isinstance(source, int) else (list(source), list(dest))
        order = [None] * m
        for s, d in zip(source, dest):
            order[wrap_dim(d, m)] = wrap_dim(s, n)
        rest = iter(i for i in range(n) if i not in {wrap_dim(s, n) for s in source})
        return tuple(src[o if o is not None else next(rest)] for o in order)
    if name == "unsqueeze":
        at = wrap_dim(call_arg(args, kwargs, 1, "dim"), m)
        return tuple(src[:at]) + (None,) + tuple(src[at:])
    if name == "squeeze":
        dims = call_arg(args, kwargs, 1, "dim")
        drop = set(range(n)) if dims is None else {wrap_dim(d, n) for d in (dims if isinstance(dims, (tuple, list))
                                                                         else [dims])}
        return tuple(s for i, s in enumerate(src) if not (i in drop and in_shape[i] == 1))
    if name in ("expand", "expand_as"):
        lead = m - n
        return (None,) * lead + tuple(s if in_shape[i] == out_shape[lead + i] else None for i, s in enumerate(src))
    if name == "__getitem__":
        return _indexed(src, in_shape, args[1] if len(args) > 1 else (), m)
    if name in ("narrow", "split", "split_with_sizes", "chunk", "select", "unbind"):
        default = {"narrow": None, "select": None}.get(name, 0)
        index = {"narrow": 1, "select": 1, "split": 2, "split_with_sizes": 2, "chunk": 2, "unbind": 1}[name]
        dim = wrap_dim(call_arg(args, kwargs, index, "dim", default), n)
        if name in ("select", "unbind"):
            return tuple(s for i, s in enumerate(src) if i != dim)
        return tuple(None if i == dim and out_shape[i] != in_shape[i] else s for i, s in enumerate(src))
    return (None,) * m


def _regroup(src: tuple, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple:
    """A reshape: dims of equal size map one to one; a group of dims whose sizes multiply alike maps its
    outermost input dim onto its outermost output dim (whole blocks of one are whole blocks of the other,
    when the split count divides both), every other dim of the group carries nothing."""
    out = [None] * len(out_shape)
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == out_shape[j]:
            out[j] = src[i]
            i, j = i + 1, j + 1
        elif in_shape[i] == 1:
            i += 1
        elif out_shape[j] == 1:
            j += 1
        else:
            first, pi, pj = (i, j), in_shape[i], out_shape[j]
            i, j = i + 1, j + 1
            while pi != pj and i <= len(in_shape) and j <= len(out_shape):
                if pi < pj and i < len(in_shape):
                    pi, i = pi * in_shape[i], i + 1
                elif j < len(out_shape):
                    pj, j = pj * out_shape[j], j + 1
                else:
                    break
            out[first[1]] = src[first[0]]
    return tuple(out)


def _indexed(src: tuple, in_shape: tuple[int, ...], index, m: int) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in index):
        return (None,) * m  # advanced (tensor or list) indexing
    consumed = sum(1 for i in index if isinstance(i, (int, slice)))
    out, dim = [], 0
    for i in index:
        if i is Ellipsis:
            for _ in range(len(in_shape) - consumed):
                out.append(src[dim])
                dim += 1
        elif i is None:
            out.append(None)
        elif isinstance(i, int):
            dim += 1
        else:
            whole = i.step in (None, 1) and (i.start or 0) == 0 and (i.stop is None or i.stop >= in_shape[dim])
            out.append(src[dim] if whole else None)
            dim += 1
    out.extend(src[dim:])
    return tuple(out)


def view_sizes(name: str, args: tuple, kwargs: dict) -> tuple[int | None, ...] | None:
    """The sizes a view is given literally, one per output dim (``None``: the input's own size, ``-1``: inferred),
    for the views that take sizes (``view``, ``reshape``, ``unflatten``, ``expand``); ``None`` for a view that
    takes none (a transpose, ``view_as``, a ``view`` to another dtype). At run time an input split over ranks
    reaches such a view with a part of its size while the literal sizes stay: ``local_view_shape`` says what it
    then gives."""
    if name in ("view", "reshape"):
        sizes = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else \
            (args[1] if len(args) == 2 else kwargs.get("shape", kwargs.get("size")))
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else None
        return sizes if sizes is not None and all(isinstance(v, int) for v in sizes) else None
    if name == "unflatten":
        dim, sizes = call_arg(args, kwargs, 1, "dim"), tuple(call_arg(args, kwargs, 2, "sizes", ()))
        n = args[0].dim() if hasattr(args[0], "dim") else 0
        dim = wrap_dim(dim, n)
        return (None,) * dim + sizes + (None,) * (n - dim - 1)
    if name == "expand":
        sizes = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else \
            (args[1] if len(args) == 2 else kwargs.get("size"))
        return tuple(None if v == -1 else v for v in sizes) if isinstance(sizes, (tuple, list)) else None
    return None


def local_view_shape(op: str, sizes: tuple[int | None, ...], local_in: tuple[int, ...]) -> tuple[int, ...] | None:
    """What the view ``op`` with literal ``sizes`` (``view_sizes``) gives for an input of shape ``local_in``; ``None``
    where it cannot run on it (the sizes do not fit its elements)."""
    numel = 1
    for n in local_in:
        numel *= n
    if op in ("view", "reshape"):
        known = [v for v in sizes if v != -1]
        rest = 1
        for v in known:
            rest *= v
        if sizes.count(-1) > 1 or rest == 0 or numel % rest:
            return None
        out = tuple(numel // rest if v == -1 else v for v in sizes)
        return out if sizes.count(-1) or rest == numel else None
    if op == "unflatten":
        dim = next(i for i, v in enumerate(sizes) if v is not None)
        inner = tuple(v for v in sizes if v is not None)
        tail = len(sizes) - dim - len(inner)
        unflat = local_view_shape("view", inner, (local_in[dim],))
        return None if unflat is None else tuple(local_in[:dim]) + unflat + tuple(local_in[len(local_in) - tail:])
    if op == "expand":
        lead = len(sizes) - len(local_in)
        out = list(sizes[:lead])
        for v, n in zip(sizes[lead:], local_in):
            if v is not None and n not in (1, v):
                return None
            out.append(n if v is None else v)
        return tuple(out)
    return None


def is_inplace(name: str) -> bool:
    """Whether the function ``name`` writes into its first argument (``relu_``, ``add_``, ``__iadd__``)."""
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__")
                                                                and name not in ("__init__", "__iter__"))
