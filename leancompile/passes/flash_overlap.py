"""FlashOverlap: all-gather -> matmul and matmul -> reduce-scatter sites become per-rank P2P
schedules interleaved with per-slice matmuls.

The sites come from ``flash_overlap_match`` (every collective it leaves alone is already in
the result with its reason). Each rewrite traces the runtime schedule of this rank
(``leancompile.runtime.flash_schedules``) into the graph, so every P2P step and every slice's
matmul is a node: visible in ``explain``, kept by dead-code elimination, left where it is by
Inductor's own collective reordering.

Input all-gather + matmul (column-parallel, sequence-parallel input), rank r of N::

    before:  g = wait(all_gather(x_r)); y = mm(reshape(g), W)
    after:   y_r = mm(x_r, W); h0 = p2p_start(x_r -> r+1, <- r-1); ...
             x_{r-1} = p2p_wait(h0); y_{r-1} = mm(x_{r-1}, W); ...; y = cat(rows)

Weight all-gather + matmul (FSDP-style parameter gather: the gathered rows of an (out, in)
weight are the output's columns)::

    before:  w = wait(all_gather(w_r)); y = mm(x, t(view(w)))
    after:   y_r = mm(x, t(w_r)); h0 = p2p_start(w_r -> r+1, <- r-1); ...
             w_{r-1} = p2p_wait(h0); y_{r-1} = mm(x, t(w_{r-1})); ...; y = cat(columns)

Matmul + reduce-scatter (row-parallel output; or the weight gradient ``dW = mm(t(dY), X)`` of
an FSDP-style parameter, DTensor's ``t(t(.))`` between, scattered on its rows)::

    before:  out = wait(reduce_scatter(reshape(mm(h, W)), "sum"))
    after:   acc = mm(h[slice r-1], W); h0 = p2p_start(acc -> r+1, <- r-1); ...
             out = p2p_wait(h_last) + mm(h[slice r], W)

Why it is legal: an all-gather followed by a matmul that slices the gathered dim (rows of the
output for an input gather, columns for a weight gather) computes each output slice from one
gathered slice, in any order; the schedule computes the same slices with the same matmul on
the same data (bitwise for input gathers; a weight gather's narrower matmul may block the
columns differently in BLAS: float tolerance). A reduce-scatter of a matmul is the sum over
ranks of each rank's partial for each output slice; the ring adds the same partials in
another order (equal up to float summation order).

Dynamic shapes: divisibility by ``N * chunks_per_rank`` is decided on the symbolic sizes by the
matcher. A site divisible only under a guard is rewritten in a forward (or inference) graph
after the guard is added to the shape environment (Dynamo makes it a guard of the compiled
region: sizes that fail it recompile, and the recompiled graph keeps the collective). A
backward graph adds no guard; the forward's guard usually proves its sites, the others are
skipped with the guard in the reason. Sizes the traced schedule closes over become nodes
(``_bind_symbolic_sizes``), as the graph must compute every symbolic size from its inputs.
Tracing a schedule over symbolic sizes also adds torch's usual size guards for narrow, cat and
reshape (such as "a chunk is not of length 1"): a recompile for such sizes, not a wrong result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import warnings

import torch
import torch.fx as fx

from .flash_all_to_all import (A2A_SITE, ALL_TO_ALL, ATTENTION_SITE, find_all_to_all_matches,
                               rewrite_attention)
from .flash_attention_rs import match_attention_rows, rewrite_attention_reduce_scatter
from .flash_graph import (SITE_META, Unsupported, detach_metadata_readers, erase_if_dead,
                          feed_moved_readers, hoist, inline, node_val, not_scattered,
                          raw_sizes_bound_later, trace, users_before)
from .flash_overlap_match import (AG_SITE, RESHAPES, RS_SITE, SAME_LAYOUT, AllGatherMatch,
                                  ReduceScatterMatch, Skip, find_all_gather_matches,
                                  find_reduce_scatter_matches, is_backward_graph)
from .result import PassResult, recompile
from .structure import Structure

__all__ = ["flash_overlap_pass", "rewrite_all_gather", "rewrite_reduce_scatter", "NAME",
           "VERSION", "SITE_META"]

log = logging.getLogger("leancompile")

NAME = "flash_overlap"
VERSION = 5

aten = torch.ops.aten


def _operands(mm: fx.Node):
    """(bias or None, A, B) of an mm/addmm node."""
    if mm.target is aten.addmm.default:
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            return None
        return mm.args[0], mm.args[1], mm.args[2]
    return None, mm.args[0], mm.args[1]


def _bind_symbolic_sizes(graph: fx.Graph) -> None:
    """Replace the SymInts a traced schedule closed over (sizes read from ``meta["val"]`` of
    the original graph, e.g. ``4*s77``) by nodes that compute them from the graph's inputs.

    A graph may only name a size through a node (a SymInt placeholder, ``sym_size``); a raw
    SymInt in a node's args prints as its symbol (``s77``) and fails when the graph runs.
    Each symbol is bound to a SymInt placeholder holding it or, failing that, to
    ``aten.sym_size.int`` of a tensor placeholder with it as a dim; compound expressions are
    built from those with Python arithmetic (``torch.utils._sympy.interp.sympy_interp``).
    """
    from torch.fx.node import map_aggregate
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    tracer = fx.proxy.GraphAppendingTracer(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    env: dict = {}
    for node in placeholders:
        val = node_val(node)
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            env.setdefault(val.node.expr, fx.Proxy(node, tracer))

    def from_tensor_dim(symbol):
        for node in placeholders:
            val = node_val(node)
            if not isinstance(val, torch.Tensor):
                continue
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    with graph.inserting_after(placeholders[-1]):
                        bound = graph.call_function(aten.sym_size.int, (node, dim))
                    bound.meta["val"] = size
                    env[symbol] = fx.Proxy(bound, tracer)
                    return env[symbol]
        raise Unsupported(f"no graph input holds the size symbol {symbol}")

    for node in list(graph.nodes):
        if node.op not in ("call_function", "output"):
            continue

        def bind(arg, node=node):
            if not isinstance(arg, torch.SymInt):
                return arg
            expr = arg.node.expr
            if expr.is_number:
                return int(expr)
            with graph.inserting_before(node):
                value = sympy_interp(PythonReferenceAnalysis, env, expr,
                                     missing_handler=from_tensor_dim)
            if isinstance(value, fx.Proxy):
                value.node.meta.setdefault("val", arg)
                _fill_size_vals(value.node)
                return value.node
            return value

        node.args = map_aggregate(node.args, bind)
        node.kwargs = map_aggregate(node.kwargs, bind)


def _fill_size_vals(node: fx.Node) -> None:
    """Give the inner nodes of a size expression built by ``_bind_symbolic_sizes`` (``2 * s0``
    of ``2 * s0 * s1``) the SymInt they compute as ``meta["val"]``, as ``make_fx`` does:
    Inductor before torch 2.13 lowers Python arithmetic nodes from ``meta["val"]`` (a
    ``KeyError: 'val'`` without it)."""
    from torch.fx.node import map_arg

    for arg in node.all_input_nodes:
        if "val" not in arg.meta and arg.op == "call_function":
            _fill_size_vals(arg)
            arg.meta["val"] = arg.target(*map_arg(arg.args, lambda a: a.meta["val"]),
                                         **map_arg(arg.kwargs, lambda a: a.meta["val"]))


def _flatten_only(via: tuple, source_shape, mm_input: fx.Node) -> bool:
    """True when ``via`` only reshapes (or clones) ``source`` (..., K) into (prod(...), K)."""
    if any(n.target not in RESHAPES + SAME_LAYOUT for n in via):
        return False
    shape = tuple(node_val(mm_input).shape)
    return len(shape) == 2 and shape[1] == source_shape[-1] and \
        shape[0] == math.prod(source_shape[:-1])


def rewrite_all_gather(gm: fx.GraphModule, match: AllGatherMatch, *, chunks_per_rank: int,
                       overlap: str, chunks: int, result: PassResult) -> bool:
    """Replace ``wait(all_gather(shard)) -> [reshape, transpose] -> mm`` for every matmul whose
    output the gather dim slices with this rank's Flash-AG schedule (or the sliced baseline):
    input gathers (rows of the output, ``kind="ag_input"``) and weight gathers (columns of the
    output, ``kind="ag_weight"``); see the module docstring."""
    shard = match.shard
    try:
        if match.cast is not None:
            match = dataclasses.replace(match, shard=_cast_shard(gm.graph, match))
        uses, inputs, schedule = (_weight_gather_plan if match.kind == "ag_weight" else
                                  _input_gather_plan)(match, chunks_per_rank, overlap, chunks)
        _inline_all_gather(gm.graph, match, uses, inputs, schedule)
    except Unsupported as err:
        if match.shard is not shard:
            erase_if_dead(gm.graph, [match.shard])
        result.skip(match.all_gather, AG_SITE, str(err))
        return False
    result.rewrite(match.all_gather, AG_SITE)
    return True


def _cast_shard(graph: fx.Graph, match: AllGatherMatch) -> fx.Node:
    """The shard cast as the matmuls read the gathered tensor (``match.cast``), placed right
    after the shard: the schedule sends it in the matmul dtype."""
    from torch._guards import detect_fake_mode

    cast = match.cast
    with graph.inserting_after(match.shard):
        node = graph.call_function(cast.target, (match.shard, *cast.args[1:]), dict(cast.kwargs))
    shard = node_val(match.shard)
    with detect_fake_mode([shard]) or contextlib.nullcontext():
        node.meta["val"] = cast.target(shard, *cast.args[1:], **cast.kwargs)
    node.meta[SITE_META] = match.all_gather.name
    return node


def _input_gather_plan(match: AllGatherMatch, m: int, overlap: str, chunks: int):
    """(uses, schedule inputs, schedule) for a gather of the matmuls' A operand (rows)."""
    from ..runtime.flash_schedules import flash_all_gather_matmul, sliced_all_gather_matmul

    uses = [u for u in match.consumers if u.operand == "A" and u.dim == "M"]
    if not uses:
        raise Unsupported("no matmul slices its rows by the gathered dim")
    shape = tuple(node_val(match.gathered).shape)
    for use in uses:
        ops = _operands(use.node)
        if ops is None or not _flatten_only(use.via, shape, ops[1]):
            raise Unsupported(f"the layout between the gather and {use.node.name} is not a "
                              "plain flatten of the leading dims (reshape only)")
    weights = [_operands(u.node)[2] for u in uses]
    biases = [_operands(u.node)[0] for u in uses]
    fn = sliced_all_gather_matmul if overlap == "slice" else flash_all_gather_matmul
    schedule = _gather_schedule(fn, biases, overlap, m, chunks, group_name=match.group_name,
                                gather_dim=match.gather_dim)
    return uses, [match.shard, *weights, *(b for b in biases if b is not None)], schedule


