"""FlashOverlap for Ulysses sequence parallelism: all-to-all -> attention -> all-to-all sites
become per-query-slice attention interleaved with P2P exchanges.

Ulysses attention (``leancompile.integrations.sequence_parallel``, DeepSpeed-Ulysses, diffusers'
context parallelism) re-lays query, key and value from "my tokens, all heads" to "all tokens,
my heads" with one ``all_to_all_single`` each, runs attention, and re-lays the output back with
a fourth. Rank r of N, before (layout ops between the nodes not shown)::

    q = wait(all_to_all_single(q_local))           # [N pieces: the query tokens of each rank]
    k = wait(all_to_all_single(k_local)); v = ...  # whole: every query needs every key
    o, lse = attention(q, k, v)
    out = wait(all_to_all_single(o))               # piece j (rank j's query tokens) to rank j

after (``leancompile.runtime.a2a_schedules.flash_all_to_all_compute``)::

    h_i = p2p_start(q_local[r+i] -> r+i, <- r-i)   for i = 1..N-1, posted where q was
    ...                                            # k and v exchanged as before
    o_r = attention(q_local[r], k, v)              # own query slice: no transfer to wait for
    q_{r-i} = p2p_wait(h_i); o_{r-i} = attention(q_{r-i}, k, v)
    g_i = p2p_start(o_{r-i} -> r-i, <- r+i)        # each result goes home while the next runs
    out = cat(o_r, p2p_wait(g_1), ...)             # only the last return hop is exposed

Why it is legal: attention computes each query row from that row and all keys and values, so
attention over a slice of the query rows is the same rows of attention over all of them; the
slices the first all-to-all delivers from rank j are exactly the rows whose output the second
all-to-all sends back to rank j (checked on the layouts: the matcher follows the source-rank
dim through the permutes and reshapes on both sides). The exchanges move the same bytes. Values
agree with the unrewritten graph up to the kernel's blocking of fewer query rows (float
tolerance; bitwise where the kernel does not depend on the row count).

The key and value all-to-alls are not rewritten: every query slice needs them whole, and a
decomposed all-to-all with nothing to overlap is no faster than the backend's own (Inductor
may still move its wait later). They are reported as skipped with that reason, as is every
all-to-all that is not the query or output side of such an attention.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ...runtime.attention_rows import cat_like
from ..result import PassResult
from .splice import (SITE_META, detach_metadata_readers, erase_if_dead, hoist, inline, replay,
                     trace, users_before)
from .vocabulary import (A2A_SITE, ALL_TO_ALL, ATTENTION_SITE, LAYOUT, RESHAPES, Skip,
                         descendants, describe, find_sites, node_val, only_wait, reshape_groups,
                         shape_of)

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SDPA = (_FORWARD, _BACKWARD)
_ANY_SDPA = _SDPA + (aten._scaled_dot_product_flash_attention.default,
                     aten._scaled_dot_product_efficient_attention.default,
                     aten._scaled_dot_product_cudnn_attention.default,
                     aten._scaled_dot_product_flash_attention_backward.default,
                     aten._scaled_dot_product_efficient_attention_backward.default,
                     aten._scaled_dot_product_cudnn_attention_backward.default)
# Backward: (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal); the args
# split by query rows with grad_out, and the outputs summed over the slices (grad_k, grad_v).
_ROW_ARGS = (1, 4, 5)
_SUMMED = (1, 2)

__all__ = ["AllToAllMatch", "AttentionMatch", "find_all_to_all_matches", "rewrite_attention"]


@dataclasses.dataclass(frozen=True)
class AllToAllMatch:
    """An ``all_to_all_single`` with equal splits along dim 0 and its one ``wait_tensor``."""

    all_to_all: fx.Node
    wait: fx.Node
    group_name: str
    world: int


@dataclasses.dataclass(frozen=True)
class AttentionMatch:
    """``query``'s output reaches ``attention``'s query through the layout ops ``q_chain``
    (the source-rank dim of each in ``q_dims``); the attention output reaches ``output``'s
    input through ``out_chain`` (``out_dims``)."""

    query: AllToAllMatch
    q_chain: tuple[fx.Node, ...]
    q_dims: tuple[int, ...]
    attention: fx.Node
    out_chain: tuple[fx.Node, ...]
    out_dims: tuple[int, ...]
    output: AllToAllMatch


def find_all_to_all_matches(graph: fx.Graph, result: PassResult, *,
                            on_error: str = "raise") -> list[AttentionMatch]:
    """The query-split attention sites of ``graph``; every other all-to-all is recorded in
    ``result`` as skipped, with its reason."""
    a2as = find_sites(graph, ALL_TO_ALL, A2A_SITE, _match_all_to_all, result, on_error)
    by_wait = {m.wait: m for m in a2as}
    by_input = {m.all_to_all.args[0]: m for m in a2as}
    sites, used = [], set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _ANY_SDPA:
            continue
        try:
            site = _match_attention(node, by_wait, by_input)
        except Skip as skip:
            if _layout_root(node.args[0]) in by_wait:
                result.skip(node, ATTENTION_SITE, skip.args[0])
            continue
        except Exception as exc:  # noqa: BLE001 - reported as the skip reason
            if on_error == "raise":
                raise
            result.skip(node, ATTENTION_SITE, f"the matcher raised {type(exc).__name__}: "
                        f"{exc}; the site was left as it was (a bug in leancompile)")
            continue
        if {site.query, site.output} & used:
            result.skip(node, ATTENTION_SITE, "its all-to-alls belong to another attention site")
            continue
        used |= {site.query, site.output}
        sites.append(site)
    for match in a2as:
        if match in used:
            continue
        reason = _why_left(match, sites)
        result.skip(match.all_to_all, A2A_SITE, reason)
    return sites


def _layout_root(node):
    """``node`` seen back through layout ops: the first node that is not one."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in LAYOUT:
        node = node.args[0]
    return node


