"""FlashOverlap's reduce-scatter matcher: which reduce-scatters are fed by a matmul that a P2P
schedule can slice.

This module finds; it rewrites nothing. Every ``_c10d_functional.reduce_scatter_tensor`` node
in a post-grad graph is either returned as a ``ReduceScatterMatch`` or recorded in the
``PassResult`` as a skipped site with a reason a user can act on; a match is a site
``reduce_scatter_rewrite.py`` rewrites as it is (its layout, ``transposed``, and the attention
whose query rows it may split, ``attention``, are decided here).

Patterns (``N`` ranks in the group; ``m`` = ``divisor``, the chunks per rank the rewrite will use)

Matmul feeding a reduce-scatter, ``kind="rs_output"`` (row-parallel out-proj / FC2, and the
backward of a column-parallel all-gather); DTensor's scatter on dim d != 0 is a split on d and a
cat on dim 0 (the dynamic-shape backward spells the split as N ``slice`` nodes)::

    y  = addmm(bias, h, t(w2))
    v  = view(y, [B, S, D])
    s  = split(v, S // N, d)
    c  = cat([s[0], .., s[N-1]])      # (dim 0 only: rs = reduce_scatter_tensor(y, ...))
    rs = reduce_scatter_tensor(c, "sum", N, "0")
    o  = wait_tensor(rs)

Autocast puts a dtype cast between a bf16 matmul and its fp32 reduce-scatter (the backward of an
autocast column-parallel layer); casts between a matmul and its reduce-scatter are in ``via``
(``casts``: each partial product is cast before it is sent)::

    d  = mm(dy, w2)                                          # bf16
    o  = wait_tensor(reduce_scatter_tensor(convert_element_type(d, f32), "sum", N, "0"))

Weight-gradient matmul feeding the gradient reduce-scatter, ``kind="rs_weight_grad"`` (the
FSDP-style backward; DTensor puts transposes and a view between)::

    dw = mm(t(dy), x)                 # A operand is a transpose, in a backward graph
    v  = view(t(t(dw)), [out, in])
    rs = reduce_scatter_tensor(v, "sum", N, "0")
    o  = wait_tensor(rs)

A sum of matmuls (the input gradient of projections that share one gathered input: gate/up,
Q/K/V) is one site, its terms in ``terms``. Under autocast each term is a bf16 product cast to
the fp32 of the sum (the fp32 input was cast once per projection), the casts in
``term_casts``::

    s  = add(add(_to_copy(mm_q, f32), _to_copy(mm_k, f32)), _to_copy(mm_v, f32))
    o  = wait_tensor(reduce_scatter_tensor(s, "sum", N, "0"))

What a match records. The nodes of the collective and its wait; the group name and size; the
logical scatter dim and the logical tensor's shape; the split/getitem/slice/cat nodes of
DTensor's reassembly; the producing matmul, the nodes between, and the output dim (``"M"`` or
``"N"``) the scatter dim comes from. The ``kind`` names the pattern for reports:
``rs_weight_grad`` when the graph is a backward graph (it has a ``tangents`` input) and the
producing matmul's A operand is a transpose (``dW = dY^T X``). Sizes may be symbolic
(``vocabulary.py``: ``needs_guard``).

Skip reasons (the site is the collective node, kind ``"mm+reduce_scatter"``):

- ``wait_tensor is not the only user of the collective (users: ...)``
- ``group '<name>' is unknown: not a registered process group name``; ``group size argument 4
  does not match the size 2 of group '1'``
- ``reduce op 'avg' is not supported (sum only)``
- ``uneven shards: scatter dim 1 holds 30 elements over 4 ranks ...`` (DTensor pads the
  reduce-scatter input)
- ``the reduce-scatter input is produced by aten.relu.default at relu, not by a matmul``;
  ``... is the result of the decomposed schedule of the all-gather at ...`` (the matmul between
  an all-gather and a reduce-scatter is rewritten once, for the gather)
- ``the matmul result mm_2 has other users (...)``
- ``the scatter dim mixes the matmul's row and column dims (...)``
- ``scatter dim 0 of size 28 is not divisible by world size 4 x chunks_per_rank 2 = 8 ...``;
  ``symbolic size ...`` (as ``vocabulary.divisible`` words it)
- ``addmm with alpha/beta != 1``; ``the layout between mm (...) and the reduce-scatter input
  (...) is not a reshape of the leading dims, the product, or (without bias) its transpose``
  (for a sum: ``... is not a reshape of the leading dims``)
- ``the reduce-scatter result has shape (...), not the scattered (...)``
- ``no shape metadata (meta['val']) on <node>; run on a traced post-grad graph``
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal

import sympy
import torch
import torch.fx as fx

from ..result import PassResult
from .attention_match import AttentionRowsMatch, match_attention_rows
from .vocabulary import (FLASH_MATMULS, PASS_THROUGH, REDUCE_SCATTER, RESHAPES, RS_SITE,
                         SAME_LAYOUT, SPLITS, Skip, cat_dim, check_divisor, collective_group,
                         data_readers, describe, divisible, find_sites, graph_order,
                         is_backward_graph, is_cast, is_transpose, matmul_operand,
                         matmul_operands, node_arg, node_names, node_val, norm_dim, only_wait,
                         ordered_slices, propagate_dims, round_up, same_shape, shape_of,
                         split_pieces, swap_dim)

__all__ = ["ReduceScatterMatch", "find_reduce_scatter_matches", "not_scattered"]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True)
class ReduceScatterMatch:
    """A matmul whose result is reduce-scattered.

    ``reduced`` is the tensor in its logical layout (before DTensor's split+cat, which is in
    ``reassembly``); ``scatter_dim`` is its dim the collective scatters, ``shape`` its shape;
    ``via`` are the reshape/transpose/clone nodes from ``matmul`` to ``reduced``; ``dim`` is the
    matmul output dim (``"M"`` rows, ``"N"`` columns) the scatter dim comes from; ``dims`` holds,
    for every dim of ``reduced``, the matmul output dims it is made of (``({"M"}, {"N"})`` when
    ``reduced`` is the product itself, ``({"N"}, {"M"})`` when it is its transpose).
    """

    kind: Literal["rs_output", "rs_weight_grad"]
    matmul: fx.Node
    dim: Literal["M", "N"]
    via: tuple[fx.Node, ...]
    reduced: fx.Node
    reassembly: tuple[fx.Node, ...]
    reduce_scatter: fx.Node
    wait: fx.Node
    reduce_op: str
    scatter_dim: int
    group_name: str
    group_size: int
    shape: tuple
    needs_guard: sympy.Basic | None = None
    dims: tuple[frozenset, ...] = ()
    casts: tuple[fx.Node, ...] = ()
    """The dtype casts in ``via`` (autocast: an fp32 reduce-scatter of a bf16 matmul's result);
    the rewrite casts each partial product to ``reduced``'s dtype before it is sent or summed,
    as the original cast the whole product before reducing it."""
    terms: tuple[tuple[fx.Node, tuple[fx.Node, ...]], ...] = ()
    """For a reduce-scatter of a sum of matmuls: ``(matmul, reshapes to its add)`` per term, in
    summation order (``matmul`` is the first term's; ``via`` then runs from the last add, which
    ``adds`` holds with the others, to ``reduced``). Empty for one matmul."""
    adds: tuple[fx.Node, ...] = ()
    term_casts: tuple[fx.Node, ...] = ()
    """The dtype casts inside the terms of a sum (autocast: each bf16 product cast to the fp32
    of the sum before the add); the rewrite casts each term's partial product to the sum's
    dtype before adding."""
    scattered: fx.Node | None = None
    """The node holding the result in ``reduced``'s layout when that is not ``wait`` (the
    movedim back of torchtitan's spelling); None: ``wait``."""
    transposed: bool = False
    """``reduced`` is the product transposed (``B^T A^T``; a matmul without bias): the
    schedule computes ``mm(B^T, A^T)`` slice by slice. False: ``reduced`` is a reshape of the
    product's leading dims, or the product itself through transposes that cancel."""
    attention: AttentionRowsMatch | None = None
    """The attention whose query rows are the matmul's rows along the scattered dim
    (``attention_match.py``): with ``attention_split`` the schedule computes it slice by slice
    too. None: no attention, or one that cannot be split (``attention_refused`` says why)."""
    attention_refused: str | None = None
    """Why the attention before the matmul is not split by query, as the pass's note words it
    (the site is rewritten next to the projection alone: a note, not a skip)."""


def find_reduce_scatter_matches(graph: fx.Graph, result: PassResult, *, divisor: int = 1,
                                allow_guards: bool = True, on_error: str = "raise",
                                divisor_name: str = "chunks_per_rank"
                                ) -> list[ReduceScatterMatch]:
    """Every reduce-scatter fed by a matmul; every other one goes to ``result`` with a reason.

    ``divisor``, ``allow_guards``, ``on_error`` and ``divisor_name`` as in
    ``find_all_gather_matches``, on the size of the scattered dim.
    """
    check_divisor(divisor, divisor_name)
    return find_sites(graph, REDUCE_SCATTER, RS_SITE,
                      lambda node: _match_reduce_scatter(node, divisor, allow_guards,
                                                         divisor_name),
                      result, on_error)


def _match_reduce_scatter(rs: fx.Node, divisor: int, allow_guards: bool,
                          divisor_name: str) -> ReduceScatterMatch:
    wait = only_wait(rs)
    reduce_op = node_arg(rs, 1, "reduce_op")
    group_size, group_name = collective_group(rs, 2)
    if str(reduce_op).lower() != "sum":
        raise Skip(f"reduce op {reduce_op!r} is not supported (sum only)")

    scattered = None
    moved = _movedim_reduce_scatter(rs, wait)
    if moved is not None:
        reduced, scatter_dim, reassembly, scattered = moved
    else:
        reduced, scatter_dim, reassembly = _reduce_scatter_reassembly(rs, group_size)
    shape = shape_of(reduced)

    chain: list[fx.Node] = []
    node = reduced
    while node.op == "call_function" and (node.target in PASS_THROUGH or is_cast(node)):
        chain.append(node)
        node = node.args[0]
    summed = _sum_of_matmuls(node)
    if summed is not None:
        return _match_sum(rs, summed, tuple(reversed(chain)), reduced, scatter_dim, reassembly,
                          wait, reduce_op, group_name, group_size, shape, divisor, allow_guards,
                          scattered, divisor_name)
    if node.op != "call_function" or node.target not in FLASH_MATMULS:
        _check_pad(node, scatter_dim, group_size, divisor, divisor_name)
        if node.meta.get("flash_overlap_site"):
            raise Skip(f"the reduce-scatter input is the result of the decomposed schedule of "
                       f"the all-gather at {node.meta['flash_overlap_site']}, which replaced "
                       "the matmul that produced it (one matmul, one decomposed collective)")
        raise Skip(f"the reduce-scatter input is produced by {describe(node)}, not by a matmul "
                   "(mm/addmm)")
    matmul = node
    via = tuple(reversed(chain))

    allowed = {*via, *reassembly, rs}
    others = [user for n in (matmul, *via, *reassembly)
              for user in data_readers(n, keep_output=True)
              if user not in allowed]
    if others:
        others = sorted(set(others), key=graph_order(rs.graph).__getitem__)
        raise Skip(f"the matmul result {matmul.name} has other users "
                   f"({', '.join(map(describe, others))}); the sliced schedule never holds the "
                   "whole product")

    tags = (frozenset({"M"}), frozenset({"N"}))
    for step in via:
        tags = propagate_dims(step, tags)
        if tags is None:
            raise Skip(f"cannot follow {describe(step)} from {shape_of(step.args[0])} to "
                       f"{shape_of(step)} back to the matmul's rows and columns")
    dims = tags[scatter_dim]
    if len(dims) != 1:
        raise Skip(f"the scatter dim mixes the matmul's row and column dims ({node_names(via)} "
                   f"reshape {shape_of(matmul)} to {shape}, scatter dim {scatter_dim})")
    dim = next(iter(dims))

    needs_guard = divisible(shape[scatter_dim], group_size, divisor,
                            f"scatter dim {scatter_dim}", allow_guards, divisor_name)
    weight_grad = is_backward_graph(rs.graph) and is_transpose(matmul_operand(matmul, "A"))
    casts = tuple(n for n in via if is_cast(n))
    transposed = _transposed(matmul, via, casts, tags, reduced)
    rows, refused = None, None
    h = matmul_operands(matmul)[1]
    in_shape = (*node_val(reduced).shape[:-1], node_val(h).shape[-1])
    if not transposed and scatter_dim != len(in_shape) - 1:  # rows, not columns
        try:
            rows = match_attention_rows(h, in_shape, scatter_dim, group_size * divisor)
        except Skip as skip:
            refused = (f"{skip.node.name} is not split by query: {skip.args[0]}; {rs.name} is "
                       "rewritten next to the projection alone")
    return _scattered(ReduceScatterMatch(
        kind="rs_weight_grad" if weight_grad else "rs_output", matmul=matmul, dim=dim, via=via,
        reduced=reduced, reassembly=reassembly, reduce_scatter=rs, wait=wait,
        reduce_op=str(reduce_op), scatter_dim=scatter_dim, group_name=group_name,
        group_size=group_size, shape=shape, needs_guard=needs_guard, dims=tags,
        casts=casts, scattered=scattered, transposed=transposed, attention=rows,
        attention_refused=refused))


def _transposed(matmul: fx.Node, via: tuple, casts: tuple, dims: tuple, reduced: fx.Node
                ) -> bool:
    """Whether ``reduced`` is the product transposed (``ReduceScatterMatch.transposed``);
    ``Skip`` for a scaled addmm or a layout the schedules do not take."""
    ops = matmul_operands(matmul)
    if ops is None:
        raise Skip("addmm with alpha/beta != 1")
    bias = ops[0]
    reduced_shape = tuple(node_val(reduced).shape)
    mm_shape = tuple(node_val(matmul).shape)
    dims = tuple(frozenset(d) for d in dims)
    product = (frozenset({"M"}), frozenset({"N"}))
    layout = [n for n in via if n not in casts]  # casts commute with layouts
    if all(n.target in RESHAPES for n in layout) and \
            mm_shape == (math.prod(reduced_shape[:-1]), reduced_shape[-1]):
        return False  # a reshape of the product's leading dims (or none)
    if dims == product and mm_shape == reduced_shape:
        return False  # transposes that cancel (DTensor's t(t(dW)))
    if dims == product[::-1] and mm_shape == reduced_shape[::-1] and bias is None:
        return True   # the reduced tensor is the product transposed: B^T A^T
    raise Skip(f"the layout between {matmul.name} {mm_shape} and the reduce-scatter input "
               f"{reduced_shape} ({_describe_via(layout)}) is not a reshape of the leading "
               "dims, the product, or (without bias) its transpose")


def _describe_via(via) -> str:
    return ", ".join(f"{n.target}" for n in via) or "nothing"


def _scattered(match: ReduceScatterMatch) -> ReduceScatterMatch:
    """``match`` when the collective's result is the reduced tensor scattered on its dim."""
    why = not_scattered(match)
    if why:
        raise Skip(why)
    return match


def _movedim_reduce_scatter(rs: fx.Node, wait: fx.Node):
    """(reduced, scatter dim d, reassembly, scattered) for a reduce-scatter on dim d spelled
    with movedim (torchtitan's default TP backend): ``permute(wait(reduce_scatter(
    [clone](permute(y, p)))), p)`` with p swapping dims 0 and d; ``scattered`` is the last
    permute, which holds the result in ``y``'s layout. Other readers of the wait (the
    partitioner may save the result in its moved layout for the backward) get the rewrite's
    result moved back (``splice.feed_moved_readers``). None for any other form."""
    source = rs.args[0]
    front = [source] if source.target in SAME_LAYOUT else []
    permuted = source.args[0] if front else source
    d = swap_dim(permuted)
    if d is None:
        return None
    backs = [r for r in data_readers(wait, keep_output=True)
             if swap_dim(r) == d and r.args[0] is wait]
    if not backs:
        return None
    return permuted.args[0], d, (permuted, *front), backs[0]


def _sum_of_matmuls(node: fx.Node):
    """(terms, adds) when ``node`` is ``mm_0 + mm_1 + ...`` summed left to right, each term a
    matmul seen through reshapes (``add(add(view(mm_a), view(mm_b)), view(mm_c))``: the input
    gradient of projections that share one gathered input, gate/up or Q/K/V); terms are
    ``(matmul, via)``. None for anything else (another association, a scaled add, a non-matmul
    term)."""
    if not (node.op == "call_function" and node.target is aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs
            and all(isinstance(a, fx.Node) for a in node.args)
            and all(same_shape(shape_of(a), shape_of(node)) for a in node.args)):
        return None
    left, right = node.args
    right_term = _matmul_term(right)
    if right_term is None:
        return None
    inner = _sum_of_matmuls(left)
    if inner is not None:
        terms, adds = inner
        return (*terms, right_term), (*adds, node)
    left_term = _matmul_term(left)
    return None if left_term is None else ((left_term, right_term), (node,))


def _matmul_term(node: fx.Node):
    """(matmul, reshape and cast nodes from it to ``node``) or None (autocast casts each bf16
    term to the fp32 of the sum: ``add(_to_copy(mm_q, f32), _to_copy(mm_k, f32))``)."""
    chain = []
    while node.op == "call_function" and (node.target in RESHAPES or is_cast(node)):
        chain.append(node)
        node = node.args[0]
    if node.op == "call_function" and node.target in FLASH_MATMULS:
        return node, tuple(reversed(chain))
    return None


def _match_sum(rs, summed, via, reduced, scatter_dim, reassembly, wait, reduce_op, group_name,
               group_size, shape, divisor, allow_guards, scattered,
               divisor_name) -> ReduceScatterMatch:
    """A reduce-scatter of a sum of matmuls (``_sum_of_matmuls``) with reshapes and casts
    between the sum and the collective; every term's output rows must be the scatter dim."""
    terms, adds = summed
    allowed = {*via, *reassembly, rs, *adds} | {n for _, term_via in terms for n in term_via}
    others = [user for n in (*allowed - {rs}, *(mm for mm, _ in terms))
              for user in data_readers(n, keep_output=True) if user not in allowed]
    if others:
        others = sorted(set(others), key=graph_order(rs.graph).__getitem__)
        raise Skip(f"the summed matmul results have other users "
                   f"({', '.join(map(describe, others))}); the sliced schedule never holds "
                   "the whole sum")
    dims = set()
    for matmul, term_via in terms:
        tags = (frozenset({"M"}), frozenset({"N"}))
        for step in (*term_via, *via):
            tags = propagate_dims(step, tags)
            if tags is None:
                raise Skip(f"cannot follow {describe(step)} from {shape_of(step.args[0])} to "
                           f"{shape_of(step)} back to the rows and columns of {matmul.name}")
        dims.add(tags[scatter_dim])
    if dims != {frozenset({"M"})}:
        raise Skip(f"the scatter dim is not the rows of every summed matmul "
                   f"({node_names([mm for mm, _ in terms])}): a sum is rewritten when it is "
                   "scattered on the product's rows")
    needs_guard = divisible(shape[scatter_dim], group_size, divisor,
                            f"scatter dim {scatter_dim}", allow_guards, divisor_name)
    casts = tuple(n for n in via if is_cast(n))
    _check_sum_layout(terms, via, casts, reduced)
    term_casts = _term_casts(terms, adds[0])
    return _scattered(ReduceScatterMatch(
        kind="rs_output", matmul=terms[0][0], dim="M", via=via, reduced=reduced,
        reassembly=reassembly, reduce_scatter=rs, wait=wait, reduce_op=str(reduce_op),
        scatter_dim=scatter_dim, group_name=group_name, group_size=group_size, shape=shape,
        needs_guard=needs_guard, dims=(), casts=casts, terms=tuple(terms), adds=tuple(adds),
        term_casts=term_casts, scattered=scattered))


def _term_casts(terms, add: fx.Node) -> tuple[fx.Node, ...]:
    """The casts inside the terms of a sum; ``Skip`` unless each one casts to the sum's dtype
    (the rewrite casts every term's partial product to that dtype before summing)."""
    dtype = node_val(add).dtype
    casts = tuple(n for _, term_via in terms for n in term_via if is_cast(n))
    for cast in casts:
        if node_val(cast).dtype != dtype:
            raise Skip(f"{cast.name} casts a summed matmul's result to {node_val(cast).dtype}, "
                       f"not to the sum's {dtype} (a sum is rewritten with its terms cast to "
                       "its own dtype)")
    return casts


def _check_sum_layout(terms, via: tuple, casts: tuple, reduced: fx.Node) -> None:
    """A sum is rewritten when every term is an unscaled mm/addmm seen through reshapes of the
    leading dims of the reduced tensor; ``Skip`` otherwise."""
    reduced_shape = tuple(node_val(reduced).shape)
    rows = math.prod(reduced_shape[:-1])
    layout = [n for n in via if n not in casts]
    for matmul, term_via in terms:
        if matmul_operands(matmul) is None:
            raise Skip(f"{matmul.name} is an addmm with alpha/beta != 1")
        mm_shape = tuple(node_val(matmul).shape)
        term_layout = [n for n in term_via if not is_cast(n)]
        if not all(n.target in RESHAPES for n in (*term_layout, *layout)) or \
                mm_shape != (rows, reduced_shape[-1]):
            raise Skip(f"the layout between {matmul.name} {mm_shape} and the reduce-scatter "
                       f"input {reduced_shape} is not a reshape of the leading dims (a sum of "
                       "matmuls is rewritten in that layout only)")


def _reduce_scatter_reassembly(rs: fx.Node, n: int) -> tuple[fx.Node, int, tuple[fx.Node, ...]]:
    """(reduced node, scatter dim, reassembly nodes): DTensor's dim-d reduce-scatter splits the
    tensor into ``n`` pieces on d (``split`` + getitems, or ``n`` slices) and cats them on 0.
    Other readers of these nodes are caught by the caller's other-users check."""
    cat = rs.args[0]
    if not (isinstance(cat, fx.Node) and cat.target is aten.cat.default
            and cat_dim(cat, shape_of(cat)) == 0):
        return cat, 0, ()
    pieces = list(cat.args[0])
    if len(pieces) != n or not all(isinstance(p, fx.Node) for p in pieces):
        return cat, 0, ()
    first = pieces[0]
    if first.target is operator.getitem and first.args[0].target in SPLITS:
        split = first.args[0]
        source = split.args[0]
        dim = norm_dim(node_arg(split, 2, "dim", 0), len(shape_of(source)))
        if split_pieces(split, n) == pieces:
            return source, dim, (split, *pieces, cat)
    if first.target is aten.slice.Tensor:
        source = first.args[0]
        dim = norm_dim(node_arg(first, 1, "dim", 0), len(shape_of(source)))
        if ordered_slices(pieces, source, dim, n) == pieces:
            return source, dim, (*pieces, cat)
    return cat, 0, ()


def _check_pad(node: fx.Node, dim: int, n: int, m: int, name: str) -> None:
    """DTensor's uneven reduce-scatter: the last pieces are padded (``constant_pad_nd``) and
    cat'ed back before the split+cat; report that as uneven shards."""
    if node.target is not aten.cat.default:
        return
    pads = [p for p in node.args[0]
            if isinstance(p, fx.Node) and p.target is aten.constant_pad_nd.default]
    if not pads:
        return
    source = pads[0].args[0]
    size = "?"
    if source.target is operator.getitem and source.args[0].target in SPLITS:
        size = shape_of(source.args[0].args[0])[dim]
    padded = shape_of(node)[dim]
    raise Skip(f"uneven shards: scatter dim {dim} holds {size} elements over {n} ranks; "
               f"DTensor pads it to {padded} ({pads[0].name}) before the reduce-scatter; pad "
               f"dim {dim} to {round_up(size, n * m) if size != '?' else 'a multiple'}"
               + (f" (a multiple of world size {n} x {name} {m} = {n * m})"
                  if m > 1 else f" (a multiple of world size {n})"))


def not_scattered(match: ReduceScatterMatch) -> str | None:
    """Why the collective's result is not the reduced tensor scattered on its dim (None when
    it is)."""
    expected = list(node_val(match.reduced).shape)
    expected[match.scatter_dim] //= match.group_size
    got = tuple(node_val(match.scattered or match.wait).shape)
    # Compared without guards: `!=` on SymInt tuples would specialize the sizes it reads.
    if same_shape(got, tuple(expected)):
        return None
    return f"the reduce-scatter result has shape {got}, not the scattered {tuple(expected)}"
