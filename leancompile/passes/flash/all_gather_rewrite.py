"""FlashOverlap's all-gather rewrite: an ``AllGatherMatch`` (``all_gather_match.py``) becomes
this rank's P2P schedule (``runtime/flash_schedules.py``) interleaved with per-slice matmuls, or
the sliced baseline (``runtime/sliced_schedules.py``), traced into the graph
(``splice.py``), so every P2P step and every slice's matmul is a node.

Input all-gather + matmul (column-parallel, sequence-parallel input), rank r of N::

    before:  g = wait(all_gather(x_r)); y = mm(reshape(g), W)
    after:   y_r = mm(x_r, W); h0 = p2p_start(x_r -> r+1, <- r-1); ...
             x_{r-1} = p2p_wait(h0); y_{r-1} = mm(x_{r-1}, W); ...; y = cat(rows)

Weight all-gather + matmul (FSDP-style parameter gather: the gathered rows of an (out, in)
weight are the output's columns)::

    before:  w = wait(all_gather(w_r)); y = mm(x, t(view(w)))
    after:   y_r = mm(x, t(w_r)); h0 = p2p_start(w_r -> r+1, <- r-1); ...
             w_{r-1} = p2p_wait(h0); y_{r-1} = mm(x, t(w_{r-1})); ...; y = cat(columns)

Why it is legal: an all-gather followed by a matmul that slices the gathered dim (rows of the
output for an input gather, columns for a weight gather) computes each output slice from one
gathered slice, in any order; the schedule computes the same slices with the same matmul on
the same data (bitwise for input gathers; a weight gather's narrower matmul may block the
columns differently in BLAS: float tolerance).

The matcher decided that the site's form is one the schedules take; what can still fail here
is splicing (``Unsupported``: a node that must move before the schedule, or after it, cannot),
which leaves the site as it was, reported with that reason.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx as fx

from ..result import PassResult
from .all_gather_match import AllGatherMatch
from .splice import (SITE_META, Unsupported, detach_metadata_readers, erase_if_dead, hoist,
                     inline, raw_sizes_bound_later, trace, users_before)
from .vocabulary import AG_SITE, matmul_operands, node_val

__all__ = ["rewrite_all_gather"]

aten = torch.ops.aten


def rewrite_all_gather(gm: fx.GraphModule, match: AllGatherMatch, *, chunks_per_rank: int,
                       overlap: str, chunks: int, result: PassResult) -> bool:
    """Replace ``wait(all_gather(shard)) -> [reshape, transpose] -> mm`` for every matmul whose
    output the gather dim slices with this rank's Flash-AG schedule (or the sliced baseline):
    input gathers (rows of the output, ``kind="ag_input"``) and weight gathers (columns of the
    output, ``kind="ag_weight"``); see the module docstring. A site the schedule cannot be
    spliced in for is left as it was and reported skipped with the reason (False)."""
    shard = match.shard
    try:
        if match.cast is not None:
            match = dataclasses.replace(match, shard=_cast_shard(gm.graph, match))
        inputs, schedule = (_weight_gather_plan if match.kind == "ag_weight" else
                            _input_gather_plan)(match, chunks_per_rank, overlap, chunks)
        _inline_all_gather(gm.graph, match, match.sliced, inputs, schedule)
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
    """(schedule inputs, schedule) for a gather of the matmuls' A operand (rows)."""
    from ...runtime.flash_schedules import flash_all_gather_matmul
    from ...runtime.sliced_schedules import sliced_all_gather_matmul

    operands = [matmul_operands(u.node) for u in match.sliced]  # (bias, A, B) each
    weights = [ops[2] for ops in operands]
    biases = [ops[0] for ops in operands]
    fn = sliced_all_gather_matmul if overlap == "slice" else flash_all_gather_matmul
    schedule = _gather_schedule(fn, biases, overlap, m, chunks, group_name=match.group_name,
                                gather_dim=match.gather_dim)
    return [match.shard, *weights, *(b for b in biases if b is not None)], schedule


def _weight_gather_plan(match: AllGatherMatch, m: int, overlap: str, chunks: int):
    """(schedule inputs, schedule) for a gather of the matmuls' B operand (FSDP-style: the
    gathered rows of an (out, in) weight are the output's columns)."""
    from ...runtime.flash_schedules import flash_all_gather_weight_matmul
    from ...runtime.sliced_schedules import sliced_all_gather_weight_matmul

    # 2-D with the gather dim in the matmul's N dim: B is the gathered W transposed (an
    # nn.Linear weight (out, in) gathered on out) or W itself ((K, N) gathered on N).
    layout = "linear" if match.gather_dim == 0 else "kn"
    operands = [matmul_operands(u.node) for u in match.sliced]  # (bias, A, B) each
    xs = [ops[1] for ops in operands]
    biases = [ops[0] for ops in operands]
    fn = (sliced_all_gather_weight_matmul if overlap == "slice" else
          flash_all_gather_weight_matmul)
    schedule = _gather_schedule(fn, biases, overlap, m, chunks, group_name=match.group_name,
                                layout=layout)
    return [match.shard, *xs, *(b for b in biases if b is not None)], schedule


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