def _why_left(match: AllToAllMatch, sites: list[AttentionMatch]) -> str:
    for site in sites:
        if site.attention.target is _FORWARD and any(
                _layout_root(x) is match.wait for x in site.attention.args[1:3]):
            return ("the key or value all-to-all of the attention at "
                    f"{site.attention.name}: every query slice needs it whole; the backend's "
                    "all-to-all is as fast as a decomposed one with nothing to overlap")
        root = _layout_root(match.all_to_all.args[0])
        if site.attention.target is _BACKWARD and root.target is operator.getitem and \
                root.args[0] is site.attention and root.args[1] in _SUMMED:
            return ("the key or value gradient all-to-all of the attention backward at "
                    f"{site.attention.name}: its input is a sum over every query slice, "
                    "complete only after the last one")
    names = ", ".join(map(describe, match.wait.users)) or "nothing"
    return ("not the query or output all-to-all of an attention (Ulysses: all-to-all -> "
            "attention -> all-to-all); nothing to slice next to it (read by "
            f"{names}); left to the backend")


def _match_all_to_all(node: fx.Node) -> AllToAllMatch:
    x, out_splits, in_splits, group_name = node.args[:4]
    shape = shape_of(x)
    wait = only_wait(node)
    from ...runtime.p2p import group_rank_and_size

    try:
        _, world = group_rank_and_size(group_name)
    except Exception:  # noqa: BLE001 - not a live group in this process
        raise Skip(f"group {group_name!r} is unknown: not a registered process group name "
                   "(unknown group)") from None
    if world == 1:
        raise Skip("a group of one rank: nothing is exchanged")
    if not shape or not isinstance(shape[0], int):
        raise Skip(f"dim 0 of the input has the symbolic size {shape[0] if shape else '-'}: "
                   "query split needs static sizes", local="shape")
    if shape[0] % world:
        raise Skip(f"dim 0 of the input ({shape[0]}) does not split into {world} equal "
                   "pieces", local="shape")
    piece = shape[0] // world
    for name, splits in (("input", in_splits), ("output", out_splits)):
        if splits is not None and list(splits) != [piece] * world:
            raise Skip(f"{name} split sizes {list(splits)} are not {world} equal pieces of "
                       f"dim 0 ({shape[0]}): the decomposition handles equal pieces only")
    return AllToAllMatch(node, wait, group_name, world)


