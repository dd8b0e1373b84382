"""FlashOverlap, the matching half: which collectives around matmuls can become P2P schedules.

This module finds; it rewrites nothing. Every ``_c10d_functional.all_gather_into_tensor`` and
``reduce_scatter_tensor`` node in a post-grad graph (forward, backward or inference, before or
after ``canonicalize``: ``view``, ``_unsafe_view`` and ``reshape`` are all followed) is either
returned as a match or recorded in the ``PassResult`` as a skipped site with a reason a user can
act on. The FlashOverlap schedules the rewrite builds from these matches are in
``docs/flashoverlap.md``.

Patterns (``N`` ranks in the group; ``m`` = ``divisor``, the chunks per rank the rewrite will use)

All-gather feeding matmuls, ``kind="ag_input"`` (tensor/sequence parallel: QKV, FC1, and the
backward of a row-parallel reduce-scatter). Gather on dim 0, and DTensor's gather on dim d != 0,
which it spells as a dim-0 gather, a split into N pieces and a cat on dim d (or, when the
shard's dims before d are all 1, e.g. batch 1, as one ``view`` of ``[N, .., S, D]`` to
``[1, .., N*S, D]``; dynamic shapes may spell the split as N ``slice`` nodes)::

    ag = all_gather_into_tensor(x, N, "0")         ag = all_gather_into_tensor(x, N, "0")
    g  = wait_tensor(ag)                           w  = wait_tensor(ag)
    q  = mm(g, wq)                                 s  = split(w, x.size(0))    # N pieces
    k  = mm(g, wk)     # one site,                 g  = cat([s[0], .., s[N-1]], d)
    v  = mm(g, wv)     # three consumers           a  = view(g, [B*S, D])
                                                   y  = addmm(bias, a, t(w1))

All-gather of the weight operand, ``kind="ag_weight"`` (FSDP-style parameter gather: a
``Shard(0)`` DTensor parameter redistributed to ``Replicate`` inside the compiled region)::

    ag = all_gather_into_tensor(w_shard, N, "0")
    g  = wait_tensor(ag)
    v  = view(g, [out, in])
    y  = mm(x, t(v))                  # gathered rows of w = columns (N dim) of the output

Matmul feeding a reduce-scatter, ``kind="rs_output"`` (row-parallel out-proj / FC2, and the
backward of a column-parallel all-gather); DTensor's scatter on dim d != 0 is a split on d and a
cat on dim 0 (the dynamic-shape backward spells the split as N ``slice`` nodes)::

    y  = addmm(bias, h, t(w2))
    v  = view(y, [B, S, D])
    s  = split(v, S // N, d)
    c  = cat([s[0], .., s[N-1]])      # (dim 0 only: rs = reduce_scatter_tensor(y, ...))
    rs = reduce_scatter_tensor(c, "sum", N, "0")
    o  = wait_tensor(rs)

Autocast puts a dtype cast between an fp32 gather and its bf16 matmuls, and between a bf16
matmul and its fp32 reduce-scatter (the backward of an autocast column-parallel layer). A cast
that is the only reader of the gathered tensor becomes the match's ``gathered`` (``cast``: the
rewrite casts the shard before sending it); casts between a matmul and its reduce-scatter are in
``via`` (``casts``: each partial product is cast before it is sent)::

    g  = wait_tensor(all_gather_into_tensor(x, N, "0"))      # f32
    c  = convert_element_type(g, bf16)
    y  = mm(c, w)                                            # bf16
    ...
    d  = mm(dy, w2)                                          # bf16
    o  = wait_tensor(reduce_scatter_tensor(convert_element_type(d, f32), "sum", N, "0"))

Weight-gradient matmul feeding the gradient reduce-scatter, ``kind="rs_weight_grad"`` (the
FSDP-style backward; DTensor puts transposes and a view between)::

    dw = mm(t(dy), x)                 # A operand is a transpose, in a backward graph
    v  = view(t(t(dw)), [out, in])
    rs = reduce_scatter_tensor(v, "sum", N, "0")
    o  = wait_tensor(rs)

What a match records. The nodes of the collective and its wait; the group name and size; the
logical gather/scatter dim and the logical tensor's shape; the split/getitem/slice/cat nodes of
DTensor's reassembly; for an all-gather, every matmul that reads the gathered tensor
(``MatmulUse``: the node, operand ``"A"`` or ``"B"``, the matmul dim ``"M"``, ``"N"`` or ``"K"``
the gather dim lands in, and the reshape/transpose/clone nodes on the way, ``via``) and its other
readers; for a reduce-scatter, the producing matmul, the nodes between, and the output dim
(``"M"`` or ``"N"``) the scatter dim comes from. A use whose gather dim is the
contraction dim ``"K"`` (the weight-gradient matmul of a gathered gradient) can only be sliced by
summing partial products; the rewrite may leave it reading the reassembled tensor. The ``kind``
names the pattern for reports: ``ag_weight`` when every use in an output dim reads the gathered
tensor as operand B; ``rs_weight_grad`` when the graph is a backward graph (it has a
``tangents`` input) and the producing matmul's A operand is a transpose (``dW = dY^T X``).

Dynamic shapes. Sizes in ``meta["val"]`` may be SymInts. Divisibility of the gathered (or
reduced) size by ``N * m`` is decided on the shape environment's sympy expression, without adding
guards (``statically_known_true``). When it is only true for the traced sizes (``4*s27`` by 8
holds when ``s27`` is even), the match carries ``needs_guard``: the sympy condition, e.g.
``Eq(Mod(4*s27, 8), 0)`` (the site is not skipped); a rewrite that uses the match must install it
first: ``shape_env.evaluate_expr(match.needs_guard)`` adds it to the shape environment, whose
guards Dynamo turns into the compiled region's guards after the backend returns (AOTAutograd
compiles the forward and the backward graph before that).
``allow_guards=False`` skips such sites instead, naming the symbol and the guard (the
FlashOverlap pass allows guards in forward and inference graphs, not in backward graphs). A
symbolic size that is false for the traced sizes, or has no hint (data-dependent), is skipped.

Skip reasons (the site is the collective node; kinds ``"all_gather+mm"`` and
``"mm+reduce_scatter"``):

- ``wait_tensor is not the only user of the collective (users: ...)``; ``the all-gather buffer
  wait_tensor is also read in its rank-major layout by ...`` (besides DTensor's split+cat)
- ``group '<name>' is unknown: not a registered process group name``; ``group size argument 4
  does not match the size 2 of group '1'``
- ``reduce op 'avg' is not supported (sum only)``
- ``uneven shards: gather dim 1 holds 30 elements over 4 ranks ...; pad ... to 32``
  (DTensor pads the last shard and trims the gathered tensor / pads the reduce-scatter input)
- ``consumer aten.relu.default at relu is not a matmul (mm/addmm)`` (no matmul reads it);
  ``the gathered tensor is only the bias of addmm ...`` (an FSDP-style bias gather)
- ``operand B of mm_1 also depends on the gathered tensor (through ...)``: the matmul cannot
  start before the gather completes
- ``the gathered tensor has other users (aten.add.Tensor at add_3)``: only with
  ``allow_other_users=False``; by default other readers (the graph output when the gathered
  tensor is saved for backward, a bias-gradient ``sum``) are recorded in ``other_users`` and the
  rewrite feeds them the reassembled tensor, as the original all-gather did
- ``the gather dim is the contraction (K) dim of every matmul that reads it (...)``
- ``the gather dim is spread over both dims of operand A of mm by view_2 ...``
- ``the reduce-scatter input is produced by aten.relu.default at relu, not by a matmul``;
  ``... is the result of the decomposed schedule of the all-gather at ...`` (the matmul between
  an all-gather and a reduce-scatter is rewritten once, for the gather)
- ``the matmul result mm_2 has other users (...)``
- ``the scatter dim mixes the matmul's row and column dims (...)``
- ``gather dim 1 of size 28 is not divisible by world size 4 x chunks_per_rank 2 = 8; pad dim 1
  to 32 or set chunks_per_rank=1``
- ``symbolic size 4*s27 of gather dim 1 (= 12 for the traced shapes) is not divisible by ...``,
  ``... cannot be proven divisible by 8: true for the traced shapes only under the guard ...``
  (``allow_guards=False``), ``... cannot be proven divisible by 8 (data-dependent size, no hint)``
- ``no shape metadata (meta['val']) on <node>; run on a traced post-grad graph``
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .result import PassResult

__all__ = [
    "AG_SITE",
    "RS_SITE",
    "AllGatherMatch",
    "MatmulUse",
    "ReduceScatterMatch",
    "find_all_gather_matches",
    "find_reduce_scatter_matches",
    "is_backward_graph",
    # Shared with the other FlashOverlap passes (flash_graph, flash_all_to_all,
    # flash_attention_rs, flash_overlap): the op sets and the matcher's helpers.
    "METADATA",
    "RESHAPES",
    "SAME_LAYOUT",
    "Skip",
    "descendants",
    "describe",
    "find_sites",
    "only_wait",
    "reshape_groups",
    "same_shape",
    "shape_of",
]

AG_SITE = "all_gather+mm"
RS_SITE = "mm+reduce_scatter"

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

_MATMULS = (aten.mm.default, aten.addmm.default)
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)
SAME_LAYOUT = (aten.clone.default, aten.alias.default)
_PASS_THROUGH = RESHAPES + _TRANSPOSES + SAME_LAYOUT
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
METADATA = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
            aten.sym_storage_offset.default)


@dataclass(frozen=True, kw_only=True)
class MatmulUse:
    """One matmul reading the gathered tensor.

    ``operand`` is ``"A"`` (``mm``'s first operand, ``addmm``'s second) or ``"B"`` (the
    weight side); ``dim`` is the matmul dim the gather dim lands in: ``"M"`` (rows of A and of
    the output), ``"N"`` (columns of B and of the output) or ``"K"`` (the contraction dim);
    ``via`` are the reshape/transpose/clone nodes from the gathered tensor to the operand.
    """

    node: fx.Node
    operand: Literal["A", "B"]
    dim: Literal["M", "N", "K"]
    via: tuple[fx.Node, ...] = ()

    @property
    def slices_output(self) -> bool:
        """True when a slice of the gather dim is a slice of the output (no partial sums)."""
        return self.dim != "K"


@dataclass(frozen=True, kw_only=True)
class AllGatherMatch:
    """An all-gather whose result feeds one or more matmuls.

    ``gathered`` is the node holding the full tensor in its logical layout: the wait for a
    gather on dim 0, the ``cat`` of DTensor's split+cat for ``gather_dim`` != 0 (``reassembly``
    holds the split, getitem and cat nodes). ``shape`` is the gathered tensor's shape (ints or
    SymInts). ``other_users`` are readers that are not matmul operands (the graph output when the
    tensor is saved for backward, a bias-gradient ``sum``). ``needs_guard`` is a sympy condition
    the rewrite must install before relying on divisibility by ``group_size * divisor``, or None.
    """

    kind: Literal["ag_input", "ag_weight"]
    all_gather: fx.Node
    wait: fx.Node
    shard: fx.Node
    gathered: fx.Node
    gather_dim: int
    group_name: str
    group_size: int
    shape: tuple
    reassembly: tuple[fx.Node, ...]
    consumers: tuple[MatmulUse, ...]
    other_users: tuple[fx.Node, ...] = ()
    needs_guard: sympy.Basic | None = None
    cast: fx.Node | None = None
    """A dtype cast that is the only reader of the gathered tensor (autocast: bf16 matmuls of
    an fp32 activation); then ``gathered`` is the cast and the rewrite casts the shard before
    sending it (the same values, element by element; half the bytes from fp32 to bf16)."""


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
    scattered: fx.Node | None = None
    """The node holding the result in ``reduced``'s layout when that is not ``wait`` (the
    movedim back of torchtitan's spelling); None: ``wait``."""


