"""FlashOverlap's reduce-scatter rewrite: a ``ReduceScatterMatch``
(``reduce_scatter_match.py``) becomes this rank's Flash-RS schedule (ring or direct,
``runtime/flash_schedules.py``) or the sliced baseline (``runtime/sliced_schedules.py``),
traced into the graph (``splice.py``).

Matmul + reduce-scatter (row-parallel output; or the weight gradient ``dW = mm(t(dY), X)`` of
an FSDP-style parameter, DTensor's ``t(t(.))`` between, scattered on its rows), rank r of N::

    before:  out = wait(reduce_scatter(reshape(mm(h, W)), "sum"))
    after:   acc = mm(h[slice r-1], W); h0 = p2p_start(acc -> r+1, <- r-1); ...
             out = p2p_wait(h_last) + mm(h[slice r], W)

Why it is legal: a reduce-scatter of a matmul is the sum over ranks of each rank's partial for
each output slice; the ring adds the same partials in another order (equal up to float
summation order).

When the match found an attention whose query rows are the matmul's rows
(``match.attention``) and ``split_attention`` is on, the schedule computes that attention slice
by slice too (``attention_rewrite.py``). The matcher decided every other question (the layout, a
transposed product, a scaled addmm): a matched site is rewritten.
"""

from __future__ import annotations

import torch.fx as fx

from ..result import PassResult
from .attention_rewrite import rewrite_attention_reduce_scatter
from .reduce_scatter_match import ReduceScatterMatch
from .splice import (Unsupported, detach_metadata_readers, erase_if_dead, feed_moved_readers,
                     inline, trace)
from .vocabulary import RS_SITE, matmul_operands, node_val

__all__ = ["rewrite_reduce_scatter"]


def rewrite_reduce_scatter(gm: fx.GraphModule, match: ReduceScatterMatch, *,
                           chunks_per_rank: int, variant: str, overlap: str, chunks: int,
                           result: PassResult, split_attention: bool = False) -> bool:
    """Replace ``mm(A, B) -> [reshape, transpose, split+cat] -> wait(reduce_scatter(., "sum"))``
    with this rank's Flash-RS schedule (ring or direct), or the sliced baseline: output
    reduce-scatters (row-parallel) and weight-gradient reduce-scatters (``dW = mm(t(dY), X)``,
    FSDP-style) alike, scattered on the product's rows or columns. ``split_attention``: when
    ``A`` is an attention's output with its query rows along the scattered dim
    (``match.attention``), the schedule computes the attention slice by slice as well
    (``attention_rewrite.py``). Returns True: the matcher decided that the site can be rewritten."""
    site = match.reduce_scatter
    if match.terms:
        return _rewrite_sum_reduce_scatter(gm, match, chunks_per_rank=chunks_per_rank,
                                           variant=variant, overlap=overlap, chunks=chunks,
                                           result=result)
    bias, a, b = matmul_operands(match.matmul)
    transposed = match.transposed
    reduced_shape = tuple(node_val(match.reduced).shape)
    in_shape = list(reduced_shape[:-1]) + [node_val(a).shape[-1]]
    group, dim, m = match.group_name, match.scatter_dim, chunks_per_rank
    inputs = [a, b] + ([bias] if bias is not None else [])
    out_dtype = node_val(match.reduced).dtype if match.casts else None

    def schedule(a_, b_, *rest):
        h, w = (b_.t(), a_.t()) if transposed else (a_, b_)
        h = h.reshape(in_shape)  # symbolic sizes stay raw: bind_symbolic_sizes binds them
        return run(h, w, rest[0] if bias is not None else None)

    run = _rs_schedule(overlap, group_name=group, scatter_dim=dim, chunks=chunks,
                       variant=variant, chunks_per_rank=m, out_dtype=out_dtype)
    rows = match.attention
    if split_attention and match.attention_refused:
        result.notes.append(match.attention_refused)
    # (An attention an earlier site already split, the two reading one attention, is gone.)
    if split_attention and rows is not None and not getattr(rows.attention, "_erased", False):
        try:
            rewrite_attention_reduce_scatter(gm, match, rows, b, bias, tuple(in_shape), dim,
                                             run, result)
            return True
        except Unsupported as why:
            result.notes.append(f"{rows.attention.name} is not split by query: {why}; "
                                f"{site.name} is rewritten next to the projection alone")
    return _place_reduce_scatter(gm, match, schedule, inputs, [match.matmul], result)


