"""Reweight's per-sample gradient buffers, accumulated by the backward graph itself.

Reweight keeps one gradient buffer per sample (the paper's ``G_i``) and adds each trained
step's per-row gradients into it. Done after the graph, every step writes a fresh
``[rows, *param.shape]`` gradient per parameter and then reads it again to add it into the
buffers: for a weight matrix that is two extra passes over ``rows x params`` bytes per step,
the largest memory traffic of the schedule on a CPU. :func:`accumulating` rewrites the vmapped
row backward (``LeanStep``'s ``rows_backward`` graph) so that the buffers are graph inputs and
every gradient is added into its buffer where it is produced: a weight gradient that is a
batched matmul seen through views becomes an in-place ``baddbmm_`` into the buffer (the
matmul adds into the buffer as it writes, no intermediate), any other gradient an ``add_``.

Before (``rows`` rows; ``grad_w``: ``[rows, out, in]``)::

    def rows_backward(saved_0, ..., shared_0, ...):
        ...
        bmm = aten.bmm(dy_t, x)                      # [rows, out, in]
        grad_w = aten.permute(aten.permute(bmm, [0, 2, 1]), [0, 2, 1])
        grad_b = aten.view(aten.sum(dy, [1], True), [rows, out])
        return (grad_w, grad_b)

After (``buf_*``: contiguous ``[rows, *param.shape]``, one per output, updated in place)::

    def rows_backward(saved_0, ..., shared_0, ..., buf_0, buf_1):
        ...
        aten.baddbmm_(aten.view(buf_0, [rows, out, in]), dy_t, x)
        aten.add_(buf_1, aten.view(aten.sum(dy, [1], True), [rows, out]))
        return ()

The in-place matmul is taken only where it is exact: the gradient is a view chain (view,
permute, transpose, squeeze, unsqueeze: no copy, no offset) of a contiguous ``bmm`` used by
nothing else, and contiguous itself, so the buffer and the ``bmm`` output hold the same
elements in the same order. Same products, one more addend in each sum: within rounding of
adding afterwards (``baddbmm`` adds the buffer once to each finished dot product).
"""

from __future__ import annotations

import torch
from torch import fx

from .fx_values import node_val

__all__ = ["accumulating"]

_aten = torch.ops.aten
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.permute.default,
          _aten.transpose.int, _aten.t.default, _aten.squeeze.dim, _aten.squeeze.dims,
          _aten.unsqueeze.default}


def _matmul_under_views(node: fx.Node) -> fx.Node | None:
    """The ``bmm`` whose output ``node`` is, seen through copy-free views (each used once),
    when both are contiguous; else None."""
    out = node_val(node)
    if not isinstance(out, torch.Tensor) or not out.is_contiguous() or len(node.users) != 1:
        return None
    cur = node
    while cur.op == "call_function" and cur.target in _VIEWS:
        src = cur.args[0]
        if not isinstance(src, fx.Node) or len(src.users) != 1:
            return None
        cur = src
    if cur is node or cur.op != "call_function" or cur.target is not _aten.bmm.default:
        return None
    val = node_val(cur)
    if not isinstance(val, torch.Tensor) or not val.is_contiguous() or \
            val.numel() != out.numel() or val.dtype != out.dtype:
        return None
    return cur


def accumulating(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` (a graph returning a flat tuple of tensors or None) that takes one more
    input per output, a contiguous buffer of that output's shape and dtype (None where the
    output is None), adds each output into its buffer in place and returns nothing. Returns
    the graph and how many outputs became in-place matmuls (module docstring)."""
    graph = fx.Graph()
    env: dict = {}
    out_args = None
    for node in gm.graph.nodes:
        if node.op == "output":
            out_args = node.args[0]
            break
        env[node] = graph.node_copy(node, lambda n: env[n])
    outs = list(out_args) if isinstance(out_args, (tuple, list)) else [out_args]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        bufs = []
        for i in reversed(range(len(outs))):
            bufs.append(graph.placeholder(f"buf_{i}"))
        bufs.reverse()
    fused = 0
    for out, buf in zip(outs, bufs):
        if out is None:
            continue
        mm = _matmul_under_views(out)  # decided on the original graph, where it is an output
        if mm is not None:
            shape = list(node_val(mm).shape)
            view = graph.call_function(_aten.view.default, (buf, shape))
            acc = graph.call_function(_aten.baddbmm_.default,
                                      (view, env[mm.args[0]], env[mm.args[1]]))
            acc.meta["val"] = node_val(mm)
            fused += 1
        else:
            graph.call_function(_aten.add_.Tensor, (buf, env[out]))
    graph.output(())
    graph.eliminate_dead_code()
    result = fx.GraphModule(gm, graph)
    return result, fused
