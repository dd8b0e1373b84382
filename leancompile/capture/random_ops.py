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

__all__ = ["RandomOpInGraphError", "random_ops", "checkpointing_advice",
           "without_rng_wrappers"]


class RandomOpInGraphError(RuntimeError):
    """The captured step draws random numbers: two runs of it would not be the same forward."""


def _draws_random(node: fx.Node) -> bool:
    """A seeded op draws random numbers unless its dropout probability is 0 (attention ops
    carry the tag for their ``dropout_p``) or it runs with ``train=False``. A seeded op that
    activation checkpointing recomputes in the backward is wrapped by the partitioner
    (``run_and_save_rng_state(aten.rand, ...)``, and an attention op at ``dropout_p=0`` too):
    it draws as the op it wraps, with the arguments after it."""
    if isinstance(node.target, torch._ops.HigherOrderOperator) and \
            "rng_state" in node.target.name():
        op = _wrapped_op(node)
        if op is None:
            return True
        return _draws(op, node.args[node.args.index(op) + 1:], node.kwargs)
    return _draws(node.target, node.args, node.kwargs)


def _draws(target, args, kwargs) -> bool:
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    values = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            values[arg.name] = args[i]
        elif arg.name in kwargs:
            values[arg.name] = kwargs[arg.name]
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


def without_rng_wrappers(gm: fx.GraphModule) -> int:
    """Call, in place, each op that checkpointing's wrappers recompute with a saved generator
    state but that draws nothing (an attention at ``dropout_p=0``) as the bare op: the same
    values, and ``torch.func.vmap`` (Reweight's per-row backward) has rules for the op and none
    for the wrapper. Returns how many were unwrapped; a wrapped op that draws stays.

    Before (a backward graph of a checkpointed attention)::

        rerun = run_with_rng_state(getitem_2, aten._scaled_dot_product_flash_attention,
                                   permute_1, permute_3, permute_5)

    After::

        rerun = aten._scaled_dot_product_flash_attention(permute_1, permute_3, permute_5)
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or \
                not isinstance(node.target, torch._ops.HigherOrderOperator) or \
                "rng_state" not in node.target.name():
            continue
        op = _wrapped_op(node)
        if node.target.name() != "run_with_rng_state" or op is None:
            continue
        args = node.args[node.args.index(op) + 1:]
        if _draws(op, args, node.kwargs):
            continue
        node.target, node.args = op, tuple(args)
        count += 1
    if count:
        gm.recompile()
    return count


def checkpointing_advice(ops: list[str]) -> str:
    """The fix to name when some of ``ops`` (``random_ops``' descriptions) are ops activation
    checkpointing recomputes (wrapped in ``run_and_save_rng_state``): a checkpointed op that
    draws (dropout at ``p > 0``) cannot be run again the same, and turning checkpointing off
    for the step is a fix besides ``model.eval()`` or ``schedule='recompute'``. (A checkpointed
    attention at ``dropout_p=0``, a diffusion transformer's under FlowGRPO's
    ``train_wan2_1.py`` or DanceGRPO's ``--gradient_checkpointing``, draws nothing and is not
    refused.)"""
    if not any("run_and_save_rng_state" in op for op in ops):
        return ""
    return (" These are ops that activation checkpointing recomputes: turn gradient "
            "checkpointing off for this step (diffusers: "
            "transformer.disable_gradient_checkpointing()), or use schedule='recompute'.")
