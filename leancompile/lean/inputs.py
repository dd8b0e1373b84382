"""What a wrapped call passes, as the step sees it before Dynamo does: the tensors among its
arguments (``tensors_of``), and the arguments laid out densely (``densely``), so that a strided
view and a dense tensor of the same values trace one graph.

Before and after ``densely``, for FlowGRPO's ``train_flux.py`` (the update passes a column
of the stacked trajectory and a stride-0 guidance)::

    transformer(hidden_states=latents[:, j],   # [B, N, C], strides ((T+1)*N*C, C, 1)
                guidance=g.expand(B), ...)      # [B], stride (0,)
    ->
    transformer(hidden_states=<copy>,          # [B, N, C], strides (N*C, C, 1)
                guidance=<copy>, ...)           # [B], stride (1,)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tensors_of", "is_dense", "densely"]


def tensors_of(args, kwargs) -> list[Tensor]:
    """The tensors among a call's arguments, also inside lists, tuples and dicts (what
    ``tree_flatten`` finds there, without its registry lookups: this runs on every call)."""
    found = []
    stack = list(kwargs.values())[::-1] + list(args)[::-1]
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return found


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` is laid out as a freshly made tensor is: contiguous, or channels-last (a
    4-D or 5-D tensor in that format on purpose)."""
    if t.layout is not torch.strided or t.is_contiguous():  # (a sparse one cannot be copied so)
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def densely(args, kwargs):
    """``(args, kwargs)`` with every plain tensor that is not laid out densely (``is_dense``)
    replaced by a contiguous copy, also inside lists, tuples and dicts.

    Why: a strided input traces another aten graph than a dense one of the same values (a
    ``Linear`` on a 3-D input that a view cannot flatten decomposes to ``expand`` + ``bmm``
    instead of ``view`` + ``addmm``), and an update call is served only by a kept call of
    the same graph. FlowGRPO's ``train_flux.py`` samples with contiguous latents and trains
    on ``sample["latents"][:, j]`` (a column of the stacked trajectory; its SD3 loop hides
    this behind the classifier-free guidance ``cat``): no kept call computed the same
    function, and Retain served none of the first window's calls (0 of 6 on a tiny FLUX, 6 of
    6 with the copy), recomputing each. The copy costs one pass over such an input per call;
    a wrapped function that writes into its arguments is refused anyway
    (``capture/conventions.py``), and the copy is differentiable, so a caller's gradient
    reaches the tensor it passed. An output that is an input (or a view of one) is then the
    copy (or a view of it), with the same values."""
    from torch.utils._pytree import tree_map

    def dense(value):
        if isinstance(value, Tensor) and type(value) in (Tensor, torch.nn.Parameter) and \
                not is_dense(value):
            return value.contiguous()
        return value

    return tree_map(dense, (args, kwargs))
