"""FlashOverlap: all-gather -> matmul and matmul -> reduce-scatter sites become per-rank P2P
schedules interleaved with per-slice matmuls.

The sites come from ``flash_overlap_match`` (every collective it leaves alone is already in
the result with its reason). Each rewrite traces the runtime schedule of this rank
(``leancompile.runtime.flash_schedules``) into the graph, so every P2P step and every slice's
matmul is a node: visible in ``explain``, kept by dead-code elimination, left where it is by
Inductor's own collective reordering.

All-gather + matmul (column-parallel), rank r of N::

    before:  g = wait(all_gather(x_r)); y = mm(reshape(g), W)
    after:   y_r = mm(x_r, W); h0 = p2p_start(x_r -> r+1, <- r-1); ...
             x_{r-1} = p2p_wait(h0); y_{r-1} = mm(x_{r-1}, W); ...; y = cat(...)

Matmul + reduce-scatter (row-parallel)::

    before:  out = wait(reduce_scatter(reshape(mm(h, W)), "sum"))
    after:   acc = mm(h[slice r-1], W); h0 = p2p_start(acc -> r+1, <- r-1); ...
             out = p2p_wait(h_last) + mm(h[slice r], W)

Why it is legal: an all-gather followed by a matmul that slices the gathered dim (rows of the
output) computes each output slice from one input slice, in any order; the schedule computes
the same slices with the same matmul on the same rows (bitwise for all-gather sites). A
reduce-scatter of a matmul is the sum over ranks of each rank's partial for each output slice;
the ring adds the same partials in another order (equal up to float summation order).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx

from .flash_overlap_match import (AG_SITE, RS_SITE, AllGatherMatch, ReduceScatterMatch,
                                  find_all_gather_matches, find_reduce_scatter_matches)
from .result import PassResult

__all__ = ["flash_overlap_pass", "rewrite_all_gather", "rewrite_reduce_scatter", "NAME",
           "VERSION"]

log = logging.getLogger("leancompile")

NAME = "flash_overlap"
VERSION = 1

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_MATMULS = (aten.mm.default, aten.addmm.default)


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _operands(mm: fx.Node):
    """(bias or None, A, B) of an mm/addmm node."""
    if mm.target is aten.addmm.default:
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            return None
        return mm.args[0], mm.args[1], mm.args[2]
    return None, mm.args[0], mm.args[1]


def _trace(fn, inputs: list[fx.Node]) -> fx.GraphModule:
    """``fn`` over the fake values of ``inputs``, traced to aten (with Inductor's
    decompositions, like the graph it goes into)."""
    from torch._inductor.pattern_matcher import fwd_only

    return fwd_only(fn, [_val(n) for n in inputs])


def _inline(graph: fx.Graph, sub: fx.GraphModule, inputs: list[fx.Node], before: fx.Node):
    """Copy ``sub``'s nodes into ``graph`` before ``before``, its placeholders bound to
    ``inputs``; returns the copied output values (a list)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    val_map = dict(zip(placeholders, inputs))
    with graph.inserting_before(before):
        out = graph.graph_copy(sub.graph, val_map)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _hoist(node: fx.Node, anchor: fx.Node, order: dict) -> None:
    """Move ``node`` (and what it needs) before ``anchor`` if it comes after it. Only pure
    nodes are moved (the weights' transposes, reshapes)."""
    if not isinstance(node, fx.Node) or order[node] < order[anchor]:
        return
    if node.op != "call_function" or node.is_impure():
        raise _Unsupported(f"{node.name} is needed before {anchor.name} but cannot be moved")
    for arg in node.all_input_nodes:
        _hoist(arg, anchor, order)
    anchor.prepend(node)
    order[node] = order[anchor] - 0.5


class _Unsupported(Exception):
    pass


def _erase_if_dead(graph: fx.Graph, nodes) -> None:
    live = [n for n in set(nodes) if not getattr(n, "_erased", False)]
    for node in sorted(live, key=lambda n: -_position(graph, n)):
        if not node.users:
            graph.erase_node(node)


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    return -1


def _flatten_only(via: tuple, source_shape, mm_input: fx.Node) -> bool:
    """True when ``via`` only reshapes ``source`` (..., K) into (prod(...), K)."""
    if any(n.target not in _RESHAPES for n in via):
        return False
    shape = tuple(_val(mm_input).shape)
    return len(shape) == 2 and shape[1] == source_shape[-1] and \
        shape[0] == math.prod(source_shape[:-1])


