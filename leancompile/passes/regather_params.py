"""Re-gather parameters in the backward: FSDP's ``reshard_after_forward`` for a traced step.

A step whose parameters are sharded over the ranks all-gathers each one inside its forward
graph (``leancompile/grpo/fsdp.py``, torchtitan's SimpleFSDP). Left to itself, AOTAutograd's
partitioner saves the gathered, full-size weights for the backward: it never recomputes a
collective (``force_save_collectives``), so every call that keeps its saved tensors keeps a
full copy of the weights. For Retain, which keeps the saved tensors of every trained
denoising step until the update, that is one full model per kept step, the memory FSDP exists
to avoid. This transform marks each parameter's gather, and what the forward computes from
gathered weights with nothing but constants and values the caller holds anyway (casts, slices,
transposes, a weight scaled by a buffer), as ``MUST_RECOMPUTE`` in the joint graph before the
partitioner runs, as ``torch.utils.checkpoint`` with a selective policy would:
the forward then saves nothing derived from the gathered weight, and the backward gathers the
part again where it needs the weight.

Joint graph before (one sharded parameter ``primals_1``, its part ``[c, k]``)::

    ag = all_gather_into_tensor(primals_1, R, group)    # forward
    w = wait_tensor(ag)[:n]                             # [n, k], full
    wt = permute(w, [1, 0])
    y = mm(x, wt)
    ...
    dx = mm(dy, permute(wt, [1, 0]))                    # backward reads the full weight

Forward and backward graphs after the partitioner, with the chain marked::

    forward:  ... y = mm(x, wt) ...       return (y, primals_1, x, ...)  # the part, not w
    backward: ag = all_gather_into_tensor(primals_1, R, group)
              w = wait_tensor(ag)[:n]; wt = permute(w, [1, 0])
              dx = mm(dy, permute(wt, [1, 0])) ...

Legal: the marked nodes are functions of the parts, other parameters, buffers (graph inputs,
held by the caller for the backward anyway) and constants, so recomputing them gives the same
values bit for bit (a gather concatenates; the casts and views are deterministic). Every rank
traces the same graph and marks the same nodes, so the backward's gathers pair across the
ranks; the partitioner recomputes a collective only when it is marked so
(``force_save_collectives`` spares those), which is why the mark is needed. What the
partitioner then saves of the marked nodes all the same is checked on the forward it made and
reported (``RegatherFound.saved``).

Find and mark are separate (``find_regather_sites``, ``mark_regather``). A gather is left as
the partitioner makes it, with the reason, when its input is not a parameter reached through
single-input ops (an activation gathered by sequence parallelism: its value is not held by the
caller, re-gathering it would add communication the forward did not save), or when it is inside
a ``torch.utils.checkpoint`` region (that region's policy decides). Nodes of a checkpoint region
that read the gathered weight keep their region's tags: the region recomputes them, and the
weight it reads, marked here, is gathered again for it. Not in ``PASSES``:
those run on the partitioned graphs; this one runs on the joint graph
(``partition_with_regather``), for the graphs ``leancompile.capture`` traces with
``StepConfig(reshard_after_forward=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from .result import format_bytes, is_pure_op

__all__ = ["RegatherSite", "RegatherFound", "find_regather_sites", "mark_regather",
           "partition_with_regather"]

_GATHER = "all_gather_into_tensor"
AC_GRAPH_ID = 1 << 20
"""The ``ac_graph_id`` the marked nodes carry (one region, above any checkpoint's ids)."""


@dataclass(frozen=True)
class RegatherSite:
    """One parameter's gather and the forward nodes computed from its result alone."""

    gather: str
    parameter: str
    """The joint graph's placeholder of the part (``primals_<i>``)."""
    input_index: int
    """Its position among the graph's inputs."""
    nodes: tuple[str, ...]
    """Every node marked ``MUST_RECOMPUTE`` for it, in graph order (casts before the gather,
    the gather, its wait, the views and casts after)."""
    nbytes: int
    """Bytes of the gathered tensor (what a saved copy of it would take)."""


@dataclass
class RegatherFound:
    sites: list[RegatherSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(gather node, reason) for each all-gather left as the partitioner makes it."""
    saved: list[tuple[str, int]] = field(default_factory=list)
    """(node, bytes) of marked nodes the partitioner saved for the backward all the same
    (checked on the forward graph it made; empty when the marks held)."""

    @property
    def gathered_bytes(self) -> int:
        return sum(s.nbytes for s in self.sites)

    def summary(self) -> str:
        saved = ("saved for the backward all the same: "
                 + ", ".join(f"{n} ({format_bytes(b)})" for n, b in self.saved)) \
            if self.saved else "none of it saved for the backward"
        text = (f"regather_params: {len(self.sites)} parameter gather(s) recomputed where the "
                f"backward reads the weight ({format_bytes(self.gathered_bytes)} gathered per "
                f"call; {saved})")
        if self.skipped:
            text += "; left alone: " + "; ".join(f"{n} ({r})" for n, r in self.skipped)
        return text


def _is_op(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and name in str(node.target)


_pure = is_pure_op


def _forward_nodes(graph: fx.Graph, num_fwd_outputs: int) -> set[fx.Node]:
    """Nodes the forward outputs depend on (the partitioner's forward region)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    todo = list(output.args[0][:num_fwd_outputs])
    seen: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen


def find_regather_sites(graph: fx.Graph, *, num_fwd_outputs: int, params: set[int],
                        static: set[int] = frozenset()) -> RegatherFound:
    """The all-gathers of parameters in the forward of the joint ``graph`` and the nodes to
    recompute with each (module docstring); ``params``: the input positions that are
    parameters; ``static``: other inputs the caller holds for the backward too (buffers), which
    the recomputed nodes may read. Every other all-gather is skipped with its reason."""
    found = RegatherFound()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    forward = _forward_nodes(graph, num_fwd_outputs)
    owner: dict[fx.Node, int] = {}  # node -> the site (its position in ``seeds``) it is part of
    seeds: list[tuple[fx.Node, fx.Node, fx.Node]] = []  # (gather, part, first wait)
    for node in graph.nodes:
        if not _is_op(node, _GATHER):
            continue
        if node not in forward:
            found.skipped.append((node.name, "only the backward reads it: the partitioner "
                                  "already leaves it to the backward"))
            continue
        chain, source = [], node.args[0]
        while isinstance(source, fx.Node) and source.op == "call_function" and _pure(source) \
                and len(source.all_input_nodes) == 1:
            chain.append(source)
            source = source.all_input_nodes[0]
        if not (isinstance(source, fx.Node) and source.op == "placeholder"):
            found.skipped.append((node.name, "gathers a value the forward computes from "
                                  "activations, not a parameter: the backward reads it as "
                                  "saved"))
            continue
        if index[source] not in params:
            found.skipped.append((node.name, f"gathers the input {source.name}, which is not "
                                  "a parameter: re-gathering it in the backward would add "
                                  "communication; saved as the partitioner decides"))
            continue
        if "recompute" in node.meta:
            found.skipped.append((node.name, "inside a torch.utils.checkpoint region: its "
                                  "policy decides whether the backward gathers again"))
            continue
        waits = [u for u in node.users if _is_op(u, "wait_tensor")]
        if not waits or len(waits) != len(node.users):
            found.skipped.append((node.name, "its result is read by something other than "
                                  "wait_tensor"))
            continue
        for member in (*chain, node, *waits):
            owner.setdefault(member, len(seeds))
        seeds.append((node, source, waits[0]))
    # What the forward computes from gathered weights (one or several, e.g. two weights
    # concatenated), constants and values the caller holds anyway (parameters, buffers, and
    # what is computed from those alone): views, casts, transposes, a weight scaled by a
    # buffer; recomputed with the gathers so that none of it is saved. One pass in graph order
    # (inputs come before their users).
    held = {n for n in placeholders if index[n] in params or index[n] in static}
    for node in graph.nodes:
        if node.op == "get_attr":
            held.add(node)
            continue
        if node in owner or node not in forward or not _pure(node) or "recompute" in node.meta:
            continue  # (a node of a checkpoint region keeps its region's policy)
        inputs = node.all_input_nodes
        if inputs and all(i in held for i in inputs):
            held.add(node)
        elif inputs and all(i in owner or i in held for i in inputs):
            owner[node] = next(owner[i] for i in inputs if i in owner)
    members: list[list[str]] = [[] for _ in seeds]
    for node, site in owner.items():
        members[site].append(node.name)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    for (gather, part, wait), names in zip(seeds, members):
        val = wait.meta.get("val")
        nbytes = val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0
        found.sites.append(RegatherSite(
            gather=gather.name, parameter=part.name, input_index=index[part],
            nodes=tuple(sorted(names, key=order.__getitem__)), nbytes=int(nbytes)))
    return found


def mark_regather(graph: fx.Graph, found: RegatherFound) -> None:
    """Mark every node of ``found``'s sites ``MUST_RECOMPUTE`` (one checkpoint region)."""
    from torch.utils.checkpoint import CheckpointPolicy

    names = {name for site in found.sites for name in site.nodes}
    for node in graph.nodes:
        if node.name in names:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = AC_GRAPH_ID


def partition_with_regather(partition_fn, *, params: set[int], record: list,
                            static: set[int] = frozenset()):
    """``partition_fn`` (the min-cut partitioner) with the parameters' gathers marked first;
    each call appends its ``RegatherFound`` to ``record``, with what the forward it made saves
    of the marked nodes all the same.

    The joint graph's common subexpressions are merged before the marks, as the partitioner
    merges them after: a parameter gathered twice (once inside a checkpoint region, once
    outside, as a parametrization that gathers on every access makes) is then one gather, the
    region's, left to the region's policy; marked first, the merge would join a marked node to
    the region's and the partitioner would save the region's gathered weight."""
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse

    def partition(joint_module: fx.GraphModule, joint_inputs, **kwargs):
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        if functorch_config.cse:
            joint_module.graph = fx_graph_cse(joint_module.graph)
            joint_module.recompile()
        found = find_regather_sites(joint_module.graph, num_fwd_outputs=num_fwd_outputs,
                                    params=params, static=static)
        mark_regather(joint_module.graph, found)
        record.append(found)
        forward, backward = partition_fn(joint_module, joint_inputs, **kwargs)
        marked = {name for site in found.sites for name in site.nodes}
        output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
        for node in output.args[0][num_fwd_outputs:]:
            val = getattr(node, "meta", {}).get("val")
            if getattr(node, "name", None) in marked and isinstance(val, torch.Tensor):
                found.saved.append((node.name, int(val.untyped_storage().nbytes())))
        return forward, backward

    return partition
