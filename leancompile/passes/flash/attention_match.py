"""FlashOverlap's attention-rows matcher: whether the rows of a reduce-scatter's matmul are the
query rows of an attention, so the schedule can compute that attention slice by slice too
(``attention_rewrite.py`` rewrites it; its docstring has the graph before and after).

``match_attention_rows`` follows the matmul's input back through layout ops to the attention's
output: None when it does not come from an attention, ``Skip`` with the reason when it does but
cannot be split by query (dropout, a mask, ``is_causal`` with unequal query and key lengths, an
attention kernel other than the CPU flash kernel, a layout that mixes query rows with other dims
along the scattered dim); the reduce-scatter matcher keeps that reason as the site's note.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .vocabulary import LAYOUT, RESHAPES, Skip, reshape_groups, shape_of

__all__ = ["ATTENTION", "AttentionRowsMatch", "match_attention_rows"]

aten = torch.ops.aten
_LAYOUT_TARGETS = LAYOUT + (aten.transpose.int,)  # (graphs traced without decompositions)
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default


@dataclasses.dataclass(frozen=True)
class AttentionRowsMatch:
    """The matmul operand ``h`` is ``reshape(chain(attention(...)[0]))``: ``chain`` the layout
    ops kept (up to the last one that is not a reshape; ``dims``: where the query rows are
    after each), ``nodes`` every node from the attention's output to ``h``."""

    attention: fx.Node
    chain: tuple[fx.Node, ...]
    dims: tuple[int, ...]
    nodes: tuple[fx.Node, ...]
    merged: bool = False
    """The scattered dim holds (batch, query) pairs, batch-major (``[B*S, ...]`` rows)."""
    causal: bool = False
    """``is_causal=True`` (queries and keys of one length): a slice attends to the keys up to
    its last query, through its rows of the causal mask as an additive mask, over the whole
    attention's blocks of keys (``runtime/attention_rows.slice_keys``)."""


def match_attention_rows(h: fx.Node, shape: tuple, dim: int, slices: int
                         ) -> AttentionRowsMatch | None:
    """The attention whose query rows are the rows of ``h`` (viewed as ``shape``) along
    ``dim``, cut into ``slices`` equal slices; None when ``h`` does not come from an
    attention's output through layout ops; ``Skip`` with the reason when it does but cannot
    be split."""
    nodes, node = [], h
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            node.target in _LAYOUT_TARGETS:
        nodes.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and
            node.args[1] == 0 and isinstance(node.args[0], fx.Node)):
        return None
    attention = node.args[0]
    wrapped = attention.target is operator.getitem and attention.args[1] == 1 and \
        isinstance(attention.args[0], fx.Node) and \
        attention.args[0].target is torch.ops.higher_order.run_and_save_rng_state
    if wrapped and attention.args[0].args[0] is ATTENTION:
        skip = Skip("the attention runs inside activation checkpointing's generator-state "
                    "wrapper (run_and_save_rng_state, kept for the backward's recompute)")
        skip.node = attention.args[0]
        raise skip
    name = str(attention.target)
    if attention.target is not ATTENTION and ("scaled_dot_product" not in name or
                                              "backward" in name):
        return None  # not an attention's output (a backward's gradients are not split here)
    nodes.reverse()
    try:
        return _match(attention, nodes, shape, dim, slices)
    except Skip as skip:
        skip.node = attention
        raise


