"""FlashOverlap's all-gather matcher: which all-gathers feed matmuls that a P2P schedule can
slice.

This module finds; it rewrites nothing. Every ``_c10d_functional.all_gather_into_tensor`` node
in a post-grad graph (forward, backward or inference, before or after ``canonicalize``:
``view``, ``_unsafe_view`` and ``reshape`` are all followed) is either returned as an
``AllGatherMatch`` or recorded in the ``PassResult`` as a skipped site with a reason a user can
act on; a match is a site ``all_gather_rewrite.py`` rewrites as it is. The schedules are in
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

Autocast puts a dtype cast between an fp32 gather and its bf16 matmuls. A cast that is the only
reader of the gathered tensor becomes the match's ``gathered`` (``cast``: the rewrite casts the
shard before sending it)::

    g  = wait_tensor(all_gather_into_tensor(x, N, "0"))      # f32
    c  = convert_element_type(g, bf16)
    y  = mm(c, w)                                            # bf16

What a match records. The nodes of the collective and its wait; the group name and size; the
logical gather dim and the logical tensor's shape; the split/getitem/slice/cat nodes of
DTensor's reassembly; every matmul that reads the gathered tensor (``MatmulUse``: the node,
operand ``"A"`` or ``"B"``, the matmul dim ``"M"``, ``"N"`` or ``"K"`` the gather dim lands in,
and the reshape/transpose/clone nodes on the way, ``via``), the ones the rewrite replaces
(``sliced``) and its other readers. A use whose gather dim is the contraction dim ``"K"`` (the
weight-gradient matmul of a gathered gradient) can only be sliced by summing partial products;
it keeps reading the reassembled tensor. The ``kind`` names the pattern for reports:
``ag_weight`` when every use in an output dim reads the gathered tensor as operand B. Sizes
may be symbolic (``vocabulary.py``: ``needs_guard``).

Skip reasons (the site is the collective node, kind ``"all_gather+mm"``):

- ``wait_tensor is not the only user of the collective (users: ...)``; ``the all-gather buffer
  wait_tensor is also read in its rank-major layout by ...`` (besides DTensor's split+cat)
- ``group '<name>' is unknown: not a registered process group name``; ``group size argument 4
  does not match the size 2 of group '1'``
- ``uneven shards: gather dim 1 holds 30 elements over 4 ranks ...; pad ... to 32``
  (DTensor pads the last shard and trims the gathered tensor)
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
- ``gather dim 1 of size 28 is not divisible by world size 4 x chunks_per_rank 2 = 8; pad dim 1
  to 32 or set chunks_per_rank=1``; ``symbolic size 4*s27 of gather dim 1 ...`` (as
  ``vocabulary.divisible`` words it)
- ``the layout between the gather and mm is not a plain flatten of the leading dims (reshape
  only)`` (an input gather; also an addmm with alpha or beta != 1); ``the gathered weight has
  shape (...); weight gathers are rewritten for 2-D weights used through views and transposes
  only``; ``addmm with alpha/beta != 1`` (a weight gather)
- ``mm also reads the all-gather at ... (its input operand), which is rewritten instead``
  (``claim_matmuls``: one matmul, one decomposed gather)
- ``no shape metadata (meta['val']) on <node>; run on a traced post-grad graph``
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import sympy
import torch
import torch.fx as fx

from ..result import PassResult
from .vocabulary import (AG_SITE, ALL_GATHER, FLASH_MATMULS, PASS_THROUGH, RESHAPES,
                         SAME_LAYOUT, SPLITS, Skip, cat_dim, cat_of, check_divisor,
                         collective_group, data_readers, descendants, describe, divisible,
                         find_sites, is_cast, is_slice_of, matmul_operand, matmul_operands,
                         node_arg, node_names, node_val, norm_dim, only_wait, ordered_slices,
                         propagate_dims, round_up, same_size, shape_of, split_pieces, swap_dim,
                         unique_in_order)

__all__ = ["AllGatherMatch", "MatmulUse", "claim_matmuls", "find_all_gather_matches"]

aten = torch.ops.aten


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
    sliced: tuple[MatmulUse, ...] = ()
    """The uses the rewrite replaces by the schedule: those whose rows (``"A"``, ``"M"``) the
    gather dim slices for ``kind="ag_input"``, whose columns (``"B"``, ``"N"``) for
    ``"ag_weight"``; the others keep reading the reassembled tensor."""


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
    check_divisor(divisor, divisor_name)
    return find_sites(graph, ALL_GATHER, AG_SITE,
                      lambda node: _match_all_gather(node, divisor, allow_other_users,
                                                     allow_guards, divisor_name),
                      result, on_error)


def _match_all_gather(ag: fx.Node, divisor: int, allow_other_users: bool,
                      allow_guards: bool, divisor_name: str) -> AllGatherMatch:
    wait = only_wait(ag)
    group_size, group_name = collective_group(ag, 1)
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
        biased = [n for n in others if n.op == "call_function" and n.target in FLASH_MATMULS]
        if len(biased) == len(others):
            raise Skip(f"the gathered tensor is only the bias of {node_names(biased)}, not a "
                       "matmul operand: no matmul slices along it (an FSDP-style bias gather; "
                       "it is small and left to the backend)")
        readers = ", ".join(f"{describe(n)}" for n in others[:3])
        raise Skip(f"consumer {readers} is not a matmul (mm/addmm)" if len(others) == 1 else
                   f"no consumer is a matmul (mm/addmm): {readers}"
                   + (f" and {len(others) - 3} more" if len(others) > 3 else ""))
    for use in uses:
        if use.dim is None:
            raise Skip(f"the gather dim is spread over both dims of operand {use.operand} of "
                       f"{use.node.name} by {node_names(use.via)}; the matmul cannot be sliced "
                       "along it")
    if not any(use.slices_output for use in uses):
        listed = ", ".join(f"{u.node.name} operand {u.operand}" for u in uses)
        raise Skip("the gather dim is the contraction (K) dim of every matmul that reads it "
                   f"({listed}); slicing it would sum partial products")
    downstream = descendants(wait)
    for use in uses:  # a contraction (K) use is not sliced: it reads the reassembled tensor
        if not use.slices_output:  # (the weight gradient of a recomputed, checkpointed gather)
            continue
        other_arg = matmul_operand(use.node, "B" if use.operand == "A" else "A")
        if isinstance(other_arg, fx.Node) and other_arg in downstream:
            other = "B" if use.operand == "A" else "A"
            raise Skip(f"operand {other} of {use.node.name} also depends on the gathered tensor "
                       f"(through {other_arg.name}): the matmul cannot start before the gather "
                       "completes")
    if others and not allow_other_users:
        raise Skip(f"the gathered tensor has other users ({', '.join(map(describe, others))})")

    needs_guard = divisible(shape[gather_dim], group_size, divisor, f"gather dim {gather_dim}",
                            allow_guards, divisor_name)
    outputs = [use for use in uses if use.slices_output]
    kind = "ag_weight" if all(use.operand == "B" for use in outputs) else "ag_input"
    return AllGatherMatch(
        kind=kind, all_gather=ag, wait=wait, shard=shard, gathered=gathered,
        gather_dim=gather_dim, group_name=group_name, group_size=group_size, shape=shape,
        reassembly=reassembly, consumers=tuple(uses), other_users=tuple(others),
        needs_guard=needs_guard, cast=cast, sliced=_sliced_uses(kind, uses, gathered))


def _sliced_uses(kind: str, uses: list[MatmulUse], gathered: fx.Node
                 ) -> tuple[MatmulUse, ...]:
    """The uses the schedule replaces (``AllGatherMatch.sliced``), after checking it takes
    them: an input gather's matmuls read a plain flatten of the gathered tensor's leading dims
    (``x.reshape(-1, K)``, no scaled addmm); a weight gather's weight is 2-D all the way to its
    matmuls, which are not addmm with alpha or beta != 1."""
    shape = tuple(node_val(gathered).shape)
    if kind == "ag_input":
        sliced = [u for u in uses if u.operand == "A" and u.dim == "M"]
        if not sliced:
            raise Skip("no matmul slices its rows by the gathered dim")
        for use in sliced:
            ops = matmul_operands(use.node)
            if ops is None or not _flatten_only(use.via, shape, ops[1]):
                raise Skip(f"the layout between the gather and {use.node.name} is not a "
                           "plain flatten of the leading dims (reshape only)")
        return tuple(sliced)
    sliced = [u for u in uses if u.operand == "B" and u.dim == "N"]
    if len(shape) != 2 or any(len(node_val(n).shape) != 2 for u in sliced for n in u.via):
        raise Skip(f"the gathered weight has shape {shape}; weight gathers are "
                   "rewritten for 2-D weights used through views and transposes only")
    if any(matmul_operands(u.node) is None for u in sliced):
        raise Skip("addmm with alpha/beta != 1")
    return tuple(sliced)


def _flatten_only(via: tuple, source_shape, mm_input: fx.Node) -> bool:
    """True when ``via`` only reshapes (or clones) ``source`` (..., K) into (prod(...), K)."""
    if any(n.target not in RESHAPES + SAME_LAYOUT for n in via):
        return False
    shape = tuple(node_val(mm_input).shape)
    return len(shape) == 2 and shape[1] == source_shape[-1] and \
        shape[0] == math.prod(source_shape[:-1])


def _only_cast(node: fx.Node) -> fx.Node | None:
    """The dtype cast that is the only reader of ``node`` (not an output either), or None."""
    readers = data_readers(node, keep_output=True)
    if len(readers) == 1 and is_cast(readers[0]) and readers[0].args[0] is node:
        return readers[0]
    return None


def _all_gather_reassembly(wait: fx.Node, n: int) -> tuple[fx.Node, int, tuple[fx.Node, ...]]:
    """(gathered node, gather dim, reassembly nodes). A gather on dim d != 0 is a dim-0 gather
    whose rank-major buffer is split into ``n`` pieces on dim 0 (``split`` + getitems, or ``n``
    slices) and cat'ed, in order, on d; or one ``view`` (see ``_view_gather_dim``)."""
    readers = data_readers(wait, keep_output=True)
    found = None
    for reader in readers:
        if reader.target in RESHAPES:
            dim = _view_gather_dim(shape_of(wait), shape_of(reader), n)
            if dim is not None:
                found = (reader, dim, (reader,))
                break
        if reader.target in SPLITS and node_arg(reader, 2, "dim", 0) == 0:
            pieces = split_pieces(reader, n)
            cat = cat_of(pieces) if pieces else None
            if cat is not None:
                found = (cat, cat_dim(cat, shape_of(cat)), (reader, *pieces, cat))
                break
    if found is None:
        slices = [r for r in readers if is_slice_of(r, wait, 0)]
        pieces = ordered_slices(slices, wait, 0, n) if slices else None
        cat = cat_of(pieces) if pieces else None
        if cat is not None:
            found = (cat, cat_dim(cat, shape_of(cat)), (*pieces, cat))
    if found is None:
        return wait, 0, ()
    gathered, dim, nodes = found
    extra = [user for node in (wait, *nodes[:-1]) for user in data_readers(node, keep_output=True)
             if user not in nodes]
    if extra:
        raise Skip(f"the all-gather buffer {wait.name} is also read in its rank-major layout "
                   f"by {', '.join(map(describe, unique_in_order(extra)))}, besides the reassembly "
                   f"to gather dim {dim}")
    return gathered, dim, nodes


