"""Coalesced gradient sync: take the gradient reductions out of a backward graph.

Under ``parallel="fsdp"`` the step's backward graph ends every sharded parameter's gradient
with a reduce-scatter: the sum over the ranks of the full gradient, each rank keeping its part.
Reweight cannot run those per row: it takes one gradient per trained row, weights each by its
sample's advantage once the group is scored, and only then may the ranks' gradients be summed
(summing first would add rows of different samples with one weight). This pass gives Reweight
the backward it needs: each reduction is removed and the gradient output becomes the full,
rank-local gradient that went into it. The caller reduces the weighted sum later, once per
round of prompt groups or once per update (``GRPOConfig.grad_sync``), with one collective for
all parameters (``DataParallel.reduce_scatter_grads``).

Before (one sharded parameter; ``R`` ranks, its part ``[c, k]``)::

    grad_w = mm(permute(dy), x)                       # [R*c, k] (padded full gradient)
    rs = _c10d_functional.reduce_scatter_tensor(grad_w, "sum", R, group)
    part = _c10d_functional.wait_tensor(rs)           # [c, k]
    return (..., part, ...)

After (the output at the same position, now full-size and not reduced)::

    grad_w = mm(permute(dy), x)                       # [R*c, k]
    return (..., grad_w, ...)

Found separately from rewritten (``find_gradient_reductions``); a reduction is taken out only
when it sums and every wait on it is a graph output and nothing else (one reduction can have
several waits: the graph's common-subexpression elimination merges reductions of equal
gradients).
Any other collective (a reduction that feeds more compute, a gather recomputed in the backward)
is reported with its reason: the graph then still holds collectives and the caller must not
vectorise it (``remaining`` in the result).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import fx

from ..runtime.namespaces import COLLECTIVE_NAMESPACES

__all__ = ["GradientReduction", "ReductionsFound", "find_gradient_reductions",
           "take_out_reductions"]


def _is_collective(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    namespace = getattr(node.target, "namespace", None)
    return namespace in COLLECTIVE_NAMESPACES and "wait_tensor" not in str(node.target)


@dataclass(frozen=True)
class GradientReduction:
    """One reduce-scatter whose result is a gradient output of the backward graph."""

    node: str
    waits: tuple[str, ...]
    input: str
    outputs: tuple[int, ...]
    """Positions in the graph's output tuple."""
    group_size: int
    group_name: str


@dataclass
class ReductionsFound:
    sites: list[GradientReduction] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(node, reason) for every other collective in the graph."""
    compute: list[str] = field(default_factory=list)
    """The skipped collectives that sum nothing (all-to-alls, all-gathers: the backward's own
    data movement, as sequence parallelism's), which may stay in the graph as they are; the
    other skipped ones (all-reduces, reduce-scatters that cannot be taken out) would reduce
    each row's gradient on its own."""


def find_gradient_reductions(gm: fx.GraphModule) -> ReductionsFound:
    """The gradient reduce-scatters of ``gm`` that can be taken out, and every other
    collective with the reason it stays."""
    found = ReductionsFound()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for node in gm.graph.nodes:
        if not _is_collective(node):
            continue
        name = str(node.target)
        if "reduce_scatter_tensor" not in name:
            found.skipped.append((node.name, f"{name} is not a gradient reduction (a "
                                             "collective the backward needs for its compute)"))
            if "all_to_all" in name or "all_gather" in name:  # moves data, sums nothing
                found.compute.append(node.name)
            continue
        if len(node.args) < 4 or node.args[1] != "sum":
            found.skipped.append((node.name, f"reduces with {node.args[1]!r}, not 'sum'"))
            continue
        # Several waits on one reduction: the graph's CSE merged reductions of equal
        # gradients (e.g. biases whose gradients are the same sum).
        waits = list(node.users)
        if not waits or any("wait_tensor" not in str(w.target) for w in waits):
            found.skipped.append((node.name, "its result is used before a wait_tensor"))
            continue
        if any(set(w.users) != {output} for w in waits):
            found.skipped.append((node.name, "the reduced gradient feeds more compute, not "
                                             "only the graph's outputs"))
            continue
        positions = tuple(i for i, o in enumerate(outs) if o in waits)
        found.sites.append(GradientReduction(
            node=node.name, waits=tuple(w.name for w in waits), input=node.args[0].name,
            outputs=positions, group_size=int(node.args[2]), group_name=str(node.args[3])))
    return found


def take_out_reductions(gm: fx.GraphModule, found: ReductionsFound) -> fx.GraphModule:
    """A copy of ``gm`` with the reductions ``found.sites`` removed: each of their outputs is
    the full gradient that went into the reduction (module docstring)."""
    gm = copy.deepcopy(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for site in found.sites:
        rs, grad = nodes[site.node], nodes[site.input]
        for name in site.waits:
            nodes[name].replace_all_uses_with(grad)
            gm.graph.erase_node(nodes[name])
        gm.graph.erase_node(rs)
    gm.graph.lint()
    gm.recompile()
    return gm
