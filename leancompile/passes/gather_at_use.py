"""Gather at use: each parameter's all-gather moved down to where the graph first reads the
gathered weight (``CompileOptions(gather_at_use=True)``).

A sharded step that gathers its parameters inside the traced call often gathers them all
before any compute: ``GRPOTrainer(parallel="fsdp")`` gathers every part and then runs the
policy on the full tensors (``torch.func.functional_call``), and a model that reads its
parameters through one dict does the same. The graph then holds the whole model, gathered,
from its first node to each weight's last reader, which is the memory FSDP exists to avoid.
This pass moves each gather, its wait and what the graph computes from the gathered weight
alone (the slice that cuts the padding, casts, transposes) to right before the first node that
reads them with anything else; what came before stays where it was (a cast of the part before
its gather: a shard's worth of memory). Run before ``bucket_collectives``, whose buckets then
follow the order in which the model uses its weights, each issued one bucket ahead
(``passes/bucket_collectives.py``).

Before (two parameters, all gathers first)::

    g1 = all_gather_into_tensor(p1, R, group);  w1 = wait_tensor(g1);  t1 = permute(w1[:n1])
    g2 = all_gather_into_tensor(p2, R, group);  w2 = wait_tensor(g2);  t2 = permute(w2[:n2])
    h = mm(x, t1) ...
    y = mm(h, t2) ...

After (each weight gathered where it is first read)::

    g1 = all_gather_into_tensor(p1, R, group);  w1 = wait_tensor(g1);  t1 = permute(w1[:n1])
    h = mm(x, t1) ...
    g2 = all_gather_into_tensor(p2, R, group);  w2 = wait_tensor(g2);  t2 = permute(w2[:n2])
    y = mm(h, t2) ...

Legal: a moved node's inputs are graph inputs (the part, or a value computed from it before
the gather, which stays where it is) or nodes moved with it, so every input still comes first;
nothing between the old and the new place reads a moved value (the new place is the first
reader). The communication keeps its order: a gather moves no further than the next gather's
new place, nor past any node with an effect that stays (another collective or its wait, a
point-to-point step of the overlap pass, a mutation, a random draw), so every rank, and the
forward and inference graphs of one step (which a compiler may lay out differently: under
Inductor their first readers come in different orders), issue the same communication in the
same order as before the pass. That also limits the pass: where a graph issues every gather
first and reads the weights in another order (Inductor's), most gathers cannot move far.
Values are unchanged bit for bit: only the order of independent nodes changes.

Left alone, each with the reason: a gather of a value the graph computes (an activation, as
sequence parallelism gathers), a piece of an overlap schedule, a gather already right before
its first reader or the next effectful node, one whose result is never read or is read before
its wait.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .flash.splice import SITE_META
from .result import PassResult, is_barrier, is_pure_op, recompile

__all__ = ["gather_at_use_pass", "find_gathers_to_move", "move_gather", "GatherMove",
           "graph_input_gather", "graph_input_gathers", "input_chain",
           "NAME", "VERSION", "peak_gathered_bytes"]

NAME = "gather_at_use"
VERSION = 1

_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
WAIT = _c10d.wait_tensor.default
KIND = "all_gather"


_pure = is_pure_op


def input_chain(node) -> list[fx.Node] | None:
    """The pure single-input ops from a graph input to ``node`` (``node`` last; ``[]`` when
    ``node`` is the graph input), or None when ``node`` is not computed that way."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function" and _pure(node) \
            and len(node.all_input_nodes) == 1:
        chain.append(node)
        node = node.all_input_nodes[0]
    if not (isinstance(node, fx.Node) and node.op == "placeholder"):
        return None
    return chain[::-1]


def graph_input_gathers(nodes, result: PassResult, kind: str):
    """``(gather, input chain, waits)`` for each all-gather of ``nodes`` that
    ``graph_input_gather`` takes, in order; the others go to ``result`` with their reason."""
    for node in nodes:
        if node.op == "call_function" and node.target is ALL_GATHER:
            found = graph_input_gather(node, result, kind)
            if found is not None:
                yield node, *found


def graph_input_gather(node: fx.Node, result: PassResult, kind: str):
    """``(input chain, waits)`` of an all-gather of a graph input (``input_chain``) read only
    through ``wait_tensor``; else None, with the reason in ``result`` (a piece of an overlap
    schedule, an activation's gather, a result read before its wait). The test both gather
    passes (this one, ``prefetch_gathers``) put a gather through."""
    if SITE_META in node.meta:
        result.skip(node, kind, f"a piece of the overlap pass's schedule for "
                                f"{node.meta[SITE_META]}")
        return None
    chain = input_chain(node.args[0])
    if chain is None:
        result.skip(node, kind, "gathers a value the graph computes (an activation), "
                                "not a graph input: it stays where that value is made")
        return None
    waits = list(node.users)
    if not waits or any(w.target is not WAIT for w in waits):
        result.skip(node, kind, "its result is read before a wait_tensor (or never "
                                "waited on)")
        return None
    return chain, waits


