"""Query-split attention in front of a reduce-scatter: part of the FlashOverlap pass
(``flash_overlap.py`` calls it for each matched ``matmul -> reduce_scatter`` site).

In a tensor + sequence parallel attention block the output projection is row-parallel: its
matmul reads the attention output (this rank's heads, every token) and a reduce-scatter over the
sequence follows. Flash-RS alone decomposes the reduce-scatter next to slices of that matmul,
which is small (one projection); the attention before it runs whole, and nothing is sent until it
ends. When the matmul's rows along the scattered dim are query rows of the attention, each slice
of the schedule can compute its own queries' attention as well: the schedule's compute per hop
grows by the attention's share, and the first partial is sent after 1/N of the attention::

    before:  o, lse = attention(q, k, v); h = reshape(permute(o))
             out = wait(reduce_scatter(mm(h, W), "sum", dim=sequence))
    after:   rows(j) = reshape(permute(attention(q[:, :, slice j], k, v)[0]))
             out = flash_matmul_reduce_scatter(rows, W)      # rows computed slice by slice
             o, lse = cat(the slices' outputs)               # what the backward saves

Legal because every query row attends to all keys and values on its own: a slice of queries
gives those rows of the output (and of the log-sum-exp); without a causal mask the attention's
FLOPs are unchanged (every slice reads the keys and values whole). With ``is_causal`` (queries
and keys of one length) a slice reads the keys up to its last query: the first slice runs the
kernel's own causal mask, the others their rows of it as an additive mask (0 or -inf).

Numerically, the CPU kernel blocks its work by the number of queries (and keys) it is given, so
a slice's rows can differ from the whole attention's in the last bits: measured here bitwise
when a slice holds whole sequences, and up to 3.9e-6 of a gradient's scale on 4 ranks with
half-sequence slices (float tolerance, as for the projection's matmul on fewer rows).

Refused, with the reason in the pass's notes (the reduce-scatter is then rewritten next to the
projection alone): dropout (other masks per slice), an attention mask, ``is_causal`` with
unequal query and key lengths, attention kernels other than the CPU flash kernel (the one this
project can test), and layouts between the attention and the matmul that do not keep query rows
whole along the scattered dim. With ``CompileOptions(attention_split=False)`` the site is
Flash-RS on the projection alone (the comparison ``leancompile bench overlap --case attention``
prints).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .flash_all_to_all import LAYOUT, replay
from .flash_graph import (SITE_META, Unsupported, detach_metadata_readers, erase_if_dead,
                          feed_moved_readers, inline, node_val, not_scattered, trace,
                          users_before)
from .flash_overlap_match import RESHAPES, Skip, reshape_groups, shape_of

aten = torch.ops.aten
_LAYOUT_TARGETS = LAYOUT + (aten.transpose.int,)  # (graphs traced without decompositions)
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default

__all__ = ["ATTENTION", "ATTENTION_RS_SITE", "AttentionRowsMatch", "match_attention_rows",
           "rewrite_attention_reduce_scatter"]


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
    its last query, the first slice with the kernel's own causal mask, the others with the
    slice's part of it as an additive mask."""


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


def rewrite_attention_reduce_scatter(gm: fx.GraphModule, match, rows: AttentionRowsMatch,
                                     w: fx.Node, bias: fx.Node | None, shape: tuple, dim: int,
                                     run, result) -> None:
    """Replace ``attention -> chain -> mm(h, w) -> reduce_scatter`` of ``match`` by ``run`` (a
    reduce-scatter schedule, ``run(h, w, bias)``) over ``AttentionRows``; the attention's
    outputs that other nodes read (the backward's saved output and log-sum-exp) are the
    slices' outputs put together. ``Unsupported`` (nothing changed) when a reader of the
    attention's outputs before the collective cannot move after the schedule."""
    from ..runtime.flash_schedules import AttentionRows

    graph = gm.graph
    site, attention = match.reduce_scatter, rows.attention
    getitems = {u.args[1]: u for u in attention.users if u.target is operator.getitem}
    product = {match.matmul, *match.via, match.reduced, *match.reassembly, site, match.wait}
    if match.scattered is not None:
        product.add(match.scattered)
    why = not_scattered(match)
    if why:
        raise Unsupported(why)
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = match.wait
    # Readers of the attention's outputs before the collective move after the schedule.
    late = users_before([u for g in getitems.values() for u in g.users], anchor, order,
                        stop=product, what="the attention output")
    for node in (w, bias):  # what the schedule reads besides the attention, not moved
        if node is not None and node in late:
            raise Unsupported(f"{node.name} feeds the matmul and reads the attention output")
    doomed = product | set(rows.nodes)

    def needed(node) -> bool:  # read by a node that stays after the rewrite
        return any(u not in doomed or (u in rows.nodes and needed(u)) for u in node.users)

    likes = [node_val(getitems[i]) if i in getitems and needed(getitems[i]) else None
             for i in range(len(node_val(attention)))]
    q, k, v = attention.args[:3]
    rest, kwargs = tuple(attention.args[3:]), dict(attention.kwargs)
    seq = shape_of(q)[2]

    def chain(x, ql):  # the layout ops on a slice of ql queries
        return replay(rows.chain, rows.dims, seq // ql, x)
    inputs = [q, k, v, w] + ([bias] if bias is not None else [])

    def schedule(q_, k_, v_, w_, *b_):
        h = AttentionRows(attention.target, q_, k_, v_, rest, kwargs, chain, shape, dim,
                          merged=rows.merged, causal=rows.causal)
        out = run(h, w_, b_[0] if b_ else None)
        return (out, *h.assembled(likes))

    sub = trace(schedule, inputs)
    out, *full = inline(graph, sub, inputs, anchor, site.name)
    for node in late:  # after the schedule, in their order
        anchor.prepend(node)
    it = iter(full)
    for i, like in enumerate(likes):
        if like is not None:
            getitems[i].replace_all_uses_with(next(it))
    scattered = match.scattered or match.wait
    scattered.replace_all_uses_with(out)
    feed_moved_readers(graph, match, scattered, out)
    replaced = [scattered, match.wait, site, *match.reassembly, match.reduced, *match.via,
                match.matmul]
    detach_metadata_readers([*replaced, *rows.nodes, *getitems.values()])
    for nodes in (replaced, rows.nodes, getitems.values(), [attention]):  # readers first
        erase_if_dead(graph, nodes)
    if not getattr(attention, "_erased", False):
        raise AssertionError(f"{attention.name} is still read after the rewrite")
    result.rewrite(site, ATTENTION_RS_SITE)
    result.notes.append(f"{attention.name} is split by query inside the schedule of "
                        f"{site.name}")
    for node in full:
        node.meta[SITE_META] = site.name


ATTENTION_RS_SITE = "attention+matmul+reduce_scatter"
"""The report's kind for an attention split by query inside a reduce-scatter schedule."""