class Skip(Exception):
    """This site is left alone, with ``args[0]`` as the reason; ``local="shape"``
    when the reason depends on this rank's sizes (another rank may decide otherwise)."""

    def __init__(self, reason: str, *, local: str = ""):
        super().__init__(reason)
        self.local = local


def find_sites(graph: fx.Graph, target, kind: str, match_one, result: PassResult,
               on_error: str) -> list:
    """``match_one(node)`` for every ``target`` node: its match, or a skip with the reason.
    With ``on_error="skip"`` an unexpected exception is a skip too (the matcher only reads the
    graph, so the site stays as it was)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not target:
            continue
        try:
            matches.append(match_one(node))
        except Skip as skip:
            result.skip(node, kind, skip.args[0], local=skip.local)
        except Exception as exc:  # noqa: BLE001 - reported as the skip reason
            if on_error == "raise":
                raise
            result.skip(node, kind, f"the matcher raised {type(exc).__name__}: {exc}; the site "
                        "was left as it was (a bug in leancompile: please report it)",
                        local="error")
    return matches


# ----------------------------------------------------------------------------------------------
# Entry points


def find_all_gather_matches(graph: fx.Graph, result: PassResult, *, divisor: int = 1,
                            allow_other_users: bool = True, allow_guards: bool = True,
                            on_error: str = "raise",
                            divisor_name: str = "chunks_per_rank") -> list[AllGatherMatch]:
    """Every all-gather feeding matmuls; every other all-gather goes to ``result`` with a reason.

    ``divisor`` is the chunks per rank the rewrite will use: the gathered size along the gather
    dim must be divisible by ``group_size * divisor``. ``allow_other_users=False`` skips gathers
    whose result is also read by something other than a matmul operand (the graph output
    included). ``allow_guards=False`` skips symbolic sizes that are divisible only under a guard.
    ``on_error="skip"``: an exception while matching one site skips that site with it.
    ``divisor_name``: the option the divisor came from, as skip reasons name it
    (``chunks_per_rank`` for flash, ``chunks`` for slice).
    """
    _check_divisor(divisor, divisor_name)
    return find_sites(graph, _c10d.all_gather_into_tensor.default, AG_SITE,
                      lambda node: _match_all_gather(node, divisor, allow_other_users,
                                                     allow_guards, divisor_name),
                      result, on_error)


def find_reduce_scatter_matches(graph: fx.Graph, result: PassResult, *, divisor: int = 1,
                                allow_guards: bool = True, on_error: str = "raise",
                                divisor_name: str = "chunks_per_rank"
                                ) -> list[ReduceScatterMatch]:
    """Every reduce-scatter fed by a matmul; every other one goes to ``result`` with a reason.

    ``divisor``, ``allow_guards``, ``on_error`` and ``divisor_name`` as in
    ``find_all_gather_matches``, on the size of the scattered dim.
    """
    _check_divisor(divisor, divisor_name)
    return find_sites(graph, _c10d.reduce_scatter_tensor.default, RS_SITE,
                      lambda node: _match_reduce_scatter(node, divisor, allow_guards,
                                                         divisor_name),
                      result, on_error)


def _check_divisor(divisor, name: str) -> None:
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor ({name}) must be a positive int, got {divisor!r}")


# ----------------------------------------------------------------------------------------------
# All-gather


def _match_all_gather(ag: fx.Node, divisor: int, allow_other_users: bool,
                      allow_guards: bool, divisor_name: str) -> AllGatherMatch:
    wait = only_wait(ag)
    group_size = _arg(ag, 1, "group_size")
    group_name = _arg(ag, 2, "group_name")
    _check_group(group_name, group_size)
    shard = ag.args[0]

    moved = _movedim_gather(ag, wait)
    if moved is not None:
        gathered, gather_dim, reassembly, shard = moved
    else:
        gathered, gather_dim, reassembly = _all_gather_reassembly(wait, group_size)
    shape = shape_of(gathered)
    _check_trim(gathered, gather_dim, shape, group_size, divisor, divisor_name)
    cast = _only_cast(gathered)
    if cast is not None:  # autocast: the matmuls read a cast of the gathered tensor; casting the
        gathered = cast   # shard before the gather is the same, element by element

    uses, others = _matmul_uses(gathered, gather_dim)
    if not uses:
        if not others:
            raise Skip("nothing reads the gathered tensor")
        biased = [n for n in others if n.op == "call_function" and n.target in _MATMULS]
        if len(biased) == len(others):
            raise Skip(f"the gathered tensor is only the bias of {_names(biased)}, not a matmul "
                       "operand: no matmul slices along it (an FSDP-style bias gather; it is "
                       "small and left to the backend)")
        readers = ", ".join(f"{describe(n)}" for n in others[:3])
        raise Skip(f"consumer {readers} is not a matmul (mm/addmm)" if len(others) == 1 else
                   f"no consumer is a matmul (mm/addmm): {readers}"
                   + (f" and {len(others) - 3} more" if len(others) > 3 else ""))
    for use in uses:
        if use.dim is None:
            raise Skip(f"the gather dim is spread over both dims of operand {use.operand} of "
                       f"{use.node.name} by {_names(use.via)}; the matmul cannot be sliced "
                       "along it")
    if not any(use.slices_output for use in uses):
        listed = ", ".join(f"{u.node.name} operand {u.operand}" for u in uses)
        raise Skip("the gather dim is the contraction (K) dim of every matmul that reads it "
                   f"({listed}); slicing it would sum partial products")
    downstream = descendants(wait)
    for use in uses:  # a contraction (K) use is not sliced: it reads the reassembled tensor
        if not use.slices_output:  # (the weight gradient of a recomputed, checkpointed gather)
            continue
        other_arg = _operand(use.node, "B" if use.operand == "A" else "A")
        if isinstance(other_arg, fx.Node) and other_arg in downstream:
            other = "B" if use.operand == "A" else "A"
            raise Skip(f"operand {other} of {use.node.name} also depends on the gathered tensor "
                       f"(through {other_arg.name}): the matmul cannot start before the gather "
                       "completes")
    if others and not allow_other_users:
        raise Skip(f"the gathered tensor has other users ({', '.join(map(describe, others))})")

    needs_guard = _divisible(shape[gather_dim], group_size, divisor, f"gather dim {gather_dim}",
                             allow_guards, divisor_name)
    outputs = [use for use in uses if use.slices_output]
    kind = "ag_weight" if all(use.operand == "B" for use in outputs) else "ag_input"
    return AllGatherMatch(
        kind=kind, all_gather=ag, wait=wait, shard=shard, gathered=gathered,
        gather_dim=gather_dim, group_name=group_name, group_size=group_size, shape=shape,
        reassembly=reassembly, consumers=tuple(uses), other_users=tuple(others),
        needs_guard=needs_guard, cast=cast)


def _only_cast(node: fx.Node) -> fx.Node | None:
    """The dtype cast that is the only reader of ``node`` (not an output either), or None."""
    readers = _readers(node, keep_output=True)
    if len(readers) == 1 and _is_cast(readers[0]) and readers[0].args[0] is node:
        return readers[0]
    return None


def _is_cast(node: fx.Node) -> bool:
    """A dtype conversion and nothing else: ``prims.convert_element_type`` (Inductor's
    decomposition) or ``aten._to_copy`` with only ``dtype`` (same device, layout, format)."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.prims.convert_element_type.default:
        return True
    return (node.target is aten._to_copy.default and len(node.args) == 1
            and set(node.kwargs) == {"dtype"})


