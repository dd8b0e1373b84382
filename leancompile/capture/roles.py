"""What each flat input of a Dynamo graph is (``InputRole``: where it comes from, its kind,
whether dim 0 is the batch), and the batch size's symbol.

``input_roles(gm, example_inputs)`` reads Dynamo's placeholders; a symbolic dim 0 of a tensor
argument is the batch (the first such symbol)::

    placeholder (its source)                          value      role
    L['x']                                            (s0, 8)    tensor, batch_rows=1
    L['self']._modules['fc']._parameters['weight']    (8, 8)     param
    L['self']._modules['norm']._buffers['mean']       (8,)       buffer
    the batch size (whichever input Dynamo read)      s0         symint, source "<batch>"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

__all__ = ["InputRole", "input_roles"]


@dataclass(frozen=True, kw_only=True)
class InputRole:
    """One flat input of a Dynamo graph (what Dynamo passes its compiled function)."""

    source: str
    """Dynamo's name for where the value comes from (``L['x']``,
    ``L['self']._modules['fc']._parameters['weight']``)."""
    kind: str
    """``param`` (an ``nn.Parameter``), ``buffer``, ``tensor`` (an argument or other tensor),
    ``symint`` (a size) or ``other``."""
    batch_rows: int = 0
    """Rows per sample when dim 0 is the batch (a batch-major input), else 0."""


def input_roles(gm: fx.GraphModule, example_inputs, *,
                batch: int | None = None) -> tuple[list[InputRole], object]:
    """(the role of each placeholder of ``gm``, the batch symbol or None): with a batch symbol,
    each tensor argument whose dim 0 is it has ``batch_rows=1`` and the size input that is it
    is named ``<batch>``. ``batch``: the batch size of the call being traced, where the caller
    knows it; a symbolic dim 0 of another size is not the batch (under ``dynamic=True`` every
    size is symbolic, and the first tensor Dynamo reads may be a ``[L, 3]`` position table)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roles = [_role(p, v) for p, v in zip(placeholders, example_inputs)]
    fakes = [_fake(p, v) for p, v in zip(placeholders, example_inputs)]
    symbol = _batch_symbol(fakes, roles, batch)
    if symbol is not None:
        roles = [InputRole(source=r.source, kind=r.kind, batch_rows=1)
                 if r.kind == "tensor" and isinstance(v, torch.Tensor) and v.dim()
                 and isinstance(v.shape[0], torch.SymInt) and v.shape[0].node.expr == symbol
                 # The batch size itself: one name whichever argument Dynamo read it from.
                 else InputRole(source="<batch>", kind=r.kind)
                 if isinstance(v, torch.SymInt) and v.node.expr == symbol
                 else r for r, v in zip(roles, fakes)]
    return roles, symbol


def _role(node: fx.Node, value) -> InputRole:
    arg = node.meta.get("grapharg")
    source = arg.source.name if arg is not None and getattr(arg, "source", None) is not None \
        else node.name
    if node.meta.get("leancompile_sample"):  # the update's sample argument (leancompile/lean)
        source = "<sample>"
    if isinstance(value, torch.nn.Parameter):
        kind = "param"
    elif isinstance(value, torch.Tensor):
        kind = "buffer" if "_buffers" in source else "tensor"
    elif isinstance(value, (int, torch.SymInt)):
        kind = "symint"
    else:
        kind = "other"
    return InputRole(source=source, kind=kind)


def _fake(node: fx.Node, value):
    """A placeholder's value as Dynamo traced it (symbolic sizes), else the example value."""
    fake = node.meta.get("example_value")
    return fake if fake is not None else value


def _batch_symbol(fakes, roles, batch: int | None = None):
    """The symbol that is dim 0 of the most tensor arguments (the first, on a tie), among those
    of size ``batch`` where it is given: ``[L, 3]`` ids and ``[B, L, D]`` latents of one size
    under ``dynamic=True`` have two symbols of the same size, and the latents, the timesteps
    and the targets share the batch's."""
    counts: dict = {}
    for value, role in zip(fakes, roles):
        if role.kind == "tensor" and isinstance(value, torch.Tensor) and value.dim():
            d0 = value.shape[0]
            if isinstance(d0, torch.SymInt) and d0.node.expr.is_Symbol and (
                    batch is None or d0.node.hint == batch):
                counts[d0.node.expr] = counts.get(d0.node.expr, 0) + 1
    return max(counts, key=counts.get) if counts else None