def _match_attention(attention: fx.Node, by_wait: dict, by_input: dict) -> AttentionMatch:
    if attention.target not in _SDPA:
        raise Skip(f"{attention.target} is not split by query here: the rewrite handles "
                   "_scaled_dot_product_flash_attention_for_cpu (the CPU attention kernel "
                   "this project can test); its all-to-alls are left to the backend")
    query = attention.args[0]  # the backward's grad_out: split by query rows the same way
    chain = []
    node = query
    while node not in by_wait:
        if not isinstance(node, fx.Node) or node.op != "call_function" or \
                node.target not in LAYOUT:
            raise Skip("the query does not come from an all-to-all through layout ops "
                       f"(reached {describe(node) if isinstance(node, fx.Node) else node})")
        chain.append(node)
        node = node.args[0]
    q = by_wait[node]
    chain.reverse()
    backward = attention.target is _BACKWARD
    flags = 6 if backward else 3
    args = list(attention.args) + [None] * 8
    dropout, causal = args[flags] or 0.0, bool(args[flags + 1])
    if dropout:
        raise Skip(f"dropout_p={dropout}: query slices would draw other dropout masks")
    if causal:
        raise Skip("is_causal=True: a query slice's causal mask depends on its offset; not "
                   "split")
    if attention.kwargs.get("attn_mask") is not None:
        raise Skip("an attention mask: slicing it by query rows is not implemented")
    if any(isinstance(a, fx.Node) for a in (*attention.args[flags:],
                                            *attention.kwargs.values())):
        raise Skip("an attention argument other than query, key and value is computed in "
                   "the graph")
    qval = shape_of(query)
    if len(qval) != 4:
        raise Skip(f"query of shape {qval}: expected [batch, heads, sequence, head_dim]")
    q_dims = _track(chain, 0, q.world, "query")
    if (q_dims[-1] if q_dims else 0) != 2:
        raise Skip("the all-to-all's source-rank dim is not the outer part of the query's "
                   "sequence dim: the pieces are not query slices")
    if set(attention.args[1:flags]) & descendants(q.wait):
        raise Skip("another attention input is computed from the query's all-to-all")
    if backward:
        seq = qval[2]
        for i in _ROW_ARGS:
            shape = shape_of(attention.args[i])
            if len(shape) < 3 or shape[2] != seq:
                raise Skip(f"attention backward input {i} has shape {shape}: expected the "
                           f"query rows ({seq}) in dim 2")
    out_node = next((u for u in attention.users if u.target is operator.getitem
                     and u.args[1] == 0), None)
    if out_node is None:
        raise Skip("the attention output is unused")
    out_chain = _path_to_all_to_all(out_node, by_input)
    if out_chain is None:
        raise Skip("the attention output does not reach one all-to-all through layout ops")
    out = by_input[out_chain[-1] if out_chain else out_node]
    if out.group_name != q.group_name or out.world != q.world:
        raise Skip("the output all-to-all runs on another group than the query's")
    out_dims = _track(out_chain, 2, q.world, "output")
    if (out_dims[-1] if out_dims else 2) != 0:
        raise Skip("the attention output's sequence slices are not the pieces its "
                   "all-to-all sends (the query rows would go to the wrong ranks)")
    return AttentionMatch(q, tuple(chain), tuple(q_dims), attention, tuple(out_chain),
                          tuple(out_dims), out)


def _path_to_all_to_all(start: fx.Node, by_input: dict) -> list[fx.Node] | None:
    """The layout ops from ``start`` (excluded) to an all-to-all's input (included; empty
    when ``start`` is that input), if exactly one such path exists."""
    found = [[]] if start in by_input else []

    def walk(node, path):
        for user in node.users:
            if user.op == "call_function" and user.target in LAYOUT and user.args[0] is node:
                if user in by_input:
                    found.append(path + [user])
                walk(user, path + [user])

    walk(start, [])
    return found[0] if len(found) == 1 else None


def _track(chain, dim: int, world: int, what: str) -> list[int]:
    """The dim holding the rank index (the outer factor of ``world``) after each node of
    ``chain``; ``Skip`` when a node mixes it with other dims."""
    dims = []
    for node in chain:
        src, dst = shape_of(node.args[0]), shape_of(node)
        if node.target is aten.permute.default:
            perm = [p % len(dst) for p in node.args[1]]
            dim = perm.index(dim)
        elif node.target in RESHAPES:
            groups = reshape_groups(src, dst)
            if groups is None:
                raise Skip(f"the {what} layout {node.name} {src} -> {dst} is not a reshape "
                           "of whole dims")
            src_dims, dst_dims = next(g for g in groups if dim in g[0])
            if any(src[k] != 1 for k in src_dims if k < dim):
                raise Skip(f"{node.name} merges the rank dim into a dim below another one "
                           f"({src} -> {dst}): the pieces are not contiguous slices")
            dim = next((k for k in dst_dims if dst[k] != 1), dst_dims[0])
            if not isinstance(dst[dim], int) or dst[dim] % world:
                raise Skip(f"{node.name} splits the rank dim ({src} -> {dst})")
        elif node.target not in (aten.clone.default, aten.alias.default):
            raise Skip(f"{describe(node)} between the all-to-all and the attention")
        dims.append(dim)
    return dims