def _all_gather_reassembly(wait: fx.Node, n: int) -> tuple[fx.Node, int, tuple[fx.Node, ...]]:
    """(gathered node, gather dim, reassembly nodes). A gather on dim d != 0 is a dim-0 gather
    whose rank-major buffer is split into ``n`` pieces on dim 0 (``split`` + getitems, or ``n``
    slices) and cat'ed, in order, on d; or one ``view`` (see ``_view_gather_dim``)."""
    readers = _readers(wait, keep_output=True)
    found = None
    for reader in readers:
        if reader.target in RESHAPES:
            dim = _view_gather_dim(shape_of(wait), shape_of(reader), n)
            if dim is not None:
                found = (reader, dim, (reader,))
                break
        if reader.target in _SPLITS and _arg(reader, 2, "dim", 0) == 0:
            pieces = _split_pieces(reader, n)
            cat = _cat_of(pieces) if pieces else None
            if cat is not None:
                found = (cat, _cat_dim(cat, shape_of(cat)), (reader, *pieces, cat))
                break
    if found is None:
        slices = [r for r in readers if _is_slice_of(r, wait, 0)]
        pieces = _ordered_slices(slices, wait, 0, n) if slices else None
        cat = _cat_of(pieces) if pieces else None
        if cat is not None:
            found = (cat, _cat_dim(cat, shape_of(cat)), (*pieces, cat))
    if found is None:
        return wait, 0, ()
    gathered, dim, nodes = found
    extra = [user for node in (wait, *nodes[:-1]) for user in _readers(node, keep_output=True)
             if user not in nodes]
    if extra:
        raise Skip(f"the all-gather buffer {wait.name} is also read in its rank-major layout "
                   f"by {', '.join(map(describe, _unique(extra)))}, besides the reassembly "
                   f"to gather dim {dim}")
    return gathered, dim, nodes


