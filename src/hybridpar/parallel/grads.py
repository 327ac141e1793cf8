"""Gradients kept in step with one process's where PyTorch's engines do not: a parameter that several pipeline
stages hold a copy of gets the sum of the copies' gradients; where DDP cannot wrap (tensor or pipeline
parallelism under sharding 0) gradients are averaged over the data-parallel ranks in DDP's buckets; where it
wraps, each gradient is summed on its own, in the same order in every step (``mean_of_each_gradient``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpar.ir.types import BUCKET_BYTES
from hybridpar.parallel.state import original_name


def buckets(tensors: list[torch.Tensor]):
    """Consecutive runs of ``tensors`` of one dtype and device, each at most ``BUCKET_BYTES`` (or one tensor)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > BUCKET_BYTES or (t.dtype, t.device) != (bucket[0].dtype, bucket[0].device)):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p``'s gradient, laid out as ``p`` is (DTensor may leave the gradient of a split
    parameter whole on every rank; it is then made split as the parameter, which slices it locally)."""
    grad = p.grad
    if hasattr(grad, "placements") and grad.placements != p.placements:
        p.grad = grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local() if hasattr(grad, "to_local") else grad


def sum_tied_gradients(modules, tied: list) -> None:
    """A parameter that several pipeline stages hold a copy of (a head tied to the token embedding) gets the
    sum of the copies' gradients on every copy (over the pp ranks that hold one), as one process's one
    parameter gets both uses'."""
    for names, group in tied:
        copies = list({id(p): p for module in modules for name, p in
                       module.named_parameters(remove_duplicate=False) if original_name(name) in names}.values())
        total = None
        for p in copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = local_grad(p)
            total = grad.clone() if total is None else total + grad
        if group is not None:
            dist.all_reduce(total, group=group)
        for p in copies:
            local_grad(p).copy_(total)


def mean_of_each_gradient(group, bucket):  # unannotated: DDP compares a hook's annotations with its types
    """DDP's communication hook: the mean over ``group`` of each gradient of the bucket, all-reduced on its own.
    An all-reduce adds an element's values from the ranks in an order set by where the element sits in the
    buffer, and DDP regroups its buckets after its first iteration: a DDP built after a resume (its first
    iteration again) would add up the uninterrupted run's step in another order (other bits, at 3 or more ranks).
    One gradient's place in its own all-reduce does not change."""
    buffer = bucket.buffer().div_(dist.get_world_size(group))  # as DDP's own hook: divided, then summed
    works = [dist.all_reduce(grad, group=group, async_op=True).get_future() for grad in bucket.gradients()]
    return torch.futures.collect_all(works).then(lambda _: buffer)


def all_reduce_gradients(parameters: list[torch.Tensor], group) -> None:
    """The mean of every local gradient of ``parameters`` over ``group`` (the ``dp x spatial`` ranks), flattened
    into buckets of at most ``BUCKET_BYTES`` (as DDP does): one all-reduce per bucket, not one per parameter."""
    size = dist.get_world_size(group)
    grads = [local_grad(p) for p in parameters if p.grad is not None]
    for bucket in buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(part.view_as(grad))