@dataclass
class GatherMove:
    """One gather, its waits and the nodes computed from its result alone, in graph order,
    to be moved right before ``before``: its first reader, or earlier where the next
    collective already comes first."""

    gather: fx.Node
    nodes: list[fx.Node]
    first_read: fx.Node
    before: fx.Node | None = None


def find_gathers_to_move(gm: fx.GraphModule, result: PassResult) -> list[GatherMove]:
    """The all-gathers of graph inputs that can move closer to their first reader (module
    docstring), each with the node to move before; every other all-gather goes to ``result``
    with its reason."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    moves = []
    for node, _, waits in graph_input_gathers(nodes, result, KIND):
        # The nodes computed from this gather's result alone (views, casts, transposes).
        own, frontier = set(waits), list(waits)
        while frontier:
            for user in frontier.pop().users:
                if user not in own and _pure(user) and all(
                        i in own for i in user.all_input_nodes):
                    own.add(user)
                    frontier.append(user)
        readers = [u for n in own for u in n.users if u not in own]
        if not readers:
            result.skip(node, KIND, "its result is never read")
            continue
        moves.append(GatherMove(gather=node, nodes=[node, *sorted(own, key=pos.__getitem__)],
                                first_read=min(readers, key=pos.__getitem__)))
    # The collectives keep their order: a gather goes no later than the next one's new place,
    # nor past any other node with an effect that stays (a collective or its wait, a
    # point-to-point step, a mutation): every rank, and the forward and inference graphs of
    # one step, then issue the same communication in the same order as before the pass.
    # Decided from the last gather up, and moved in that order (``move_gather``).
    moving = {n for m in moves for n in m.nodes}
    staying_after: dict[fx.Node, fx.Node | None] = {}
    nxt = None
    for node in reversed(nodes):
        if node in moving:
            if node.target is ALL_GATHER:
                staying_after[node] = nxt
        elif is_barrier(node):
            nxt = node
    kept: list[GatherMove] = []
    # (position, node) of the next gather once moved: right before the node it moves before,
    # behind the gathers stacked there already (each a millionth of a place earlier; a real
    # node before that node still compares as before it)
    later: tuple[float, fx.Node] | None = None
    for move in reversed(moves):
        limits = [(pos[move.first_read], move.first_read)]
        if staying_after[move.gather] is not None:
            limits.append((pos[staying_after[move.gather]], staying_after[move.gather]))
        if later is not None:
            limits.append(later)
        at, move.before = min(limits, key=lambda limit: limit[0])
        in_place = move.before in pos and all(
            pos[n] == at - len(move.nodes) + i for i, n in enumerate(move.nodes))
        if in_place:
            what = "its first reader" if move.before is move.first_read else \
                "the next collective or other effectful node"
            result.skip(move.gather, KIND, f"already right before {what} "
                                           f"({move.before.name})")
            later = (pos[move.gather], move.gather)
        else:
            kept.append(move)
            later = (at - 1e-6, move.gather)
    return kept  # last gather first: each moves before a node that is already in place


def move_gather(move: GatherMove) -> None:
    """Move ``move.nodes`` (in their order) to right before ``move.before``."""
    for node in move.nodes:
        move.before.prepend(node)


def peak_gathered_bytes(gm: fx.GraphModule) -> int:
    """The most bytes of all-gather results, and of what the graph computes from them alone,
    alive at once when ``gm`` runs in its node order (a gathered buffer lives from its
    collective, where an asynchronous backend allocates it, to the last reader of its wait;
    other values from their node to their last reader; views count once, with what they view;
    graph outputs live to the end). A static measure of how much of a sharded model a graph
    holds gathered."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gathered: set[fx.Node] = set()
    sizes: dict[fx.Node, int] = {}
    end: dict[fx.Node, int] = {}
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is ALL_GATHER:  # its output buffer exists from here (async backends)
            gathered.add(node)
            root[node] = node
        elif node.target is WAIT and node.args[0] in gathered:  # the same tensor
            gathered.add(node)
            root[node] = root[node.args[0]]
        elif _pure(node) and node.all_input_nodes and all(
                i in gathered for i in node.all_input_nodes):
            gathered.add(node)
            is_view = node.target is operator.getitem or any(
                r.alias_info is not None for r in node.target._schema.returns)
            root[node] = root[node.all_input_nodes[0]] if is_view else node
        else:
            continue
        val = node.meta.get("val")
        if root[node] is node:
            sizes[node] = val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) \
                and all(isinstance(s, int) for s in val.shape) else 0
        last = max((pos[u] if u.op != "output" else len(nodes) for u in node.users),
                   default=pos[node])
        end[root[node]] = max(end.get(root[node], pos[node]), last)
    events = sorted([(pos[n], s) for n, s in sizes.items()] +
                    [(end[n] + 0.5, -s) for n, s in sizes.items()])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def gather_at_use_pass(gm: fx.GraphModule, options) -> PassResult:
    result = PassResult(name=NAME)
    moves = find_gathers_to_move(gm, result)
    for move in moves:
        move_gather(move)
        where = "its first reader" if move.before is move.first_read else \
            "the next collective or other effectful node, which comes first"
        result.rewrite(move.gather, f"{KIND} moved down to {where} ({move.before.name})")
    if moves:
        gm.graph.lint()
        recompile(gm)
    return result
