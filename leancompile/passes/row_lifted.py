"""The batch held in dim 1 for a while (``Lifted``): classifier-free guidance's doubling of
the latents and sequence parallelism's all-to-alls move it there and back. What an op reading
such a tensor gives (``lifted_layout``) is one part of the row-layout analysis
(``row_layout.py``, ``row_walk.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..runtime.fx_values import node_val
from .aten_ops import RESHAPES, TRANSPOSES, node_arg, norm_dim
from .row_groups import collective_ops, same_rows_groups
from .row_rules import SPLIT_LIKE, op_label, permutation
from .row_types import Mixed, RowLayout, has_symbol, size_expr, static_size

__all__ = ["Lifted", "lifted_layout"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Lifted:
    """A tensor with ``blocks`` (a size without the batch) in dim 0 and rows laid out as
    ``base`` in dim 1. Two spellings make one:

    - ``x.unsqueeze(0)`` on the way to ``cat([x, x])`` as decompositions spell it
      (``unsqueeze(x, 0) -> expand(k, ...) -> clone -> view(k * dim0, ...)``, e.g.
      classifier-free guidance doubling the latents);
    - a permute that moves the batch to dim 1 behind a dim of pieces, on the way to a
      collective over dim 0 and back: Ulysses sequence parallelism's
      ``[B, S/N, N, H/N, D] -> [N, B, S/N, H/N, D] -> all_to_all -> permute back``, and the
      gather of the output tokens (``movedim(1, 0) -> all_gather -> chunk, cat -> movedim``).

    What may read it keeps the rows in dim 1: an expand of dim 0, a clone; a collective over
    dim 0 (all-to-all, all-gather, their wait), a split, slice or cat along dim 0 (``blocks``
    changes); a permute that keeps dims 0 and 1, or brings dim 1 back to dim 0 (``base``
    again), and so does a select or unbind of dim 0 (a one-projection attention's
    ``qkv.permute(2, 0, 3, 1, 4).unbind(0)``); a view that merges dims 0 and 1
    (``RowLayout(blocks * base.outer, base.inner)``).
    Anything else is ``Mixed``, and so is a graph output or saved tensor left in this layout.

    A collective is row by row only when every rank of its group holds the same rows in the
    same order, as the ranks of a sequence-parallel group do (they run the same samples on
    their own tokens; ``declare_same_rows``); the per-row backward then exchanges each row's
    pieces with the same row of the other ranks, as the whole-batch backward does. A
    collective over another group, or over a tensor with the batch in dim 0, is ``Mixed``."""

    blocks: object
    """An int, or a sympy expression without the batch symbol."""
    base: RowLayout



def lifted_layout(node: fx.Node, source: fx.Node, count: int, state: dict, symbol):
    """The layout of an op reading a ``Lifted`` tensor (``source``; ``count``: the op's tensor
    inputs), from the layouts found so far (``state``)."""
    lay, src, val = state[source], node_val(source), node_val(node)
    target = node.target
    outside = Mixed(f"{op_label(node)}: the batch is outside dim 0 (shape {tuple(src.shape)})")
    same = (lambda a, b: len(a) == len(b) and all(
        sympy.simplify(size_expr(x) - size_expr(y)) == 0 for x, y in zip(a, b)))
    exchanges, waits = collective_ops()
    if target in SPLIT_LIKE and count == 1 and isinstance(val, (tuple, list)):
        dim = norm_dim(node_arg(node, 1, "dim", 0) if target is aten.unbind.int
                    else node_arg(node, 2, "dim", 0), src.dim())
        if dim == 1:
            return outside
        if target is aten.unbind.int:  # of dim 0: the rows back in dim 0; of a later dim:
            return tuple(lay.base if dim == 0 else lay for _ in val)  # still in dim 1
        return tuple(Lifted(static_size(v.shape[0]) if dim == 0 else lay.blocks, lay.base)
                     for v in val)
    if target is aten.cat.default:
        tensors = list(node.args[0])
        layouts = [state.get(t) for t in tensors]
        if norm_dim(node_arg(node, 1, "dim", 0), src.dim()) == 0 and all(
                isinstance(other, Lifted) and other.base == lay.base and
                same(node_val(t).shape[1:], src.shape[1:]) for t, other in zip(tensors, layouts)):
            return Lifted(static_size(val.shape[0]), lay.base)
        return outside
    if count != 1 or not isinstance(val, torch.Tensor):
        return outside
    if target is aten.expand.default:
        if not has_symbol(val.shape[0], symbol) and same(val.shape[1:], src.shape[1:]):
            return Lifted(static_size(val.shape[0]), lay.base)
        return outside
    if target in (aten.clone.default, aten.contiguous.default) or target in waits:
        return lay
    if target is aten.select.int and norm_dim(node.args[1], src.dim()) == 0:
        # One block: the rows come back to dim 0 (``q, k, v = qkv.permute(2, 0, 3, 1, 4)``,
        # then ``qkv[0]`` or ``unbind(0)``, an attention with one projection for all three).
        return lay.base
    if target in exchanges and node_arg(node, exchanges[target], "group_name") not in \
            same_rows_groups():
        return Mixed(f"{op_label(node)}: a collective over a group not declared to hold the "
                     "same samples on every rank (declare_same_rows)")
    if target in exchanges or (target is aten.slice.Tensor and norm_dim(
            node_arg(node, 1, "dim", 0), src.dim()) == 0):
        # Whole pieces of dim 0 move (between ranks that hold the same rows, or out of a
        # slice); dim 1 stays.
        return Lifted(static_size(val.shape[0]), lay.base) if same(
            val.shape[1:], src.shape[1:]) else outside
    if target in TRANSPOSES:
        order = permutation(node)
        if order[0] == 1 and not any(has_symbol(d, symbol) for d in val.shape[1:]):
            return lay.base
        return lay if order[:2] == [0, 1] else outside
    if target in RESHAPES and val.dim() == src.dim() - 1 and \
            isinstance(lay.blocks, int) and same(val.shape[1:], src.shape[2:]) and \
            sympy.simplify(size_expr(val.shape[0]) - lay.blocks * size_expr(src.shape[1])) == 0:
        return RowLayout(lay.blocks * lay.base.outer, lay.base.inner)
    return outside