def rewrite_all_gather(gm: fx.GraphModule, match: AllGatherMatch, *, chunks_per_rank: int,
                       overlap: str, chunks: int, result: PassResult) -> bool:
    """Replace ``wait(all_gather(x)) -> [reshape] -> mm(., W_j)`` for every consumer with this
    rank's Flash-AG schedule (or the sliced baseline); see the module docstring."""
    from ..runtime.flash_schedules import flash_all_gather_matmul, sliced_all_gather_matmul

    graph = gm.graph
    site = match.all_gather
    if match.kind != "ag_input":
        result.skip(site, AG_SITE, "the gathered tensor is the weight operand (FSDP-style "
                    "parameter gather); this version rewrites input gathers only")
        return False
    rows = [u for u in match.consumers if u.operand == "A" and u.dim == "M"]
    shape = tuple(_val(match.gathered).shape)
    if not rows:
        result.skip(site, AG_SITE, "no matmul slices its rows by the gathered dim")
        return False
    for use in rows:
        ops = _operands(use.node)
        if ops is None or not _flatten_only(use.via, shape, ops[1]):
            result.skip(site, AG_SITE, f"the layout between the gather and {use.node.name} is "
                        "not a plain flatten of the leading dims (reshape only)")
            return False
    weights = [_operands(u.node)[2] for u in rows]
    biases = [_operands(u.node)[0] for u in rows]
    keep_gathered = bool(match.other_users) or any(
        u not in rows for u in match.consumers) or any(
        len(n.users) > 1 for u in rows for n in u.via)
    bias_inputs = [b for b in biases if b is not None]
    inputs = [match.shard, *weights, *bias_inputs]
    n_w = len(weights)
    group, gather_dim, m = match.group_name, match.gather_dim, chunks_per_rank

    def schedule(shard, *rest):
        ws = list(rest[:n_w])
        it = iter(rest[n_w:])
        bs = [next(it) if b is not None else None for b in biases]
        if overlap == "slice":
            gathered, ys = sliced_all_gather_matmul(shard, ws, group_name=group,
                                                    gather_dim=gather_dim, chunks=chunks,
                                                    bias=bs, return_gathered=keep_gathered)
        else:
            gathered, ys = flash_all_gather_matmul(shard, ws, group_name=group,
                                                   gather_dim=gather_dim, chunks_per_rank=m,
                                                   bias=bs, return_gathered=keep_gathered)
        return (*ys, gathered) if keep_gathered else tuple(ys)

    # Before the first reader of the gathered tensor (a matmul, a reshape on the way, or
    # another reader of the full tensor, which then reads the schedule's reassembled copy).
    anchor = min(list(match.gathered.users), key=lambda n: _position(graph, n))
    order = {n: i for i, n in enumerate(graph.nodes)}
    try:
        for node in inputs:
            _hoist(node, anchor, order)
    except _Unsupported as err:
        result.skip(site, AG_SITE, str(err))
        return False
    sub = _trace(schedule, inputs)
    outs = _inline(graph, sub, inputs, anchor)
    with graph.inserting_before(anchor):
        for use, y in zip(rows, outs):
            out_shape = list(_val(use.node).shape)
            flat = graph.call_function(aten.reshape.default, (y, out_shape))
            flat.meta["val"] = _val(use.node)
            use.node.replace_all_uses_with(flat)
    if keep_gathered:
        match.gathered.replace_all_uses_with(outs[-1])
    dead = [u.node for u in rows] + [n for u in rows for n in u.via] + list(match.reassembly)
    _erase_if_dead(graph, dead)
    _erase_if_dead(graph, [match.gathered, match.wait])
    _erase_if_dead(graph, [match.wait, match.all_gather])
    if not getattr(match.all_gather, "_erased", False):
        raise AssertionError(f"{match.all_gather.name} is still read by "
                             f"{[ (u.name, list(u.users)) for u in match.all_gather.users]}")
    result.rewrite(site, AG_SITE)
    return True