def _weight_gather_plan(match: AllGatherMatch, m: int, overlap: str, chunks: int):
    """(uses, schedule inputs, schedule) for a gather of the matmuls' B operand (FSDP-style:
    the gathered rows of an (out, in) weight are the output's columns)."""
    from ..runtime.flash_schedules import (flash_all_gather_weight_matmul,
                                           sliced_all_gather_weight_matmul)

    uses = [u for u in match.consumers if u.operand == "B" and u.dim == "N"]
    shape = tuple(node_val(match.gathered).shape)
    if len(shape) != 2 or any(len(node_val(n).shape) != 2 for u in uses for n in u.via):
        raise Unsupported(f"the gathered weight has shape {shape}; weight gathers are "
                          "rewritten for 2-D weights used through views and transposes only")
    if any(_operands(u.node) is None for u in uses):
        raise Unsupported("addmm with alpha/beta != 1")
    # 2-D with the gather dim in the matmul's N dim: B is the gathered W transposed (an
    # nn.Linear weight (out, in) gathered on out) or W itself ((K, N) gathered on N).
    layout = "linear" if match.gather_dim == 0 else "kn"
    xs = [_operands(u.node)[1] for u in uses]
    biases = [_operands(u.node)[0] for u in uses]
    fn = (sliced_all_gather_weight_matmul if overlap == "slice" else
          flash_all_gather_weight_matmul)
    schedule = _gather_schedule(fn, biases, overlap, m, chunks, group_name=match.group_name,
                                layout=layout)
    return uses, [match.shard, *xs, *(b for b in biases if b is not None)], schedule


