"""The fake value an fx node was traced with, read the one way every pass and runtime piece
reads it."""

from __future__ import annotations

from torch import fx

__all__ = ["node_val"]


def node_val(node):
    """``meta["val"]`` of an fx node (its fake value); None for anything else (a constant
    argument, ``None``)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None