def _match(attention: fx.Node, nodes: list, shape: tuple, dim: int, slices: int
           ) -> AttentionRowsMatch:
    if attention.target is not ATTENTION:
        raise Skip(f"the matmul reads {attention.target}, which is not split by query: the "
                   "rewrite handles _scaled_dot_product_flash_attention_for_cpu (the attention "
                   "kernel this project can test)")
    if attention.kwargs.get("attn_mask") is not None:
        raise Skip("an attention mask: slicing it by query rows is not implemented")
    if any(isinstance(a, fx.Node) for a in (*attention.args[3:], *attention.kwargs.values())):
        raise Skip("an attention argument other than query, key and value is computed in the "
                   "graph")
    args = list(attention.args) + [None] * 4
    if args[3]:
        raise Skip(f"attention with dropout_p={args[3]}: query slices would draw other masks")
    causal = bool(args[4] or attention.kwargs.get("is_causal"))
    if causal and shape_of(attention.args[0])[2:3] != shape_of(attention.args[1])[2:3]:
        raise Skip("is_causal=True with fewer or more keys than queries: the slices' masks "
                   "are not followed")
    query = shape_of(attention.args[0])
    if len(query) != 4 or not all(isinstance(x, int) for x in (*query, *shape)):
        raise Skip(f"query of shape {query}, rows of shape {shape}: query split needs a static "
                   "[batch, heads, sequence, head_dim] query")
    keep = len(nodes)
    while keep and nodes[keep - 1].target in RESHAPES:  # h's own reshape replaces these
        keep -= 1
    chain = nodes[:keep]
    dims, at, batch = [], 2, 0  # where the query rows and the batch are
    for node in chain:
        at = _follow(node, at)
        try:  # the batch matters only when it merges with the queries (flat rows)
            batch = None if batch is None else _follow(node, batch)
        except Skip:
            batch = None
        dims.append(at)
    src = shape_of(chain[-1]) if chain else query
    groups = reshape_groups(tuple(src), tuple(shape))
    if groups is None:
        raise Skip(f"the attention output's layout {tuple(src)} -> {tuple(shape)} is not a "
                   "reshape of whole dims")
    src_dims, dst_dims = next(g for g in groups if at in g[0])
    if [d for d in dst_dims if shape[d] != 1] != [dim]:
        raise Skip(f"the query rows (dim {at} of {tuple(src)}) are not in the scattered dim "
                   f"{dim} of the matmul's rows {tuple(shape)}: the slices would mix queries")
    seq = query[2]
    merged = batch is not None and [d for d in src_dims if src[d] != 1] == [batch, at]
    if merged:  # rows = (batch, query) pairs, batch-major: a slice is whole batches or a part
        if any(n.target in RESHAPES for n in chain):  # of one batch's queries
            raise Skip("the batch and the query rows merge into the scattered dim after a "
                       "reshape of the attention output: not followed")
        length = shape[dim] // slices
        if shape[dim] % slices or (length % seq and seq % length):
            raise Skip(f"{shape[dim]} (batch, query) rows in {slices} slices do not cut into "
                       f"whole batches or equal parts of one batch's {seq} queries",
                       local="shape")
    elif [d for d in src_dims if src[d] != 1] != [at]:
        raise Skip(f"the query rows (dim {at} of {tuple(src)}) merge with another dim into the "
                   f"scattered dim of {tuple(shape)}: the slices would mix queries")
    elif seq % slices:
        raise Skip(f"{seq} queries do not split into {slices} slices", local="shape")
    return AttentionRowsMatch(attention, tuple(chain), tuple(dims), tuple(nodes), merged,
                              causal)


def _follow(node: fx.Node, dim: int) -> int:
    """Where dim ``dim`` of ``node``'s input (the query rows, the batch) is in its output."""
    src, dst = shape_of(node.args[0]), shape_of(node)
    if node.target is aten.permute.default:
        perm = [p % len(dst) for p in node.args[1]]
        return perm.index(dim)
    if node.target is aten.transpose.int:
        a, b = (x % len(dst) for x in node.args[1:3])
        return b if dim == a else a if dim == b else dim
    if node.target in RESHAPES:
        groups = reshape_groups(tuple(src), tuple(dst))
        if groups is None:
            raise Skip(f"{node.name} {tuple(src)} -> {tuple(dst)} is not a reshape of whole "
                       "dims")
        src_dims, dst_dims = next(g for g in groups if dim in g[0])
        kept = [d for d in dst_dims if dst[d] != 1]
        if len(src_dims) != 1 or len(kept) != 1:
            raise Skip(f"{node.name} {tuple(src)} -> {tuple(dst)} merges or splits the query "
                       "rows with another dim")
        return kept[0]
    if node.target in (aten.clone.default, aten.alias.default):
        return dim
    raise Skip(f"{node.name} ({node.target}) between the attention and the matmul")
