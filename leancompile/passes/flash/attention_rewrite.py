"""Query-split attention in front of a reduce-scatter: part of the FlashOverlap pass
(``reduce_scatter_rewrite.py`` calls it for a matched ``matmul -> reduce_scatter`` site whose
match holds the attention, ``attention_match.py``).

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
and keys of one length) a slice attends to the keys up to its last query through its rows of the
causal mask as an additive mask (0 or -inf), handed the whole attention's blocks of keys (all of
them up to 512; ``runtime/attention_rows.slice_keys``): the CPU kernel's result for a row
depends on how many keys it is handed, and with the same blocks a causal slice's rows are
bitwise the whole attention's.

Numerically, the CPU kernel blocks its work by the number of queries (and keys) it is given, so
a slice's rows can differ from the whole attention's in the last bits: measured here bitwise
when a slice holds whole sequences, and up to 3.9e-6 of a gradient's scale on 4 ranks with
half-sequence slices (float tolerance, as for the projection's matmul on fewer rows).

Refused by the matcher, with the reason in the pass's notes (the reduce-scatter is then
rewritten next to the projection alone): dropout (other masks per slice), an attention mask,
``is_causal`` with unequal query and key lengths, attention kernels other than the CPU flash
kernel (the one this project can test), and layouts between the attention and the matmul that
do not keep query rows whole along the scattered dim. Here, a reader of the attention's outputs
that cannot move after the schedule (``Unsupported``) also leaves the projection alone. With
``CompileOptions(attention_split=False)`` the site is Flash-RS on the projection alone (the
comparison ``leancompile bench overlap --case attention`` prints).
"""

from __future__ import annotations

from __future__ import annotations

import operator

import torch.fx as fx

from .attention_match import AttentionRowsMatch
from .splice import (SITE_META, Unsupported, detach_metadata_readers, erase_if_dead,
                     feed_moved_readers, inline, replay, trace, users_before)
from .vocabulary import ATTENTION_RS_SITE, node_val, shape_of

__all__ = ["rewrite_attention_reduce_scatter"]


def rewrite_attention_reduce_scatter(gm: fx.GraphModule, match, rows: AttentionRowsMatch,
                                     w: fx.Node, bias: fx.Node | None, shape: tuple, dim: int,
                                     run, result) -> None:
    """Replace ``attention -> chain -> mm(h, w) -> reduce_scatter`` of ``match`` by ``run`` (a
    reduce-scatter schedule, ``run(h, w, bias)``) over ``AttentionRows``; the attention's
    outputs that other nodes read (the backward's saved output and log-sum-exp) are the
    slices' outputs put together. ``Unsupported`` (nothing changed) when a reader of the
    attention's outputs before the collective cannot move after the schedule."""
    from ...runtime.attention_rows import AttentionRows

    graph = gm.graph
    site, attention = match.reduce_scatter, rows.attention
    getitems = {u.args[1]: u for u in attention.users if u.target is operator.getitem}
    product = {match.matmul, *match.via, match.reduced, *match.reassembly, site, match.wait}
    if match.scattered is not None:
        product.add(match.scattered)
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
