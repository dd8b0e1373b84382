"""The aten op sets and node-argument readers that more than one pass matches with (the
FlashOverlap matchers of ``passes/flash/`` and the row-layout rules of ``row_rules.py``), one
definition each. A set only one pass asks about stays in that pass's module.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["RESHAPES", "SPLITS", "TRANSPOSES", "node_arg", "norm_dim", "rng_wrapped"]

aten = torch.ops.aten

RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
"""Ops that give their input a new shape, entries in the same order."""
TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)
"""Ops that reorder their input's dims."""
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
"""Ops that cut their input into pieces along ``dim`` (argument 2), returned as a tuple."""


def node_arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index`` of ``node``, or its keyword ``name``, or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def norm_dim(dim, ndim: int):
    """``dim`` as a non-negative index into ``ndim`` dims (anything but a negative int is
    returned as it is)."""
    return dim + ndim if isinstance(dim, int) and dim < 0 else dim


def rng_wrapped(node: fx.Node):
    """``(op, its arguments)`` for a node of activation checkpointing's generator-state
    wrappers (``run_and_save_rng_state(op, *args)`` in a forward graph,
    ``run_with_rng_state(state, op, *args)`` in a backward graph); ``(None, ())`` for such a
    wrapper around something that is not an aten op; None for any other node."""
    target = node.target
    if not isinstance(target, torch._ops.HigherOrderOperator) or "rng_state" not in target.name():
        return None
    op = next((a for a in node.args if isinstance(a, torch._ops.OpOverload)), None)
    return (None, ()) if op is None else (op, tuple(node.args[node.args.index(op) + 1:]))