def _gather_schedule(fn, biases: list, overlap: str, m: int, chunks: int, **fixed):
    """``schedule(shard, *operands, *biases present, keep)`` calling the runtime schedule
    ``fn`` with one matmul operand per entry of ``biases`` (None where the matmul had none)
    and ``chunks`` (slice) or ``chunks_per_rank`` (flash)."""
    count = len(biases)
    pieces = {"chunks": chunks} if overlap == "slice" else {"chunks_per_rank": m}

    def schedule(shard, *rest, keep):
        present = iter(rest[count:])
        bs = [next(present) if b is not None else None for b in biases]
        return fn(shard, list(rest[:count]), bias=bs, return_gathered=keep, **pieces, **fixed)

    return schedule


def _inline_all_gather(graph: fx.Graph, match: AllGatherMatch, uses, inputs, schedule) -> None:
    """Trace ``schedule`` and put it in place of the gather and the matmuls in ``uses``.

    The schedule goes before the first of those matmuls. Readers of the gathered tensor that
    stay (the graph output when it is saved for backward, a matmul that contracts over the
    gathered dim, a view also read by those) read the schedule's reassembled copy instead;
    those placed before the first matmul are moved after the schedule (pure nodes only), and
    schedule inputs placed after it (another matmul's operands) are moved before it.
    """
    rewritten = {u.node for u in uses}
    dead = set(rewritten)
    via = [n for u in uses for n in u.via]
    changed = True
    while changed:  # via nodes read only by replaced matmuls (or such via nodes) go too
        changed = False
        for node in via:
            if node not in dead and all(user in dead for user in node.users):
                dead.add(node)
                changed = True
    live = [n for n in match.gathered.users if n not in dead]
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(rewritten, key=order.__getitem__)
    late = users_before(live, anchor, order)
    for node in inputs:
        hoist(node, anchor, order)
    for node in late:
        anchor.prepend(node)
    keep = bool(live)
    sub = trace(lambda *args: _flat(schedule(*args, keep=keep)), inputs)
    outs = inline(graph, sub, inputs, late[0] if late else anchor, match.all_gather.name)
    ys = outs[:len(uses)]
    with graph.inserting_before(anchor), raw_sizes_bound_later():
        for use, y in zip(uses, ys):
            flat = graph.call_function(aten.reshape.default, (y, list(node_val(use.node).shape)))
            flat.meta["val"] = node_val(use.node)
            flat.meta[SITE_META] = match.all_gather.name
            use.node.replace_all_uses_with(flat)
    if keep:
        match.gathered.replace_all_uses_with(outs[-1])
    replaced = [match.all_gather, match.wait, match.gathered, *match.reassembly, *via,
                *(u.node for u in uses)]
    detach_metadata_readers(replaced)
    erase_if_dead(graph, replaced)  # last first: each is erased once its readers are
    if not getattr(match.all_gather, "_erased", False):
        raise AssertionError(f"{match.all_gather.name} is still read after the rewrite")


