"""Facts the simulator and its users (``calibrate.py``, ``plan.py``) read off post-grad graphs:
an op's name, the tensors and bytes of a node's value, the group size of a collective, the
graphs of a report; and which ops cost nothing (``FREE``) or count as matmuls (``MATMULS``)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

__all__ = ["FREE", "MATMULS", "concrete", "graphs_of", "group_name", "group_size", "op_name",
           "tensor_bytes", "tensors_of"]

FREE = {
    "view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "slice", "select",
    "squeeze", "unsqueeze", "as_strided", "alias", "detach", "split", "split_with_sizes",
    "unbind", "view_as", "unflatten", "flatten", "narrow", "diagonal", "lift_fresh_copy",
    "empty", "empty_strided", "empty_like", "sym_size", "sym_numel", "sym_stride",
}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
           "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_efficient_attention_backward", "convolution_backward",
           "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}


def op_name(node: fx.Node) -> str:
    """The op's name without namespace or overload (``"mm"``, ``"getitem"``, ``"p2p_start"``)."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        name = packet.__name__
    return name.split(".")[0]


def concrete(x) -> int:
    """An int of a size (a SymInt at its hint, 1 without one)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else 1
    return int(x)


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors of a node's value (one, or those of a tuple or list, nested)."""
    out = []
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out += tensors_of(v)
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (symbolic sizes at their hints)."""
    n = 1
    for d in t.shape:
        n *= concrete(d)
    return n * t.element_size()


def _size_index(name: str) -> int | None:
    """Where an all-gather's or reduce-scatter's ``group_size`` argument is (its
    ``group_name`` follows), coalesced ones too."""
    if name.startswith("all_gather_into_tensor"):
        return 1
    return 2 if name.startswith("reduce_scatter_tensor") else None


def group_size(node: fx.Node) -> int:
    """The number of ranks of a collective as its node says it (0 when it does not)."""
    name = op_name(node)
    index = _size_index(name)
    if index is not None:
        return int(node.args[index])
    if name == "all_to_all_single" and len(node.args) >= 4:
        return max(len(node.args[1] or node.args[2] or [1]), 1)
    return 0


def group_name(node: fx.Node) -> str | None:
    """The process group a collective's node names (None when it names none)."""
    name = op_name(node)
    index = 1 if name.startswith("all_reduce") else _size_index(name)  # (all_reduce: no size)
    return str(node.args[index + 1]) if index is not None and len(node.args) > index + 1 \
        else None


def graphs_of(graphs_or_report) -> list[fx.Graph]:
    """The fx graphs of a graph, a graph module, a ``Report`` (its post-pass graphs) or a list
    of them."""
    from ..report import Report

    if isinstance(graphs_or_report, fx.GraphModule):
        return [graphs_or_report.graph]
    if isinstance(graphs_or_report, fx.Graph):
        return [graphs_or_report]
    if isinstance(graphs_or_report, Report):
        out = []
        for record in graphs_or_report.graphs:
            graph = record.after_snapshot.graph
            if graph is None:
                raise ValueError(
                    "this report no longer holds its graphs (only their code); simulate the "
                    "graph modules instead (the compiler's post-pass graphs)")
            out.append(graph)
        return out
    if isinstance(graphs_or_report, Sequence):
        return [g for item in graphs_or_report for g in graphs_of(item)]
    raise TypeError(f"simulate takes fx graphs, graph modules, a list of them or a Report, "
                    f"not {type(graphs_or_report).__name__}")