def _rs_schedule(overlap: str, *, chunks: int, variant: str, chunks_per_rank: int, **fixed):
    """``run(h, w, bias)``: the runtime reduce-scatter schedule of ``overlap`` (the sliced
    baseline, or Flash-RS) with the options that apply to it."""
    from ...runtime.flash_schedules import flash_matmul_reduce_scatter
    from ...runtime.sliced_schedules import sliced_matmul_reduce_scatter

    if overlap == "slice":
        return lambda h, w, bias: sliced_matmul_reduce_scatter(h, w, chunks=chunks, bias=bias,
                                                               **fixed)
    return lambda h, w, bias: flash_matmul_reduce_scatter(
        h, w, variant=variant, chunks_per_rank=chunks_per_rank, bias=bias, **fixed)


def _place_reduce_scatter(gm: fx.GraphModule, match: ReduceScatterMatch, schedule,
                          inputs: list, products: list, result: PassResult) -> bool:
    """Trace ``schedule`` over ``inputs`` in front of the wait, hand its result to the readers
    of the scattered tensor (``match.scattered`` or the wait), and erase the collective and
    ``products`` (the matmuls and what lies between them and the collective)."""
    graph = gm.graph
    site = match.reduce_scatter
    scattered = match.scattered or match.wait
    sub = trace(schedule, inputs)
    (out,) = inline(graph, sub, inputs, match.wait, site.name)
    scattered.replace_all_uses_with(out)
    feed_moved_readers(graph, match, scattered, out)
    replaced = [scattered, match.wait, site, *match.reassembly, match.reduced, *match.via,
                *products]
    detach_metadata_readers(replaced)
    erase_if_dead(graph, replaced)
    result.rewrite(site, RS_SITE)
    return True


def _rewrite_sum_reduce_scatter(gm: fx.GraphModule, match: ReduceScatterMatch, *,
                                chunks_per_rank: int, variant: str, overlap: str, chunks: int,
                                result: PassResult) -> bool:
    """``reduce_scatter(mm_0 + mm_1 + ...)`` scattered on the products' rows, each term seen
    through reshapes of its leading dims: one schedule whose partials are the row slices of
    every term, summed in the original order (the input gradient of gate/up or Q/K/V
    projections that read one gathered input)::

        add(view(mm(dy1, w1t)), view(mm(dy3, w3t))) -> [split+cat] -> reduce_scatter -> wait
        =>  flash_matmul_reduce_scatter([dy1, dy3], [w1t, w3t], ...)

    Terms cast before the add (autocast, ``match.term_casts``): every term's partial product
    is cast to the sum's dtype before the partials are added (``term_dtype``), as the graph
    cast each whole product.
    """
    reduced_shape = tuple(node_val(match.reduced).shape)
    inputs, counts = [], []
    for matmul, _ in match.terms:
        bias, a, b = matmul_operands(matmul)  # (the matcher checked their layout)
        term = [a, b] + ([bias] if bias is not None else [])
        inputs += term
        counts.append(len(term))
    group, dim, m = match.group_name, match.scatter_dim, chunks_per_rank
    out_dtype = node_val(match.reduced).dtype if match.casts else None
    term_dtype = node_val(match.adds[0]).dtype if match.term_casts else None

    def schedule(*args):
        hs, ws, bs, at = [], [], [], 0
        for count in counts:
            a_, b_, *bias_ = args[at:at + count]
            at += count
            hs.append(a_.reshape([*reduced_shape[:-1], a_.shape[-1]]))
            ws.append(b_)
            bs.append(bias_[0] if bias_ else None)
        return run(hs, ws, bs)

    run = _rs_schedule(overlap, group_name=group, scatter_dim=dim, chunks=chunks,
                       variant=variant, chunks_per_rank=m, out_dtype=out_dtype,
                       term_dtype=term_dtype)
    products = [*match.adds, *(n for mm, via in match.terms for n in (mm, *via))]
    return _place_reduce_scatter(gm, match, schedule, inputs, products, result)