def _swap_dim(node: fx.Node) -> int | None:
    """d when ``node`` is ``permute(x, p)`` with p swapping dims 0 and d (``movedim(d, 0)`` of a
    3-D tensor, or ``transpose(0, d)``), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.permute.default):
        return None
    perm = [_norm_dim(d, len(node.args[1])) for d in node.args[1]]
    d = perm[0]
    expected = list(range(len(perm)))
    expected[0], expected[d] = d, 0
    return d if d != 0 and perm == expected else None


def _movedim_gather(ag: fx.Node, wait: fx.Node):
    """(gathered, gather dim d, reassembly, shard) for a gather on dim d spelled with movedim,
    as torchtitan's default TP backend does: ``permute(wait(all_gather(permute(x, p))), p)``
    with p swapping dims 0 and d (both permutes the same swap, which is its own inverse); the
    rewrite gathers ``x`` on d directly. None for any other form."""
    readers = _readers(wait, keep_output=True)
    inner = ag.args[0]
    if isinstance(inner, fx.Node) and inner.target in SAME_LAYOUT:
        inner = inner.args[0]  # .contiguous() of the moved shard
    if len(readers) != 1:
        return None
    d = _swap_dim(readers[0])
    if d is None or _swap_dim(inner) != d or readers[0].args[0] is not wait:
        return None
    return readers[0], d, (readers[0],), inner.args[0]


def _view_gather_dim(buffer: tuple, view: tuple, n: int) -> int | None:
    """The gather dim of funcol's view form: when the shard's dims before the gather dim d are
    all 1, ``[N, 1.., S, rest]`` is viewed as ``[1, 1.., N*S, rest]`` instead of split+cat."""
    if len(buffer) != len(view) or len(buffer) < 2 or not (_same(buffer[0], n)
                                                           and _same(view[0], 1)):
        return None
    for d in range(1, len(view)):
        if not _same(view[d], buffer[d]):
            rest_same = all(_same(view[i], buffer[i]) for i in range(d + 1, len(view)))
            ones_before = all(_same(buffer[i], 1) for i in range(1, d))
            if rest_same and ones_before and _same(view[d], n * buffer[d]):
                return d
            return None
    return None


def _check_trim(gathered: fx.Node, dim: int, shape: tuple, n: int, m: int, name: str) -> None:
    """DTensor's uneven gather: pad each shard to the largest, gather, then trim on ``dim``."""
    readers = _readers(gathered)
    if len(readers) != 1 or readers[0].target is not aten.slice.Tensor:
        return
    trim = readers[0]
    if trim.args[0] is not gathered or _norm_dim(_arg(trim, 1, "dim", 0), len(shape)) != dim:
        return
    kept = shape_of(trim)[dim]
    if _same(kept, shape[dim]):
        return
    raise Skip(f"uneven shards: gather dim {dim} holds {kept} elements over {n} ranks; DTensor "
               f"pads each shard to {shape[dim] // n} and trims the gathered tensor "
               f"at {trim.name}; pad dim {dim} to {_round_up_str(kept, n * m)}"
               + (f" (a multiple of world size {n} x {name} {m} = {n * m})"
                  if m > 1 else f" (a multiple of world size {n})"))