# ----------------------------------------------------------------------------------------------
# Rewrite


def rewrite_attention(gm: fx.GraphModule, match: AttentionMatch, result: PassResult) -> None:
    """Replace the query all-to-all, the attention and the output all-to-all of ``match``
    by this rank's query-split schedule (module docstring)."""
    from ...runtime.a2a_schedules import computed_order, flash_all_to_all_compute
    from ...runtime.p2p import group_rank_and_size

    graph = gm.graph
    q, out, attention = match.query, match.output, match.attention
    world = q.world
    backward = attention.target is _BACKWARD
    getitems = {u.args[1]: u for u in attention.users if u.target is operator.getitem}
    x = q.all_to_all.args[0]
    flags = 6 if backward else 3
    operands = list(attention.args[1:flags])
    rest = tuple(attention.args[flags:])
    kwargs = dict(attention.kwargs)
    likes = [node_val(getitems[i]) if i in getitems else None
             for i in range(len(node_val(attention)))]
    rows = shape_of(attention.args[0])[2] // world

    def schedule(x, *operands):
        def compute(piece, j):
            first = replay(match.q_chain, match.q_dims, world, piece)
            args = list(operands)
            if backward:  # query, out and logsumexp: this slice's rows
                for i in _ROW_ARGS:
                    args[i - 1] = args[i - 1].narrow(2, j * rows, rows)
            outs = attention.target(first, *args, *rest, **kwargs)
            send = replay(match.out_chain, match.out_dims, world, outs[0])
            return (*outs, send)

        received, outputs, back = flash_all_to_all_compute(
            x, compute, group_name=q.group_name)
        full = []
        for i, like in enumerate(likes):
            if like is None:
                continue
            if backward and i in _SUMMED:  # grad_k, grad_v: the sum over the query slices
                total = None
                for j in computed_order(group_rank_and_size(q.group_name)[0], world):
                    total = outputs[j][i] if total is None else total + outputs[j][i]
                full.append(total)
            else:
                full.append(cat_like([o[i] for o in outputs], 2, like))
        return (torch.cat(received, 0), torch.cat(back, 0), *full)

    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [x, *operands]
    sub = trace(schedule, inputs)
    # The schedule goes where the attention was (key and value are ready there); readers of
    # the query all-to-all's result that come before it move after it (pure layout ops).
    late = users_before(list(q.wait.users), attention, order)
    anchor = attention
    outs = inline(graph, sub, inputs, anchor, q.all_to_all.name)
    received, back, *full = outs
    for node in late:  # after the schedule's outputs, in their order
        anchor.prepend(node)
    q.wait.replace_all_uses_with(received)
    out.wait.replace_all_uses_with(back)
    it = iter(full)
    for i, like in enumerate(likes):
        if like is not None:
            getitems[i].replace_all_uses_with(next(it))
    _post_early(graph, q.all_to_all, world)
    replaced = [q.all_to_all, q.wait, *match.q_chain, attention, *getitems.values(),
                *match.out_chain, out.all_to_all, out.wait]
    detach_metadata_readers([q.wait, out.wait])
    erase_if_dead(graph, replaced)  # last first: each is erased once its readers are
    for node in (q.all_to_all, out.all_to_all):
        if not getattr(node, "_erased", False):
            raise AssertionError(f"{node.name} is still read after the rewrite")
    result.rewrite(q.all_to_all, ATTENTION_SITE)
    result.rewrite(out.all_to_all, ATTENTION_SITE)


def _post_early(graph: fx.Graph, anchor: fx.Node, world: int) -> None:
    """Move the first exchange's posts (and the slices they send) up to where the query
    all-to-all was: the transfers start as soon as the query is ready."""
    from ...runtime.p2p import P2P_START

    order = {n: i for i, n in enumerate(graph.nodes)}
    starts = [n for n in graph.nodes if n.op == "call_function" and n.target is P2P_START
              and n.meta.get(SITE_META) == anchor.name][:world - 1]
    for start in starts:  # posts have side effects: hoist moves only what they send
        for arg in start.all_input_nodes:
            hoist(arg, anchor, order)
        anchor.prepend(start)
        order[start] = order[anchor] - 0.5
