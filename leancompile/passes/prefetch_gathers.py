"""Prefetched gathers: each parameter all-gather the overlap pass leaves is issued one gather
ahead, right after the previous parameter gather of its process group is waited on, as FSDP2
prefetches (on with ``overlap=``; ``disable=("prefetch_gathers",)`` turns it off; not with
``gather_at_use=True``, whose buckets prefetch one bucket ahead instead).

Where it matters: a 2-D mesh (FSDP over one axis, tensor + sequence parallelism over the
other; torchtitan's SimpleFSDP + TP). There FlashOverlap decomposes the TP collectives, whose
activations are on the critical path, and leaves the FSDP gather of the same matmul's weight
as it was (``flash/all_gather_match.claim_matmuls``), waited on right where the weight is
used: exposed. A weight gather reads a parameter only, so it can be issued as early as the
graph likes; issuing it one gather ahead hides it behind the compute between the two waits
while holding at most one more gathered weight than before.

Before (one group ``dp``; between the waits, the attention and its TP schedules)::

    g1 = all_gather(wqkv_r, dp); wqkv = wait(g1)
    ... qkv = mm(x, wqkv) ... attention ... (TP P2P steps)
    g2 = all_gather(wo_r, dp);   wo = wait(g2)
    out = mm(a, wo)

After (the second gather issued as soon as the first is waited on)::

    g1 = all_gather(wqkv_r, dp); wqkv = wait(g1)
    g2 = all_gather(wo_r, dp)
    ... qkv = mm(x, wqkv) ... attention ... (TP P2P steps)
    wo = wait(g2)
    out = mm(a, wo)

A gather issued earlier than that (a graph that gathers every parameter first) moves down to
the same place, so that no more than one gather per group is in flight ahead of its use: the
memory FSDP's one-ahead prefetch holds, not the whole model's.

Which gathers: those of a graph input through pure single-input ops (a parameter's shard, a
mixed-precision cast of it), waited on with ``wait_tensor``, not a piece of an overlap
schedule. Found separately from moved (``find_prefetches``); each gather left where it is is
reported with the reason (the first of its group, already right after the previous wait,
waited on before the previous gather, a move that would cross a collective of its own group,
an activation's gather, a schedule's piece).

Under Inductor: its ``reorder_for_peak_memory`` (on by default) moves every collective down to
right before its wait, which would undo this; a graph with a gather this pass placed (or found)
one ahead turns it off for its own compile (``passes.issues_ahead``, ``passes.inductor_patches``;
``install()``: for every compile while installed).

Legal, and every rank agrees: a moved gather's inputs are graph inputs, or pure ops over them
that move with it, so they still come first; its wait stays where it was, and comes after the
new place (a gather waited on before the previous one is left alone), so every reader of the
gathered weight still comes after it. A move never crosses a collective or point-to-point step
of the gather's own group, and the group's gathers keep their order, so every rank issues each
group's communication in the same order; moves cross other groups' communication (the TP
schedules), and only issues move, never waits. Where each gather goes is read from the order of
the graph's communication (and which gathers read one input), not from sizes or compute, so
every rank, and the forward and inference graphs of one step (same communication, same order),
move the same gathers to the same place.
Values are unchanged bit for bit: only when a transfer starts changes.

Memory: a gathered weight exists from its gather's issue (where an asynchronous backend
allocates it) to its last reader, so one gather ahead holds, between two waits, the next
weight too: at most one parameter's gathered size more than before per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime.namespaces import ANY_COMMUNICATION_NAMESPACES
from .gather_at_use import graph_input_gathers
from .result import PassResult, recompile

__all__ = ["prefetch_gathers_pass", "find_prefetches", "move_prefetch", "Prefetch", "NAME",
           "VERSION", "META_KEY"]

NAME = "prefetch_gathers"
VERSION = 1
KIND = "all_gather"
META_KEY = "leancompile_prefetched"
"""``meta`` key of a gather placed one ahead (moved, or found in place): the wait it comes
right after."""


@dataclass
class Prefetch:
    """One gather and the pure ops computing its input from a graph input (``chain``, in
    graph order), to be moved right after ``after`` (the previous gather's wait)."""

    gather: fx.Node
    chain: list[fx.Node]
    after: fx.Node
    in_place: bool = False
    """Already right after ``after``: nothing moves; tagged as issued ahead."""


def find_prefetches(gm: fx.GraphModule, result: PassResult) -> list[Prefetch]:
    """The graph-input gathers to issue one gather ahead (module docstring): the moves, then
    those already in place (``in_place``, also reported skipped); every other all-gather goes
    to ``result`` with its reason."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    groups: dict[tuple, list[tuple[fx.Node, list[fx.Node], fx.Node]]] = {}
    for node, chain, waits in graph_input_gathers(nodes, result, KIND):
        if len(node.args) < 3:
            result.skip(node, KIND, "its group is not given positionally (group size, name)")
            continue
        groups.setdefault((node.args[1], node.args[2]), []).append(
            (node, chain, min(waits, key=pos.__getitem__)))
    found, in_place, claimed = [], [], set()
    for (_, name), gathers in groups.items():
        listed = {g for g, _, _ in gathers}
        moves, at = [], {}  # at: where each of the group's gathers is issued after the moves
        for k, (node, chain, wait) in enumerate(gathers):
            at[node] = pos[node]
            if k == 0:
                result.skip(node, KIND, f"the first gather of group {name!r} in this graph: "
                                        "no earlier wait to issue it after")
                continue
            previous = gathers[k - 1][2]
            if pos[wait] < pos[previous]:
                result.skip(node, KIND, f"waited on ({wait.name}) before the previous gather "
                                        f"of its group ({previous.name}): left where it is")
                continue
            # Up: the chain from the previous wait on moves too; what comes before stays.
            # Down: the chain stays above (inputs still come first); the gather moves alone.
            moving = [n for n in chain if pos[n] > pos[previous]]
            if all(pos[n] == pos[previous] + 1 + i for i, n in enumerate([*moving, node])):
                result.skip(node, KIND, f"already right after the previous gather's wait "
                                        f"({previous.name}): issued one ahead as it is")
                in_place.append(Prefetch(gather=node, chain=[], after=previous, in_place=True))
                continue
            shared = [n for n in moving if n in claimed]
            if shared:  # one input gathered twice: it moves with the first gather only
                result.skip(node, KIND, f"its input {shared[0].name} moves up with another "
                                        "gather: left where it is")
                continue
            low, high = sorted((pos[node], pos[previous]))
            crossed = [n for n in nodes[low + 1:high] if n not in listed and _of_group(n, name)]
            if crossed:
                result.skip(node, KIND, f"moving it next to {previous.name} would cross "
                                        f"{crossed[0].name}, a collective of its own group: "
                                        "each group's communication keeps its order")
                continue
            moves.append(Prefetch(gather=node, chain=moving, after=previous))
            claimed.update(moving)
            at[node] = pos[previous] + 0.5
        order = [g for g, _, _ in gathers]
        if sorted(order, key=at.__getitem__) != order:
            # A gather left where it is would come before an earlier one moved down past it:
            # the group's gathers keep their order, so none of them moves.
            for move in moves:
                result.skip(move.gather, KIND, "moving the group's gathers one ahead would "
                                               "change their order (another of them is left "
                                               "where it is): left where it is")
            continue
        found += moves
    return found + in_place


def _of_group(node: fx.Node, name: str) -> bool:
    """Whether ``node`` may issue communication on group ``name``: a communication op given
    that name, or one whose group is not a name (a process group object, as under
    ``TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK``), or a higher-order op (a subgraph may hold
    collectives). Waits issue nothing."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return True
    if getattr(node.target, "namespace", None) not in ANY_COMMUNICATION_NAMESPACES or \
            "wait" in str(node.target):
        return False
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name in ("group_name", "group"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return not isinstance(value, str) or value == name
    # no group argument: an op of these namespaces that does not communicate (an attention
    # backward of vmap_ops.py), or one whose group it does not say (in-place c10d ops take a
    # process group object): only the latter counts
    return getattr(node.target, "namespace", None) != "leancompile"


def move_prefetch(prefetch: Prefetch) -> None:
    """Move the gather (after its moving chain) to right after ``prefetch.after``, and tag it
    (``META_KEY``: read by ``strict=True`` and ``passes.issues_ahead``)."""
    if not prefetch.in_place:
        at = prefetch.after
        for node in [*prefetch.chain, prefetch.gather]:
            at.append(node)
            at = node
    prefetch.gather.meta[META_KEY] = prefetch.after.name


def prefetch_gathers_pass(gm: fx.GraphModule, options) -> PassResult:
    result = PassResult(name=NAME)
    prefetches = find_prefetches(gm, result)
    for prefetch in prefetches:
        move_prefetch(prefetch)
        if not prefetch.in_place:  # (an in-place one is reported skipped, with why)
            result.rewrite(prefetch.gather, f"{KIND} issued after the previous gather's wait "
                                            f"({prefetch.after.name})")
    if any(not p.in_place for p in prefetches):
        gm.graph.lint()
        recompile(gm)
    return result