def _matmul_uses(gathered: fx.Node, gather_dim: int) -> tuple[list[MatmulUse], list[fx.Node]]:
    """Walk from the gathered tensor through reshapes, transposes and clones to matmul operands;
    everything else that reads it (or a node on the way) is an other user."""
    uses: list[MatmulUse] = []
    others: list[fx.Node] = []
    start = tuple(frozenset({i}) for i in range(len(shape_of(gathered))))
    stack = [(gathered, start, ())]
    while stack:
        node, tags, via = stack.pop()
        for user in _readers(node, keep_output=True):
            if user.op == "call_function" and user.target in _MATMULS:
                for operand in ("A", "B"):
                    if _operand(user, operand) is node:
                        uses.append(MatmulUse(node=user, operand=operand,
                                              dim=_matmul_dim(tags, gather_dim, operand),
                                              via=via))
                if node not in (_operand(user, "A"), _operand(user, "B")):
                    others.append(user)        # e.g. the bias of addmm
                continue
            if user.op == "call_function" and user.target in _PASS_THROUGH:
                new_tags = _propagate(user, tags)
                if new_tags is not None:
                    stack.append((user, new_tags, (*via, user)))
                    continue
            others.append(user)
    order = {node: i for i, node in enumerate(gathered.graph.nodes)}
    uses.sort(key=lambda use: (order[use.node], use.operand))
    return uses, sorted(set(others), key=lambda node: order[node])


def _matmul_dim(tags: tuple[frozenset, ...], gather_dim: int, operand: str):
    """Which dim of the matmul the gather dim lands in, from the operand's dim tags."""
    holding = [i for i, tag in enumerate(tags) if gather_dim in tag]
    if len(tags) != 2 or len(holding) != 1:
        return None
    if operand == "A":
        return "M" if holding[0] == 0 else "K"
    return "K" if holding[0] == 0 else "N"


# ----------------------------------------------------------------------------------------------
# Reduce-scatter