def _flat(out) -> tuple:
    """(Y_0, .., Y_k[, gathered]) from a schedule's (gathered or None, [Y_j])."""
    gathered, ys = out
    return (*ys, gathered) if gathered is not None else tuple(ys)


def rewrite_reduce_scatter(gm: fx.GraphModule, match: ReduceScatterMatch, *,
                           chunks_per_rank: int, variant: str, overlap: str, chunks: int,
                           result: PassResult, split_attention: bool = False) -> bool:
    """Replace ``mm(A, B) -> [reshape, transpose, split+cat] -> wait(reduce_scatter(., "sum"))``
    with this rank's Flash-RS schedule (ring or direct), or the sliced baseline: output
    reduce-scatters (row-parallel) and weight-gradient reduce-scatters (``dW = mm(t(dY), X)``,
    FSDP-style) alike, scattered on the product's rows or columns. ``split_attention``: when
    ``A`` is an attention's output with its query rows along the scattered dim, the schedule
    computes the attention slice by slice as well (``flash_attention_rs``)."""
    site = match.reduce_scatter
    if match.terms:
        return _rewrite_sum_reduce_scatter(gm, match, chunks_per_rank=chunks_per_rank,
                                           variant=variant, overlap=overlap, chunks=chunks,
                                           result=result)
    ops = _operands(match.matmul)
    if ops is None:
        result.skip(site, RS_SITE, "addmm with alpha/beta != 1")
        return False
    bias, a, b = ops
    reduced_shape = tuple(node_val(match.reduced).shape)
    mm_shape = tuple(node_val(match.matmul).shape)
    dims = tuple(frozenset(d) for d in match.dims)
    product = (frozenset({"M"}), frozenset({"N"}))
    layout = [n for n in match.via if n not in match.casts]  # casts commute with layouts
    if all(n.target in RESHAPES for n in layout) and \
            mm_shape == (math.prod(reduced_shape[:-1]), reduced_shape[-1]):
        transposed = False   # a reshape of the product's leading dims (or none)
    elif dims == product and mm_shape == reduced_shape:
        transposed = False   # transposes that cancel (DTensor's t(t(dW)))
    elif dims == product[::-1] and mm_shape == reduced_shape[::-1] and bias is None:
        transposed = True    # the reduced tensor is the product transposed: B^T A^T
    else:
        result.skip(site, RS_SITE, f"the layout between {match.matmul.name} {mm_shape} and the "
                    f"reduce-scatter input {reduced_shape} ({_describe_via(layout)}) is not a "
                    "reshape of the leading dims, the product, or (without bias) its transpose")
        return False
    in_shape = list(reduced_shape[:-1]) + [node_val(a).shape[-1]]
    group, dim, m = match.group_name, match.scatter_dim, chunks_per_rank
    inputs = [a, b] + ([bias] if bias is not None else [])
    out_dtype = node_val(match.reduced).dtype if match.casts else None

    def schedule(a_, b_, *rest):
        h, w = (b_.t(), a_.t()) if transposed else (a_, b_)
        h = h.reshape(in_shape)  # symbolic sizes stay raw: _bind_symbolic_sizes binds them
        return run(h, w, rest[0] if bias is not None else None)

    run = _rs_schedule(overlap, group_name=group, scatter_dim=dim, chunks=chunks,
                       variant=variant, chunks_per_rank=m, out_dtype=out_dtype)
    if split_attention and not transposed and dim != len(in_shape) - 1:  # rows, not columns
        slices = match.group_size * (m if overlap == "flash" else chunks)
        try:
            rows = match_attention_rows(a, tuple(in_shape), dim, slices)
        except Skip as skip:
            rows = None
            result.notes.append(f"{skip.node.name} is not split by query: {skip.args[0]}; "
                                f"{site.name} is rewritten next to the projection alone")
        if rows is not None:
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
    from ..runtime.flash_schedules import flash_matmul_reduce_scatter, sliced_matmul_reduce_scatter

    if overlap == "slice":
        return lambda h, w, bias: sliced_matmul_reduce_scatter(h, w, chunks=chunks, bias=bias,
                                                               **fixed)
    return lambda h, w, bias: flash_matmul_reduce_scatter(
        h, w, variant=variant, chunks_per_rank=chunks_per_rank, bias=bias, **fixed)


