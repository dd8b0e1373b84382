"""Facts about a captured step's graphs that its runtime reads: output shapes and per-row sizes,
saved values at given sizes, the strides the forward gave a saved value, and Dynamo sources as
a user names them."""

from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch import Tensor

from ..capture import StepGraphs
from ..runtime.reuse import gather_rows, rows_per_sample

__all__ = ["readable", "empty_outputs", "batch_independent", "cotangent_rows", "saved_size",
           "as_traced", "restrided", "traced_stride", "sizes_of", "concrete_size", "SLICES",
           "row_shape", "output_val", "output_shape", "numel_per_row"]


def readable(source: str) -> str:
    """A Dynamo source as a user names it: ``L['self']._modules['fc']._parameters['weight']``
    -> ``self.fc.weight``."""
    text = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", source)
    text = re.sub(r"^G\['__import_[^']*'\]\.", "", text)
    text = re.sub(r"^[LG]\['([^']*)'\]", r"\1", text)
    # (the wrapper's own entry passes the user's function as fn, and keywords as kwargs)
    text = re.sub(r"^fn\.__closure__\[\d+\]\.cell_contents\.", "", text)
    return re.sub(r"^kwargs\['([^']*)'\]", r"\1", text)


def empty_outputs(g: StepGraphs) -> list:
    graph = g.forward if g.forward is not None else g.inference
    outs = next(n for n in graph.graph.nodes if n.op == "output").args[0][:g.num_outputs]
    hint = {}
    if g.batch_symbol is not None:
        hint = {g.batch_symbol: None}

    def make(node):
        val = node.meta.get("val") if isinstance(node, fx.Node) else node
        if not isinstance(val, Tensor):
            return val
        shape = [int(d.node.hint) if isinstance(d, torch.SymInt) else d for d in val.shape]
        return torch.empty(shape, dtype=val.dtype, device=val.device)

    del hint
    return [make(o) for o in outs]


def batch_independent(layouts, j) -> bool:
    """Output ``j`` does not depend on the batch (the LeanGRPO stage's layout ``None``)."""
    return layouts is not None and j < len(layouts) and layouts[j] is None


def cotangent_rows(c, layouts, j, batch, rows):
    """The cotangent of output ``j`` for ``rows`` of the update call (in that order)."""
    if c is None or layouts is None:
        return c
    layout = layouts[j] if j < len(layouts) else None
    if layout is None or layout == "symint" or rows == list(range(batch)):
        return c
    return gather_rows([(c, batch, rows)], layout.outer, layout.inner)


def saved_size(g: StepGraphs, k: int, symbols: dict) -> int:
    """Saved value ``k`` (a size) for the sizes ``symbols`` (symbol -> int)."""
    expr = g.saved_meta[k]
    return int(expr.node.expr.subs(symbols) if isinstance(expr, torch.SymInt) else expr)


def as_traced(tensor: Tensor, meta, symbols: dict) -> Tensor:
    """``tensor`` (gathered rows, a cotangent) laid out with the strides the graph was traced
    with for ``meta`` (a fake tensor with symbolic sizes) at the sizes ``symbols``: a compiled
    backward (Inductor's) assumes its inputs have those strides (attention's ``[B, H, S, D]``
    views of ``[B, S, H, D]`` buffers, its logsumexp, a permuted output's tangent) and asserts
    them. ``tensor`` itself when it has them already."""
    if not isinstance(meta, Tensor):
        return tensor
    return restrided(tensor, traced_stride(meta, symbols))


def restrided(tensor: Tensor, stride: tuple[int, ...]) -> Tensor:
    """``tensor``'s values with strides ``stride`` (``tensor`` itself when it has them)."""
    if stride == tensor.stride():
        return tensor
    out = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def traced_stride(meta: Tensor, symbols: dict) -> tuple[int, ...]:
    """The strides ``meta`` (a fake tensor with symbolic sizes) was traced with, at the sizes
    ``symbols``."""
    return tuple(concrete_size(d, symbols) for d in meta.stride())


def sizes_of(meta, tensor: Tensor) -> dict:
    """{symbol: size} for the dims of ``meta`` (a fake tensor with symbolic sizes) that are a
    symbol alone, read from ``tensor``'s shape."""
    if not isinstance(meta, Tensor) or meta.dim() != tensor.dim():
        return {}
    return {d.node.expr: int(n) for d, n in zip(meta.shape, tensor.shape)
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol}


def concrete_size(size, symbols: dict) -> int:
    """A traced size at the sizes ``symbols`` (symbol -> int; other symbols at their hint)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    free = {s: symbols[s] for s in expr.free_symbols if s in symbols}
    value = expr.subs(free)
    if value.is_number:
        return int(value)
    hints = size.node.shape_env.backed_var_to_val
    return int(value.subs({s: hints[s] for s in value.free_symbols if s in hints}))


SLICES = {torch.ops.aten.slice.Tensor: 3, torch.ops.aten.slice_scatter.default: 4}
"""Slicing ops and the position of their ``end`` argument."""


def row_shape(output: Tensor, layout, batch: int) -> tuple:
    """The shape of one row's share of ``output`` (all of it when it holds no rows)."""
    if layout is None or layout == "symint" or not hasattr(layout, "outer"):
        return tuple(output.shape)
    return (layout.outer * rows_per_sample(layout.inner, [output], layout.outer, [batch]),
            *output.shape[1:])


def output_val(g: StepGraphs, j: int):
    graph = g.forward if g.forward is not None else g.inference
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0][j]
    return out.meta.get("val") if isinstance(out, fx.Node) else out


def output_shape(g: StepGraphs, j: int):
    val = output_val(g, j)
    return tuple(val.shape) if isinstance(val, Tensor) else ()


def numel_per_row(g: StepGraphs, j: int, batch: int):
    """1 when output ``j`` holds one value per sample (``[s]`` or ``[s, 1]``; for a graph with
    a static batch, ``[batch]`` or ``[batch, 1]``)."""
    val = output_val(g, j)
    if not isinstance(val, Tensor) or val.dim() == 0:
        return None
    first = val.shape[0]
    if g.batch_symbol is None:
        if first != batch:
            return None
    elif not (isinstance(first, torch.SymInt) and first.node.expr == g.batch_symbol):
        return None
    rest = 1
    for d in val.shape[1:]:
        if not isinstance(d, int):
            return None
        rest *= d
    return rest