def _match_reduce_scatter(rs: fx.Node, divisor: int, allow_guards: bool,
                          divisor_name: str) -> ReduceScatterMatch:
    wait = only_wait(rs)
    reduce_op = _arg(rs, 1, "reduce_op")
    group_size = _arg(rs, 2, "group_size")
    group_name = _arg(rs, 3, "group_name")
    _check_group(group_name, group_size)
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
    while node.op == "call_function" and (node.target in _PASS_THROUGH or _is_cast(node)):
        chain.append(node)
        node = node.args[0]
    summed = _sum_of_matmuls(node)
    if summed is not None:
        return _match_sum(rs, summed, tuple(reversed(chain)), reduced, scatter_dim, reassembly,
                          wait, reduce_op, group_name, group_size, shape, divisor, allow_guards,
                          scattered, divisor_name)
    if node.op != "call_function" or node.target not in _MATMULS:
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
    others = [user for n in (matmul, *via, *reassembly) for user in _readers(n, keep_output=True)
              if user not in allowed]
    if others:
        others = sorted(set(others), key=_order(rs.graph).__getitem__)
        raise Skip(f"the matmul result {matmul.name} has other users "
                   f"({', '.join(map(describe, others))}); the sliced schedule never holds the "
                   "whole product")

    tags = (frozenset({"M"}), frozenset({"N"}))
    for step in via:
        tags = _propagate(step, tags)
        if tags is None:
            raise Skip(f"cannot follow {describe(step)} from {shape_of(step.args[0])} to "
                       f"{shape_of(step)} back to the matmul's rows and columns")
    dims = tags[scatter_dim]
    if len(dims) != 1:
        raise Skip(f"the scatter dim mixes the matmul's row and column dims ({_names(via)} "
                   f"reshape {shape_of(matmul)} to {shape}, scatter dim {scatter_dim})")
    dim = next(iter(dims))

    needs_guard = _divisible(shape[scatter_dim], group_size, divisor,
                             f"scatter dim {scatter_dim}", allow_guards, divisor_name)
    weight_grad = is_backward_graph(rs.graph) and _is_transpose(_operand(matmul, "A"))
    return ReduceScatterMatch(
        kind="rs_weight_grad" if weight_grad else "rs_output", matmul=matmul, dim=dim, via=via,
        reduced=reduced, reassembly=reassembly, reduce_scatter=rs, wait=wait,
        reduce_op=str(reduce_op), scatter_dim=scatter_dim, group_name=group_name,
        group_size=group_size, shape=shape, needs_guard=needs_guard, dims=tags,
        casts=tuple(n for n in via if _is_cast(n)), scattered=scattered)


def _movedim_reduce_scatter(rs: fx.Node, wait: fx.Node):
    """(reduced, scatter dim d, reassembly, scattered) for a reduce-scatter on dim d spelled
    with movedim (torchtitan's default TP backend): ``permute(wait(reduce_scatter(
    [clone](permute(y, p)))), p)`` with p swapping dims 0 and d; ``scattered`` is the last
    permute, which holds the result in ``y``'s layout. Other readers of the wait (the
    partitioner may save the result in its moved layout for the backward) get the rewrite's
    result moved back (``flash_graph.feed_moved_readers``). None for any other form."""
    source = rs.args[0]
    front = [source] if source.target in SAME_LAYOUT else []
    permuted = source.args[0] if front else source
    d = _swap_dim(permuted)
    if d is None:
        return None
    backs = [r for r in _readers(wait, keep_output=True)
             if _swap_dim(r) == d and r.args[0] is wait]
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
    """(matmul, reshape nodes from it to ``node``) or None."""
    chain = []
    while node.op == "call_function" and node.target in RESHAPES:
        chain.append(node)
        node = node.args[0]
    if node.op == "call_function" and node.target in _MATMULS:
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
              for user in _readers(n, keep_output=True) if user not in allowed]
    if others:
        others = sorted(set(others), key=_order(rs.graph).__getitem__)
        raise Skip(f"the summed matmul results have other users "
                   f"({', '.join(map(describe, others))}); the sliced schedule never holds "
                   "the whole sum")
    dims = set()
    for matmul, term_via in terms:
        tags = (frozenset({"M"}), frozenset({"N"}))
        for step in (*term_via, *via):
            tags = _propagate(step, tags)
            if tags is None:
                raise Skip(f"cannot follow {describe(step)} from {shape_of(step.args[0])} to "
                           f"{shape_of(step)} back to the rows and columns of {matmul.name}")
        dims.add(tags[scatter_dim])
    if dims != {frozenset({"M"})}:
        raise Skip(f"the scatter dim is not the rows of every summed matmul "
                   f"({_names([mm for mm, _ in terms])}): a sum is rewritten when it is "
                   "scattered on the product's rows")
    needs_guard = _divisible(shape[scatter_dim], group_size, divisor,
                             f"scatter dim {scatter_dim}", allow_guards, divisor_name)
    return ReduceScatterMatch(
        kind="rs_output", matmul=terms[0][0], dim="M", via=via, reduced=reduced,
        reassembly=reassembly, reduce_scatter=rs, wait=wait, reduce_op=str(reduce_op),
        scatter_dim=scatter_dim, group_name=group_name, group_size=group_size, shape=shape,
        needs_guard=needs_guard, dims=(), casts=tuple(n for n in via if _is_cast(n)),
        terms=tuple(terms), adds=tuple(adds), scattered=scattered)