def _place_reduce_scatter(gm: fx.GraphModule, match: ReduceScatterMatch, schedule,
                          inputs: list, products: list, result: PassResult) -> bool:
    """Trace ``schedule`` over ``inputs`` in front of the wait, hand its result to the readers
    of the scattered tensor (``match.scattered`` or the wait), and erase the collective and
    ``products`` (the matmuls and what lies between them and the collective); or skip the site
    when the collective's result is not the reduced tensor scattered on its dim."""
    graph = gm.graph
    site = match.reduce_scatter
    scattered = match.scattered or match.wait
    why = not_scattered(match)
    if why:
        result.skip(site, RS_SITE, why)
        return False
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
    """
    site = match.reduce_scatter
    reduced_shape = tuple(node_val(match.reduced).shape)
    rows = math.prod(reduced_shape[:-1])
    layout = [n for n in match.via if n not in match.casts]
    inputs, counts = [], []
    for matmul, via in match.terms:
        ops = _operands(matmul)
        if ops is None:
            result.skip(site, RS_SITE, f"{matmul.name} is an addmm with alpha/beta != 1")
            return False
        mm_shape = tuple(node_val(matmul).shape)
        if not all(n.target in RESHAPES for n in (*via, *layout)) or \
                mm_shape != (rows, reduced_shape[-1]):
            result.skip(site, RS_SITE, f"the layout between {matmul.name} {mm_shape} and the "
                        f"reduce-scatter input {reduced_shape} is not a reshape of the leading "
                        "dims (a sum of matmuls is rewritten in that layout only)")
            return False
        bias, a, b = ops
        term = [a, b] + ([bias] if bias is not None else [])
        inputs += term
        counts.append(len(term))
    group, dim, m = match.group_name, match.scatter_dim, chunks_per_rank
    out_dtype = node_val(match.reduced).dtype if match.casts else None

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
                       variant=variant, chunks_per_rank=m, out_dtype=out_dtype)
    products = [*match.adds, *(n for mm, via in match.terms for n in (mm, *via))]
    return _place_reduce_scatter(gm, match, schedule, inputs, products, result)


def _describe_via(via) -> str:
    return ", ".join(f"{n.target}" for n in via) or "nothing"


def _add_guard(condition, node: fx.Node) -> None:
    """Add ``condition`` (a sympy boolean true for the traced sizes, or None) as a guard of the
    shape environment of ``node``'s fake value."""
    if condition is None:
        return
    shape_env = node_val(node).fake_mode.shape_env
    if not shape_env.evaluate_expr(condition):
        raise AssertionError(f"the guard {condition} is false for the traced sizes")


