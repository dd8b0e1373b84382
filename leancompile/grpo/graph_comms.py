"""The communication the step's compiled graphs issue, read from the graphs: the gradient
reductions of one backward (``backward_reductions``: what ``GradResult.sync_collectives`` and
``explain``'s ``gradient_sync`` count under ``parallel="fsdp"``) and the order of a graph's
collectives (``gather_order``: ranks running different graphs at one step must issue the same
ones)."""

from __future__ import annotations

import torch

from ..passes.bucket_collectives import NAME as BUCKETS, merged_counts
from ..runtime.namespaces import COMMUNICATION_NAMESPACES

__all__ = ["backward_reductions", "gather_order"]


def backward_reductions(graph) -> tuple[int, int]:
    """The gradient reduce-scatters one run of the step's backward issues, and their bytes:
    counted in the backward as AOTAutograd made it (FlashOverlap may have turned one into P2P
    steps, which still reduce once), less those the bucketing pass merged into one per
    bucket (its report on the backward graph)."""
    count = nbytes = 0
    for node in graph.backward_aten.graph.nodes:
        if node.op == "call_function" and "reduce_scatter_tensor" in str(node.target):
            val = node.args[0].meta.get("val")
            count += 1
            nbytes += val.numel() * val.element_size() if val is not None else 0
    merged, buckets = _bucketed(graph, "backward").get("reduce_scatter", (0, 0))
    return count - merged + buckets, nbytes


def _bucketed(graph, phase: str) -> dict[str, tuple[int, int]]:
    """What the bucketing pass merged in the step's ``phase`` graph:
    ``{kind: (collectives, buckets)}`` (``bucket_collectives.merged_counts``)."""
    report = graph.report
    results = [] if report is None else [p for r in report.graphs if r.phase == phase
                                         for p in r.passes if p.name == BUCKETS]
    return merged_counts(results[0]) if results else {}


def gather_order(gm, report=None, phase: str = "") -> list:
    """The communication a graph issues, in order: per collective (its wait aside) or
    point-to-point step, the op and the dtype and shape of its first tensor argument; then
    the buckets the bucketing pass made (``report``: the step's, for the ``phase`` graph)."""
    out = []
    for node in gm.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        if node.op != "call_function" or namespace not in COMMUNICATION_NAMESPACES \
                or "wait_tensor" in str(node.target):
            continue
        arg = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        val = arg.meta.get("val") if arg is not None else None
        out.append((str(node.target).split(".")[1], str(val.dtype),
                    tuple(str(d) for d in val.shape))  # (sizes may be symbolic)
                   if isinstance(val, torch.Tensor) else str(node.target))
    if report is not None:
        out += [note for r in report.graphs if r.phase == phase for p in r.passes
                if p.name == BUCKETS for note in p.notes if note.startswith("all_gather")]
    return out