def _movedim_gather(ag: fx.Node, wait: fx.Node):
    """(gathered, gather dim d, reassembly, shard) for a gather on dim d spelled with movedim,
    as torchtitan's default TP backend does: ``permute(wait(all_gather(permute(x, p))), p)``
    with p swapping dims 0 and d (both permutes the same swap, which is its own inverse); the
    rewrite gathers ``x`` on d directly. None for any other form."""
    readers = data_readers(wait, keep_output=True)
    inner = ag.args[0]
    if isinstance(inner, fx.Node) and inner.target in SAME_LAYOUT:
        inner = inner.args[0]  # .contiguous() of the moved shard
    if len(readers) != 1:
        return None
    d = swap_dim(readers[0])
    if d is None or swap_dim(inner) != d or readers[0].args[0] is not wait:
        return None
    return readers[0], d, (readers[0],), inner.args[0]


def _view_gather_dim(buffer: tuple, view: tuple, n: int) -> int | None:
    """The gather dim of funcol's view form: when the shard's dims before the gather dim d are
    all 1, ``[N, 1.., S, rest]`` is viewed as ``[1, 1.., N*S, rest]`` instead of split+cat."""
    if len(buffer) != len(view) or len(buffer) < 2 or not (same_size(buffer[0], n)
                                                           and same_size(view[0], 1)):
        return None
    for d in range(1, len(view)):
        if not same_size(view[d], buffer[d]):
            rest_same = all(same_size(view[i], buffer[i]) for i in range(d + 1, len(view)))
            ones_before = all(same_size(buffer[i], 1) for i in range(1, d))
            if rest_same and ones_before and same_size(view[d], n * buffer[d]):
                return d
            return None
    return None