def flash_overlap_pass(gm: fx.GraphModule, options=None) -> PassResult:
    """Rewrite every matched site for ``options.overlap`` (``"flash"`` or ``"slice"``); off
    (and reporting nothing) when ``options.overlap`` is None.

    Never an internal error: a site whose matching or rewrite raises is left as it was
    (the graph is restored from a copy taken before the pass and the other sites are rewritten
    again), reported skipped with the exception, and a warning names the pass; with
    ``on_error="raise"`` (or ``LEANCOMPILE_ON_ERROR=raise`` in the environment, as the test
    suite sets) the exception propagates instead. With ``overlap="flash"``, a collective left
    in place for a reason that may differ between ranks (its sizes, an error) gets a probe in
    front of it (``runtime/p2p.py``): a rank that rewrote the site and a rank that did not stop
    at once with an error instead of waiting for each other.
    """
    overlap = getattr(options, "overlap", None)
    if overlap is None:
        return PassResult(name=NAME)
    raise_errors = on_error(options) == "raise"
    snapshot = None if raise_errors else Structure(gm.graph)
    failed: dict[str, str] = {}
    while True:
        result = PassResult(name=NAME)
        try:
            _rewrite_graph(gm, options, result, failed, raise_errors=raise_errors)
        except _SiteError as err:
            if raise_errors or snapshot is None:
                raise
            failed[err.site] = err.message
            snapshot.restore(gm.graph)
            recompile(gm)
            continue
        break
    for site, message in failed.items():
        where = "this graph" if site == _WHOLE_GRAPH else f"the site at {site}"
        warnings.warn(f"leancompile pass {NAME!r}: rewriting {where} raised {message}; left "
                      "as it was (the compile goes on). Set on_error='raise' to see the "
                      "traceback", RuntimeWarning, stacklevel=2)
    return result


_WHOLE_GRAPH = "*"
ON_ERROR_ENV = "LEANCOMPILE_ON_ERROR"


def on_error(options) -> str:
    """``"raise"`` when ``options.on_error`` or ``$LEANCOMPILE_ON_ERROR`` says so, else
    ``"skip"``."""
    if os.environ.get(ON_ERROR_ENV, "").strip().lower() == "raise":
        return "raise"
    return getattr(options, "on_error", "skip")


class _SiteError(Exception):
    """Internal: rewriting ``site`` (a collective's node name, or ``_WHOLE_GRAPH``) raised."""

    def __init__(self, site: str, exc: BaseException):
        super().__init__(site, exc)
        self.site = site
        self.message = f"{type(exc).__name__}: {exc}"


AUTO_KEPT_REASON = ("overlap_sites leaves it as it is ('none'; overlap='auto' chooses so where "
                    "the simulator predicts the graph faster with it left to the backend)")
"""The reason of a site ``overlap_sites`` leaves as it is."""