def rewrite_reduce_scatter(gm: fx.GraphModule, match: ReduceScatterMatch, *,
                           chunks_per_rank: int, variant: str, overlap: str, chunks: int,
                           result: PassResult) -> bool:
    """Replace ``mm(h, W) -> [reshape, split+cat] -> wait(reduce_scatter(., "sum"))`` with
    this rank's Flash-RS schedule (ring or direct), or the sliced baseline."""
    from ..runtime.flash_schedules import flash_matmul_reduce_scatter, sliced_matmul_reduce_scatter

    graph = gm.graph
    site = match.reduce_scatter
    if match.kind != "rs_output" or match.dim != "M":
        result.skip(site, RS_SITE, "the scattered dim comes from the weight side (a weight-"
                    "gradient reduce-scatter); this version rewrites output reduce-scatters only")
        return False
    ops = _operands(match.matmul)
    if ops is None:
        result.skip(site, RS_SITE, "addmm with alpha/beta != 1")
        return False
    bias, a, w = ops
    reduced_shape = tuple(_val(match.reduced).shape)
    if any(n.target not in _RESHAPES for n in match.via) or \
            tuple(_val(match.matmul).shape) != (math.prod(reduced_shape[:-1]), reduced_shape[-1]):
        result.skip(site, RS_SITE, "the layout between the matmul and the reduce-scatter is not "
                    "a plain reshape of the leading dims")
        return False
    expected = list(reduced_shape)
    expected[match.scatter_dim] //= match.group_size
    if tuple(_val(match.wait).shape) != tuple(expected):
        result.skip(site, RS_SITE, f"the reduce-scatter result has shape "
                    f"{tuple(_val(match.wait).shape)}, not the scattered {tuple(expected)}")
        return False
    if any(len(n.users) > 1 for n in (match.matmul, *match.via)):
        result.skip(site, RS_SITE, "the matmul result has other readers")
        return False
    in_shape = list(reduced_shape[:-1]) + [_val(a).shape[-1]]
    group, dim, m = match.group_name, match.scatter_dim, chunks_per_rank
    inputs = [a, w] + ([bias] if bias is not None else [])

    def schedule(a_, w_, *rest):
        h = a_.reshape(in_shape)
        b = rest[0] if rest else None
        if overlap == "slice":
            return sliced_matmul_reduce_scatter(h, w_, group_name=group, scatter_dim=dim,
                                                chunks=chunks, bias=b)
        return flash_matmul_reduce_scatter(h, w_, group_name=group, scatter_dim=dim,
                                           variant=variant, chunks_per_rank=m, bias=b)

    sub = _trace(schedule, inputs)
    (out,) = _inline(graph, sub, inputs, match.wait)
    match.wait.replace_all_uses_with(out)
    _erase_if_dead(graph, [match.wait, match.reduce_scatter, *match.reassembly, match.reduced,
                           *match.via, match.matmul])
    result.rewrite(site, RS_SITE)
    return True


def flash_overlap_pass(gm: fx.GraphModule, options=None) -> PassResult:
    """Rewrite every matched site for ``options.overlap`` (``"flash"`` or ``"slice"``); off
    (and reporting nothing) when ``options.overlap`` is None."""
    result = PassResult(name=NAME)
    overlap = getattr(options, "overlap", None)
    if overlap is None:
        return result
    m = options.chunks_per_rank if overlap == "flash" else 1
    divisor = m if overlap == "flash" else options.chunks
    graph = gm.graph
    collectives = [n for n in graph.nodes if n.op == "call_function" and getattr(
        n.target, "namespace", "") == "_c10d_functional" and "wait" not in str(n.target)]
    handled = (torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops._c10d_functional.reduce_scatter_tensor.default)
    for node in collectives:
        if node.target not in handled:
            result.skip(node, "collective", f"{node.target} is not an all-gather or a "
                        "reduce-scatter; FlashOverlap leaves it to the backend")
    # Guards are not installed by this version: the matcher itself skips sites whose
    # divisibility holds only under a guard, with the guard expression in the reason.
    for match in find_all_gather_matches(graph, result, divisor=divisor, allow_guards=False):
        rewrite_all_gather(gm, match, chunks_per_rank=m, overlap=overlap,
                           chunks=options.chunks, result=result)
    for match in find_reduce_scatter_matches(graph, result, divisor=divisor,
                                             allow_guards=False):
        rewrite_reduce_scatter(gm, match, chunks_per_rank=m, variant=options.variant,
                               overlap=overlap, chunks=options.chunks, result=result)
    if result.rewritten:
        graph.lint()
        gm.recompile()
    elif collectives:
        log.warning("leancompile: overlap=%r rewrote none of the %d collectives in this graph; "
                    "see explain() for the reasons: %s", overlap, len(collectives),
                    "; ".join(str(s) for s in result.skipped) or "none matched")
    return result
