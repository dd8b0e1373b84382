"""The functional collectives the tests call, on every torch the project supports.

torch 2.13 names the tensor forms ``all_gather_single(x, gather_dim, group)`` and
``reduce_scatter_single(x, reduce_op, scatter_dim, group)`` (the older ``*_tensor`` names warn
there); older torch (2.11) has only ``all_gather_tensor`` / ``reduce_scatter_tensor``, with the
same arguments, the same traced ops and, as there, autograd on the ops themselves. The new
names are taken where they exist, so the tests run as before on 2.13.

One difference is patched over: on 2.11 ``all_gather_tensor`` with ``gather_dim != 0`` calls
``torch._utils._maybe_view_chunk_cat``, which Dynamo skips there (2.13 traces it), so the
collective falls out of the compiled graph (a graph break) and no pass ever sees it. There the
gather runs on dim 0 and the re-layout is 2.13's ``_maybe_view_chunk_cat``, inlined: a view
where dim 0 moves across size-1 dims only, else ``cat(chunk(...))``, the ops 2.13 traces."""

import math

import torch
import torch.distributed._functional_collectives as _funcol

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
"""``(major, minor)`` of the torch the tests run on, for what older DTensor traces differently."""

reduce_scatter_single = (getattr(_funcol, "reduce_scatter_single", None)
                         or _funcol.reduce_scatter_tensor)


def _all_gather_tensor(x, gather_dim, group, tag=""):
    """torch < 2.13: ``all_gather_single`` as 2.13 traces it (see the module docstring)."""
    import torch.distributed.distributed_c10d as c10d
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    res = _funcol.all_gather_tensor(x, 0, group, tag)
    if gather_dim == 0:
        return res
    group_size = c10d._get_group_size_by_name(_funcol._resolve_group_name(group, tag))
    res = res.wait() if isinstance(res, _funcol.AsyncCollectiveTensor) else res
    shape = list(res.shape)
    between = math.prod(shape[1:gather_dim]) if gather_dim > 1 else 1
    if guard_or_false(shape[0] == group_size) and guard_or_false(between == 1):
        return res.view([1] + shape[1:gather_dim] + [shape[0] * shape[gather_dim]]
                        + shape[gather_dim + 1:])
    return torch.cat(torch.chunk(res, group_size, dim=0), dim=gather_dim)


all_gather_single = getattr(_funcol, "all_gather_single", None) or _all_gather_tensor

__all__ = ["TORCH_VERSION", "all_gather_single", "reduce_scatter_single"]