def _rewrite_graph(gm: fx.GraphModule, options, result: PassResult, failed: dict[str, str], *,
                   raise_errors: bool) -> None:
    graph = gm.graph
    collectives = [n for n in graph.nodes if n.op == "call_function" and getattr(
        n.target, "namespace", "") == "_c10d_functional" and "wait" not in str(n.target)]
    handled = (torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops._c10d_functional.reduce_scatter_tensor.default)
    # Each collective's own options: ``options`` itself, or its ``overlap_sites`` entry.
    site_options = {n.name: options.for_site(n.name) for n in collectives}
    for node in collectives:
        mode = site_options[node.name].overlap
        if node.target is ALL_TO_ALL and mode == "slice":
            result.skip(node, A2A_SITE, "overlap='slice' has no all-to-all schedule; use "
                        "overlap='flash' for query-split Ulysses attention")
        elif node.target not in handled and node.target is not ALL_TO_ALL:
            result.skip(node, "collective", f"{node.target} is not an all-gather, "
                        "reduce-scatter or all-to-all; FlashOverlap leaves it to the backend")
    if _WHOLE_GRAPH in failed:
        _skip_all(graph, collectives, handled, result, failed[_WHOLE_GRAPH], site_options)
        _insert_probes(graph, result, site_options)
        return
    on_err = "raise" if raise_errors else "skip"
    # Dynamic shapes: a site divisible only under a guard (4*s by 8 needs s even) is rewritten
    # in a forward or inference graph after adding the guard to the shape environment (Dynamo
    # turns it into a guard of the compiled region: other sizes recompile). A backward graph
    # adds none; the forward's guard usually proves its sites, and the others are skipped.
    allow_guards = not is_backward_graph(graph)
    matches = _per_site(find_all_gather_matches, graph, result, site_options,
                        lambda m: m.all_gather, AG_SITE, allow_guards=allow_guards,
                        on_error=on_err)
    for match in _claim_matmuls(matches, result):
        name = match.all_gather.name
        if name in failed:
            result.skip(match.all_gather, AG_SITE, _failed_reason(failed[name]), local="error")
            continue
        site = site_options[name]
        with _attributed(name):
            _add_guard(match.needs_guard, match.shard)
            rewrite_all_gather(gm, match, chunks_per_rank=site.flash_chunks_per_rank,
                               overlap=site.overlap, chunks=site.slice_chunks, result=result)
    for match in _per_site(find_reduce_scatter_matches, graph, result, site_options,
                           lambda m: m.reduce_scatter, RS_SITE, allow_guards=allow_guards,
                           on_error=on_err):
        name = match.reduce_scatter.name
        if name in failed:
            result.skip(match.reduce_scatter, RS_SITE, _failed_reason(failed[name]),
                        local="error")
            continue
        site = site_options[name]
        with _attributed(name):
            _add_guard(match.needs_guard, match.matmul)
            rewrite_reduce_scatter(gm, match, chunks_per_rank=site.flash_chunks_per_rank,
                                   variant=site.flash_variant, overlap=site.overlap,
                                   chunks=site.slice_chunks, result=result,
                                   split_attention=site.attention_split)
    if any(n.target is ALL_TO_ALL and site_options[n.name].overlap == "flash"
           for n in collectives):
        for site in find_all_to_all_matches(graph, result, on_error=on_err):
            name = site.query.all_to_all.name  # the query all-to-all names the site
            if site_options[name].overlap != "flash":
                for a2a in (site.query.all_to_all, site.output.all_to_all):
                    result.skip(a2a, A2A_SITE, AUTO_KEPT_REASON)
                continue
            if name in failed:
                result.skip(site.query.all_to_all, ATTENTION_SITE, _failed_reason(failed[name]),
                            local="error")
                continue
            with _attributed(name):
                rewrite_attention(gm, site, result)
    with _attributed(_WHOLE_GRAPH):
        _insert_probes(graph, result, site_options)
        if result.rewritten:
            _bind_symbolic_sizes(graph)
        graph.lint()
        recompile(gm)
    candidates = [n for n in collectives if n.target in handled
                  and site_options[n.name].overlap is not None]
    if not result.rewritten and candidates:  # all-reduces alone: nothing for the pass, no noise
        log.warning("leancompile: overlap=%r rewrote none of the %d all-gathers and "
                    "reduce-scatters in this graph; see explain() for the reasons: %s",
                    options.overlap, len(candidates),
                    "; ".join(str(s) for s in result.skipped) or "none matched")


def _per_site(find, graph: fx.Graph, result: PassResult, site_options: dict, collective,
              kind: str, **kwargs) -> list:
    """``find`` (``find_all_gather_matches`` or ``find_reduce_scatter_matches``) for each
    site with the divisor of its own options: one search per divisor in use, each site's
    match (or skip) taken from the search of its own. Sites ``overlap_sites`` keeps are
    skipped with the reason. With one setting for every site this is one plain search."""
    target = (torch.ops._c10d_functional.all_gather_into_tensor.default if kind == AG_SITE
              else torch.ops._c10d_functional.reduce_scatter_tensor.default)
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is target]

    def key(o):
        return (o.flash_chunks_per_rank, "chunks_per_rank") if o.overlap == "flash" else \
            (o.slice_chunks, "chunks")
    keys = {n.name: key(site_options[n.name]) for n in nodes
            if site_options[n.name].overlap is not None}
    if len(set(keys.values())) <= 1 and len(keys) == len(nodes):  # one setting: one search
        if not keys:
            return []
        divisor, name = next(iter(keys.values()))
        return find(graph, result, divisor=divisor, divisor_name=name, **kwargs)
    found: dict[str, object] = {}
    skipped: dict[str, list] = {}
    for divisor, name in sorted(set(keys.values())):
        scratch = PassResult(name=result.name)
        for match in find(graph, scratch, divisor=divisor, divisor_name=name, **kwargs):
            if keys.get(collective(match).name) == (divisor, name):
                found[collective(match).name] = match
        for site in scratch.skipped:
            if keys.get(site.node) == (divisor, name):
                skipped.setdefault(site.node, []).append(site)
    matches = []
    for node in nodes:
        if node.name not in keys:
            result.skip(node, kind, AUTO_KEPT_REASON)
        elif node.name in found:
            matches.append(found[node.name])
        result.skipped.extend(skipped.get(node.name, []))
    return matches


