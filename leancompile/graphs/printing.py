"""Readable graph code, op counts and their diff."""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

__all__ = ["graph_code", "op_counts", "op_count_diff"]


def graph_code(gm: fx.GraphModule) -> str:
    """The graph as Python, with tensor shapes and dtypes as annotations."""
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    except TypeError:  # older torch without the include_* flags
        return gm.print_readable(print_output=False)


def op_name(node: fx.Node) -> str:
    target = node.target
    if hasattr(target, "_schema"):
        return str(target)
    return getattr(target, "__name__", str(target))


def op_counts(gm: fx.GraphModule) -> Counter:
    """How many times each ``call_function`` target occurs (``"aten.mm.default": 4``)."""
    return Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function")


def op_count_diff(before: Counter, after: Counter) -> dict[str, tuple[int, int]]:
    """The ops whose count changed, as ``{op: (before, after)}``, sorted by name."""
    return {op: (before.get(op, 0), after.get(op, 0))
            for op in sorted(set(before) | set(after)) if before.get(op, 0) != after.get(op, 0)}
