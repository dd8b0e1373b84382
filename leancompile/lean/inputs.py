"""What a wrapped call passes, as the step sees it before Dynamo does: the tensors among its
arguments (``tensors_of``), and the arguments laid out densely (``densely``), so that a strided
view and a dense tensor of the same values trace one graph.

Before and after ``densely``, for FlowGRPO's ``train_flux.py`` (the update passes a column
of the stacked trajectory)::

    transformer(hidden_states=latents[:, j],   # [B, N, C], strides ((T+1)*N*C, C, 1)
                guidance=g.expand(B), ...)      # [B], stride (0,)
    ->
    transformer(hidden_states=<copy>,          # [B, N, C], strides (N*C, C, 1)
                guidance=g.expand(B), ...)      # as it was: an expand is left alone
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tensors_of", "call_batch_size", "is_dense", "to_copy", "densely", "given_back"]


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


def call_batch_size(tensors) -> int:
    """A call's batch size: its first tensor argument's dim 0 (1 without any). (The dim 0 most
    arguments share would serve a step taking a ``[L, 3]`` position table first, but take
    ``L`` for a step taking ``(x, cos, sin)`` with two ``[L, D]`` rotary tables; such a step
    is served whole-call only, exact.)"""
    return next((t.shape[0] for t in tensors if t.dim() >= 1), 1)


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` is laid out as a freshly made tensor is: contiguous, or channels-last (a
    4-D or 5-D tensor in that format on purpose)."""
    if t.layout is not torch.strided or t.is_contiguous():  # (a sparse one cannot be copied so)
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def _expanded(t: Tensor) -> bool:
    """Whether ``t`` repeats its memory along a dim (stride 0 where the size is over 1: an
    ``expand``, a broadcast mask)."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def to_copy(t: Tensor) -> bool:
    """Whether ``densely`` replaces ``t``: a plain tensor, strided (not an expand), or
    contiguous with a stride a fresh tensor would not have at a dim of size 1."""
    return type(t) is Tensor and ((not is_dense(t) and not _expanded(t)) or _odd_unit_strides(t))


def _odd_unit_strides(t: Tensor) -> bool:
    """Whether ``t`` is contiguous but a dim of size 1 has another stride than a fresh tensor's
    (``latents[:, j]`` of a ``[1, T, N, C]`` trajectory: stride ``T*N*C`` at dim 0). Torch
    calls it contiguous, and a static graph does not care; under ``dynamic=True`` Dynamo
    gives that stride a size symbol of its own, so the update's graph takes one input more
    than the rollout's and no call is matched."""
    if t.layout is not torch.strided or not t.is_contiguous():
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size == 1 and stride != expected:
            return True
        expected *= max(size, 1)
    return False


def densely(args, kwargs):
    """``(args, kwargs, copies)``: the arguments with every strided plain tensor (not laid out
    densely, ``is_dense``; not an ``expand``) replaced by a contiguous copy, at the top level
    and inside tuples; ``copies`` maps each copy's ``id`` to the tensor it copies.

    Why: a strided input traces another aten graph than a dense one of the same values (a
    ``Linear`` on a 3-D input that a view cannot flatten decomposes to ``expand`` + ``bmm``
    instead of ``view`` + ``addmm``), and an update call is served only by a kept call of
    the same graph. FlowGRPO's ``train_flux.py`` samples with contiguous latents and trains
    on ``sample["latents"][:, j]`` (a column of the stacked trajectory; its SD3 loop hides
    this behind the classifier-free guidance ``cat``): no kept call computed the same
    function, and Retain served none of the first window's calls (0 of 6 on a tiny FLUX, 6 of
    6 with the copy), recomputing each.

    What is left as it is, and why:

    - lists and dicts, with what they hold: the wrapped function may write into them (a cache,
      a list it appends to), and a rebuilt one would take those writes away from the caller;
    - an ``nn.Parameter`` (a copy is a plain tensor: the step would no longer see a
      parameter) and tensor subclasses;
    - an expanded tensor (a stride 0 along a dim: a broadcast mask, FlowGRPO's
      ``guidance.expand(B)``): its copy could be many times its memory, and a kept call would
      hold it;
    - a dense or channels-last tensor; but a contiguous one with another stride at a dim of
      size 1 than a fresh tensor has (``_odd_unit_strides``) is passed as a view of the same
      memory with a fresh tensor's strides (no copy).

    One copy per tensor: a tensor passed twice is one copy passed twice (one graph input, as
    the rollout's). The copy is differentiable, so a caller's gradient reaches the tensor it
    passed; a wrapped function that writes into a tensor argument is refused anyway
    (``capture/conventions.py``); an output that is an input is given back as the caller's
    tensor (``LeanStep.__call__``), a view of one is a view of the copy."""
    copies: dict[int, Tensor] = {}
    made: dict[int, Tensor] = {}

    def dense(value):
        if isinstance(value, Tensor):
            if not to_copy(value):
                return value
            copy = made.get(id(value))
            if copy is None:
                # (a contiguous one: the same memory, viewed with a fresh tensor's strides)
                copy = made[id(value)] = value.contiguous() if not value.is_contiguous() \
                    else value.reshape(-1).view(value.shape)
                copies[id(copy)] = value
            return copy
        if isinstance(value, tuple):
            return _rebuilt(value, [dense(v) for v in value])
        return value

    return tuple(dense(a) for a in args), {k: dense(v) for k, v in kwargs.items()}, copies


def given_back(out, copies: dict[int, Tensor]):
    """``out`` (a wrapped call's result) with each output that is one of ``densely``'s copies
    replaced by the caller's tensor, at the top level and inside tuples and lists."""
    if isinstance(out, Tensor):
        return copies.get(id(out), out)
    if isinstance(out, tuple):
        return _rebuilt(out, [given_back(v, copies) for v in out])
    if isinstance(out, list):
        return [given_back(v, copies) for v in out]
    return out


def _rebuilt(value: tuple, items: list) -> tuple:
    """``value`` (a tuple or namedtuple) holding ``items``: ``value`` itself when nothing
    changed."""
    if all(a is b for a, b in zip(items, value)):
        return value
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
