"""Random ops in a captured graph: two runs of a step that draws random numbers would not be the
same forward, so LeanGRPO refuses to reuse one (``RandomOpInGraphError``).

``random_ops(gm)`` names each op that draws, with the module it sits in::

    native_dropout = aten.native_dropout(mm, 0.1, True)
        -> ["native_dropout (aten.native_dropout.default) in drop (Dropout)"]
    native_dropout = aten.native_dropout(mm, 0.0, True)
        -> []  (p = 0 draws nothing; so does train=False)
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["RandomOpInGraphError", "random_ops", "checkpointing_advice"]


class RandomOpInGraphError(RuntimeError):
    """The captured step draws random numbers: two runs of it would not be the same forward."""


def _draws_random(node: fx.Node) -> bool:
    """A seeded op draws random numbers unless its dropout probability is 0 (attention ops
    carry the tag for their ``dropout_p``) or it runs with ``train=False``. A random op that
    activation checkpointing recomputes in the backward is wrapped by the partitioner
    (``run_and_save_rng_state(aten.rand, ...)``): it draws as the op it wraps."""
    if isinstance(node.target, torch._ops.HigherOrderOperator) and \
            "rng_state" in node.target.name():
        op = _wrapped_op(node)
        return op is None or torch.Tag.nondeterministic_seeded in op.tags
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    values = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    if values.get("train") is False:
        return False
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)):
            return values[name] != 0
    return True


def _wrapped_op(node: fx.Node):
    """The op a higher-order wrapper node calls (``run_and_save_rng_state(aten.rand, ...)``)."""
    return next((a for a in node.args if isinstance(a, torch._ops.OpOverload)), None)


def _describe(node: fx.Node) -> str:
    target, meta = node.target, node.meta
    if isinstance(target, torch._ops.HigherOrderOperator):  # a random op checkpointing redraws
        target = _wrapped_op(node) or target
        # The partitioner moved the op's metadata to the getitem that returns its value.
        meta = next((u.meta for u in node.users if u.args[1:] == (1,)), meta)
    text = f"{node.name} ({target})"
    stack = meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].strip("'>"))
        text += f" in {path} ({cls_name})"
    return text


def random_ops(gm: fx.GraphModule) -> list[str]:
    """Each op of ``gm`` that draws random numbers, named with the module it sits in."""
    return [_describe(n) for n in gm.graph.nodes if n.op == "call_function" and _draws_random(n)]


def checkpointing_advice(ops: list[str]) -> str:
    """The fix to name when some of ``ops`` (``random_ops``' descriptions) are ops activation
    checkpointing recomputes: torch's checkpointing wraps every op tagged as drawing random
    numbers in ``run_and_save_rng_state``, and its attention ops carry that tag whatever
    their ``dropout_p`` (0 in a diffusion transformer), so a checkpointed attention is
    refused here although it draws nothing (FlowGRPO's ``train_wan2_1.py`` turns
    checkpointing on). Refused rather than read through: which rows a checkpointed region's
    outputs hold is not yet proved (``passes/row_walk.py`` does not follow the wrapper)."""
    if not any("run_and_save_rng_state" in op for op in ops):
        return ""
    return (" These are ops that activation checkpointing recomputes (an attention op is "
            "refused so even at dropout_p=0): turn gradient checkpointing off for this step "
            "(diffusers: transformer.disable_gradient_checkpointing()), or use "
            "schedule='recompute'.")