def _reduce_scatter_reassembly(rs: fx.Node, n: int) -> tuple[fx.Node, int, tuple[fx.Node, ...]]:
    """(reduced node, scatter dim, reassembly nodes): DTensor's dim-d reduce-scatter splits the
    tensor into ``n`` pieces on d (``split`` + getitems, or ``n`` slices) and cats them on 0.
    Other readers of these nodes are caught by the caller's other-users check."""
    cat = rs.args[0]
    if not (isinstance(cat, fx.Node) and cat.target is aten.cat.default
            and _cat_dim(cat, shape_of(cat)) == 0):
        return cat, 0, ()
    pieces = list(cat.args[0])
    if len(pieces) != n or not all(isinstance(p, fx.Node) for p in pieces):
        return cat, 0, ()
    first = pieces[0]
    if first.target is operator.getitem and first.args[0].target in _SPLITS:
        split = first.args[0]
        source = split.args[0]
        dim = _norm_dim(_arg(split, 2, "dim", 0), len(shape_of(source)))
        if _split_pieces(split, n) == pieces:
            return source, dim, (split, *pieces, cat)
    if first.target is aten.slice.Tensor:
        source = first.args[0]
        dim = _norm_dim(_arg(first, 1, "dim", 0), len(shape_of(source)))
        if _ordered_slices(pieces, source, dim, n) == pieces:
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
    if source.target is operator.getitem and source.args[0].target in _SPLITS:
        size = shape_of(source.args[0].args[0])[dim]
    padded = shape_of(node)[dim]
    raise Skip(f"uneven shards: scatter dim {dim} holds {size} elements over {n} ranks; "
               f"DTensor pads it to {padded} ({pads[0].name}) before the reduce-scatter; pad "
               f"dim {dim} to {_round_up_str(size, n * m) if size != '?' else 'a multiple'}"
               + (f" (a multiple of world size {n} x {name} {m} = {n * m})"
                  if m > 1 else f" (a multiple of world size {n})"))


# ----------------------------------------------------------------------------------------------
# Shared checks


def only_wait(collective: fx.Node) -> fx.Node:
    users = _readers(collective, keep_output=True)
    if len(users) == 1 and users[0].target is _c10d.wait_tensor.default:
        return users[0]
    listed = ", ".join(map(describe, users)) or "none"
    raise Skip(f"wait_tensor is not the only user of the collective (users: {listed})")


def _check_group(name, size) -> None:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - any failure to resolve means "not a live group here"
        raise Skip(f"group {name!r} is unknown: not a registered process group name "
                   "(unknown group)") from None
    if group.size() != size:
        raise Skip(f"group size argument {size} does not match the size {group.size()} of "
                   f"group {name!r}")


def _divisible(size, n: int, m: int, what: str, allow_guards: bool, name: str):
    """None when ``size`` is divisible by ``n * m``; the sympy guard when only the traced sizes
    make it so; raises ``Skip`` otherwise. ``name``: the option ``m`` came from."""
    k = n * m
    by = f"world size {n} x {name} {m} = {k}" if m > 1 else f"world size {n}"
    fix = f" or set {name}=1"
    if isinstance(size, int):
        if size % k == 0:
            return None
        also = fix if m > 1 and size % n == 0 else ""
        raise Skip(f"{what} of size {size} is not divisible by {by}; pad {what.split(' ', 1)[1]} "
                   f"to {_round_up_str(size, k)}{also}", local="shape")
    cond = size % k == 0
    if statically_known_true(cond):
        return None
    expr = cond.node.expr
    if not cond.node.has_hint():
        raise Skip(f"symbolic size {size} of {what} cannot be proven divisible by {by} "
                   "(data-dependent size, no hint)", local="shape")
    hint = size.node.hint
    if not cond.node.hint:
        raise Skip(f"symbolic size {size} of {what} (= {hint} for the traced shapes) is not "
                   f"divisible by {by}; pad it to a multiple of {k}"
                   + (fix if m > 1 else ""), local="shape")
    if not allow_guards:
        raise Skip(f"symbolic size {size} of {what} cannot be proven divisible by {by}: true "
                   f"for the traced shapes (= {hint}) only under the guard {expr}, which is "
                   "not added here (guards are added while compiling a forward graph, not a "
                   "backward one); mark the dim static" + (fix if m > 1 else ""), local="shape")
    return expr


# ----------------------------------------------------------------------------------------------
# Small graph helpers


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _readers(node: fx.Node, *, keep_output: bool = False) -> list[fx.Node]:
    """Users that read the data (sym_size and friends only read metadata)."""
    return [u for u in node.users
            if not (u.op == "call_function" and u.target in METADATA)
            and (keep_output or u.op != "output")]


def _operand(mm: fx.Node, which: str):
    offset = 1 if mm.target is aten.addmm.default else 0
    return mm.args[offset + (0 if which == "A" else 1)]


def shape_of(node: fx.Node) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        name = getattr(node, "name", node)
        raise Skip(f"no shape metadata (meta['val']) on {name}; run on a traced post-grad graph")
    return tuple(val.shape)


def _split_pieces(split: fx.Node, n: int) -> list[fx.Node] | None:
    """The ``n`` getitems of a split, in order, when the split makes exactly ``n`` pieces."""
    vals = split.meta.get("val")
    if not isinstance(vals, (list, tuple)) or len(vals) != n:
        return None
    by_index = {}
    for user in split.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        by_index[user.args[1]] = user
    if sorted(by_index) != list(range(n)):
        return None
    return [by_index[i] for i in range(n)]