@contextlib.contextmanager
def _attributed(site: str):
    """Turn any exception but a deliberate skip into a ``_SiteError`` for ``site``."""
    try:
        yield
    except _SiteError:
        raise
    except Exception as exc:  # noqa: BLE001 - the safety net: any failure leaves the site
        raise _SiteError(site, exc) from exc


def _failed_reason(message: str) -> str:
    return (f"the rewrite raised {message}; the site was left as it was (a bug in "
            "leancompile: please report it with explain()'s output)")


def _skip_all(graph: fx.Graph, collectives, handled, result: PassResult, message: str,
              site_options: dict) -> None:
    for node in collectives:
        overlap = site_options[node.name].overlap
        if overlap is not None and (
                node.target in handled or (node.target is ALL_TO_ALL and overlap == "flash")):
            kind = (A2A_SITE if node.target is ALL_TO_ALL else
                    AG_SITE if "all_gather" in str(node.target) else RS_SITE)
            result.skip(node, kind, _failed_reason(message), local="error")


def _claim_matmuls(matches: list[AllGatherMatch], result: PassResult) -> list[AllGatherMatch]:
    """One rewrite per matmul. When two all-gathers feed one matmul (both operands gathered:
    FSDP-style weights with a sequence-parallel input), the input (activation) gather is
    rewritten and the weight gather is skipped with the reason (between two gathers of one
    kind, the earlier one wins). The choice follows from the program alone, never from sizes,
    so every rank makes the same one."""
    def rewritten(match: AllGatherMatch) -> set[fx.Node]:
        want = ("A", "M") if match.kind == "ag_input" else ("B", "N")
        return {use.node for use in match.consumers if (use.operand, use.dim) == want}

    order = {m.all_gather: i for i, m in enumerate(matches)}
    ranked = sorted(matches, key=lambda m: (m.kind != "ag_input", order[m.all_gather]))
    owner: dict[fx.Node, AllGatherMatch] = {}
    kept = []
    for match in ranked:
        mms = rewritten(match)
        taken = sorted(((mm, owner[mm]) for mm in mms if mm in owner), key=lambda t: t[0].name)
        if taken:
            mm, other = taken[0]
            what = "input" if other.kind == "ag_input" else "weight"
            result.skip(match.all_gather, AG_SITE,
                        f"{mm.name} also reads the all-gather at {other.all_gather.name} (its "
                        f"{what} operand), which is rewritten instead: one matmul, one "
                        "decomposed gather")
            continue
        for mm in mms:
            owner[mm] = match
        kept.append(match)
    return sorted(kept, key=lambda m: order[m.all_gather])


def _insert_probes(graph: fx.Graph, result: PassResult, site_options: dict) -> None:
    """A ``p2p_probe`` in front of each collective left in place for a rank-local reason
    (``Site.local``), where its own options are the FlashOverlap schedule (the sliced baseline
    runs collectives, which report mismatched sizes themselves)."""
    from ..runtime.p2p import P2P_PROBE, group_rank_and_size

    nodes = {n.name: n for n in graph.nodes}
    for i, site in enumerate(result.skipped):
        node = nodes.get(site.node)
        if not site.local or node is None or \
                getattr(site_options.get(site.node), "overlap", None) != "flash" or \
                node.target not in (
                torch.ops._c10d_functional.all_gather_into_tensor.default,
                torch.ops._c10d_functional.reduce_scatter_tensor.default, ALL_TO_ALL):
            continue
        x = node.args[0]
        group_name = node.args[-1]
        rank, n = group_rank_and_size(group_name)
        if n == 1 or not isinstance(x, fx.Node):
            continue
        reason = {"shape": 1, "error": 2}[site.local]
        with graph.inserting_before(node):
            probed = graph.call_function(P2P_PROBE, (x, (rank + 1) % n, (rank - 1) % n,
                                                     reason, group_name))
        val = node_val(x)
        with val.fake_mode:
            probed.meta["val"] = torch.empty_like(val)
        node.replace_input_with(x, probed)
        result.skipped[i] = dataclasses.replace(
            site, reason=site.reason + "; a probe in front of the collective checks that "
            "every rank left it in place")