def _check_trim(gathered: fx.Node, dim: int, shape: tuple, n: int, m: int, name: str) -> None:
    """DTensor's uneven gather: pad each shard to the largest, gather, then trim on ``dim``."""
    readers = data_readers(gathered)
    if len(readers) != 1 or readers[0].target is not aten.slice.Tensor:
        return
    trim = readers[0]
    if trim.args[0] is not gathered or norm_dim(node_arg(trim, 1, "dim", 0), len(shape)) != dim:
        return
    kept = shape_of(trim)[dim]
    if same_size(kept, shape[dim]):
        return
    raise Skip(f"uneven shards: gather dim {dim} holds {kept} elements over {n} ranks; DTensor "
               f"pads each shard to {shape[dim] // n} and trims the gathered tensor "
               f"at {trim.name}; pad dim {dim} to {round_up(kept, n * m)}"
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
        for user in data_readers(node, keep_output=True):
            if user.op == "call_function" and user.target in FLASH_MATMULS:
                for operand in ("A", "B"):
                    if matmul_operand(user, operand) is node:
                        uses.append(MatmulUse(node=user, operand=operand,
                                              dim=_matmul_dim(tags, gather_dim, operand),
                                              via=via))
                if node not in (matmul_operand(user, "A"), matmul_operand(user, "B")):
                    others.append(user)        # e.g. the bias of addmm
                continue
            if user.op == "call_function" and user.target in PASS_THROUGH:
                new_tags = propagate_dims(user, tags)
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


def claim_matmuls(matches: list[AllGatherMatch], result: PassResult,
                  scattered: dict[fx.Node, tuple[str, str, int]] | None = None
                  ) -> list[AllGatherMatch]:
    """One rewrite per matmul. When two all-gathers feed one matmul (both operands gathered:
    FSDP-style weights with a sequence-parallel input), the input (activation) gather is
    rewritten and the weight gather is skipped with the reason (between two gathers of one
    kind, the earlier one wins). ``scattered``: the matmuls whose output a reduce-scatter site
    would rewrite (matmul -> (its reduce-scatter's name, group name, group size)); a weight
    gathered over another group than that reduce-scatter's (SimpleFSDP's weight gather beside
    the TP output projection's reduce-scatter on a 2-D mesh) leaves the matmul to the
    reduce-scatter, whose activations are on the critical path, while a weight gather reads
    only parameters and can be issued ahead. The choice follows from the program alone, never
    from sizes, so every rank makes the same one::

        w = wait(all_gather(w_shard, dp))        (left, with the reason)
        y = mm(a, w)                      ->     y = mm(a, w) in tp's decomposed schedule
        out = wait(reduce_scatter(y, tp))        (the reduce-scatter's rewrite)
    """
    scattered = scattered or {}
    order = {m.all_gather: i for i, m in enumerate(matches)}
    ranked = sorted(matches, key=lambda m: (m.kind != "ag_input", order[m.all_gather]))
    owner: dict[fx.Node, AllGatherMatch] = {}
    kept = []
    for match in ranked:
        mms = {use.node for use in match.sliced}
        if match.kind == "ag_weight":
            beside = sorted((mm.name, scattered[mm]) for mm in mms if mm in scattered
                            and scattered[mm][1] != match.group_name)
            if beside:
                mm, (rs, _, size) = beside[0]
                result.skip(match.all_gather, AG_SITE,
                            f"{mm}'s output is reduce-scattered at {rs} over another group "
                            f"({size} ranks), which is rewritten instead: its activations are "
                            "on the critical path, while this weight gather reads parameters "
                            "only and can be issued ahead (one matmul, one decomposed "
                            "collective)")
                continue
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