def _is_slice_of(node: fx.Node, source: fx.Node, dim: int) -> bool:
    return (node.target is aten.slice.Tensor and node.args[0] is source
            and _norm_dim(_arg(node, 1, "dim", 0), len(shape_of(source))) == dim
            and _arg(node, 4, "step", 1) == 1)


def _ordered_slices(nodes, source: fx.Node, dim: int, n: int) -> list[fx.Node] | None:
    """``n`` slices of ``source`` on ``dim`` that tile it from 0 to its end, in tiling order."""
    if len(nodes) != n or not all(_is_slice_of(s, source, dim) for s in nodes):
        return None
    ordered, at = [], 0
    for _ in range(n):
        piece = next((s for s in nodes if _same(_arg(s, 2, "start", 0), at)), None)
        if piece is None:
            return None
        ordered.append(piece)
        at = _arg(piece, 3, "end")
    size = shape_of(source)[dim]
    if not (_same(at, size) or (isinstance(at, int) and isinstance(size, int) and at >= size)):
        return None
    return ordered


def _cat_of(pieces: list[fx.Node]) -> fx.Node | None:
    """The cat that reads exactly ``pieces``, in order."""
    return next((user for user in pieces[0].users if user.target is aten.cat.default
                 and list(user.args[0]) == list(pieces)), None)


def _cat_dim(cat: fx.Node, shape: tuple) -> int:
    return _norm_dim(_arg(cat, 1, "dim", 0), len(shape))


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def same_shape(a: tuple, b: tuple) -> bool:
    """Shapes equal, decided without guards (``(s0, 4) == (4,)`` in Python would compare
    ``s0 == 4`` and specialize ``s0``)."""
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _same(a, b) -> bool:
    """a == b for ints, SymInts (statically, no guard) or fx nodes carrying SymInts."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if a is b:
            return True
        a = a.meta.get("val") if isinstance(a, fx.Node) else a
        b = b.meta.get("val") if isinstance(b, fx.Node) else b
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return statically_known_true(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def _propagate(node: fx.Node, tags: tuple[frozenset, ...]) -> tuple[frozenset, ...] | None:
    """Dim tags of ``node``'s output from those of its input (None: cannot follow)."""
    target = node.target
    if target in SAME_LAYOUT or _is_cast(node):
        return tags
    if target is aten.t.default:
        return tags[::-1] if len(tags) == 2 else tags
    if target is aten.transpose.int:
        a, b = (_norm_dim(d, len(tags)) for d in node.args[1:3])
        out = list(tags)
        out[a], out[b] = tags[b], tags[a]
        return tuple(out)
    if target is aten.permute.default:
        return tuple(tags[_norm_dim(d, len(tags))] for d in node.args[1])
    if target in RESHAPES:
        groups = reshape_groups(shape_of(node.args[0]), shape_of(node))
        if groups is None:
            return None
        out = [frozenset()] * len(shape_of(node))
        for src, dst in groups:
            merged = frozenset().union(*(tags[i] for i in src))
            for j in dst:
                out[j] = merged
        return tuple(out)
    return None


def reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input dims with runs of output dims of equal product (a reshape's dim
    groups); decided on the traced sizes (hints) for SymInts."""
    s = [_hint(x) for x in src]
    d = [_hint(x) for x in dst]
    if None in s or None in d or 0 in s or 0 in d:
        return None
    groups, i, j = [], 0, 0
    while i < len(s) or j < len(d):
        src_dims, dst_dims, ps, pd = [], [], 1, 1
        if i < len(s):
            src_dims.append(i)
            ps *= s[i]
            i += 1
        if j < len(d):
            dst_dims.append(j)
            pd *= d[j]
            j += 1
        while ps != pd:
            if ps < pd and i < len(s):
                src_dims.append(i)
                ps *= s[i]
                i += 1
            elif pd < ps and j < len(d):
                dst_dims.append(j)
                pd *= d[j]
                j += 1
            else:
                return None
        groups.append((src_dims, dst_dims))
    return groups


def _hint(size):
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    return node.hint if node is not None and node.has_hint() else None


def descendants(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def is_backward_graph(graph: fx.Graph) -> bool:
    """True for an AOTAutograd backward graph (it has ``tangents`` inputs)."""
    return any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)


def _is_transpose(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.t.default, aten.transpose.int):
        return True
    return node.target is aten.permute.default and list(node.args[1]) == [1, 0]


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _unique(nodes) -> tuple[fx.Node, ...]:
    seen: dict[fx.Node, None] = {}
    for node in nodes:
        seen.setdefault(node, None)
    if not seen:
        return ()
    order = _order(next(iter(seen)).graph)
    return tuple(sorted(seen, key=order.__getitem__))


def describe(node: fx.Node) -> str:
    if node.op == "output":
        return "the graph output (saved for backward or returned)"
    if node.op == "placeholder":
        return f"graph input {node.name}"
    target = node.target
    name = str(target) if hasattr(target, "_schema") else getattr(target, "__name__", str(target))
    return f"{name} at {node.name}"


def _names(nodes) -> str:
    return ", ".join(n.name for n in nodes) or "no node"


def _round_up_str(size, k: int) -> str:
    if isinstance(size, int):
        return str(-(-size // k) * k)
    return f"a multiple of {k}"
