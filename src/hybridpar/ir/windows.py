"""The sliding windows of a convolution or a pooling module, per spatial dim (``windows_of``): read once from the
module's own attributes, by the model analysis (halo widths the planner prices) and by the spatial runtime (the
halos it exchanges). Pure: the module is read, torch is not imported."""

from __future__ import annotations

from hybridpar.geometry import Window


def per_dim(value, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def windows_of(module, num_spatial: int) -> tuple[Window, ...]:
    """Per spatial dim, the window of a convolution (its kernel, stride, dilation and the padding before the
    first row, as PyTorch pads it: ``_reversed_padding_repeated_twice``) or of a max / average pooling (``stride``
    defaulting to the kernel, no dilation for an average)."""
    if hasattr(module, "_reversed_padding_repeated_twice"):  # a convolution (any padding: int, 'same', 'valid')
        n, pads = len(module.kernel_size), module._reversed_padding_repeated_twice
        return tuple(Window(module.kernel_size[i], module.stride[i], pads[2 * (n - 1 - i)], module.dilation[i])
                     for i in range(n))
    k, s, p = (per_dim(v, num_spatial) for v in (module.kernel_size, module.stride or module.kernel_size,
                                                 module.padding))
    d = per_dim(getattr(module, "dilation", 1), num_spatial)
    return tuple(Window(k[i], s[i], p[i], d[i]) for i in range(num_spatial))


def right_pads(conv) -> tuple[int, ...]:
    """Per spatial dim, the padding a convolution adds after the last row (``'same'`` may pad one side more)."""
    n, pads = len(conv.kernel_size), conv._reversed_padding_repeated_twice
    return tuple(pads[2 * (n - 1 - i) + 1] for i in range(n))
