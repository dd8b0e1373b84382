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

from ..passes.aten_ops import rng_wrapped

__all__ = ["RANDOM_FIXES", "RandomOpInGraphError", "random_ops", "without_rng_wrappers"]


class RandomOpInGraphError(RuntimeError):
    """The captured step draws random numbers: two runs of it would not be the same forward."""


def _draws_random(node: fx.Node) -> bool:
    """A seeded op draws random numbers unless its dropout probability is 0 (attention ops
    carry the tag for their ``dropout_p``) or it runs with ``train=False``. A seeded op that
    activation checkpointing recomputes in the backward is wrapped by the partitioner
    (``run_and_save_rng_state(aten.rand, ...)``, and an attention op at ``dropout_p=0`` too):
    it draws as the op it wraps, with the arguments after it."""
    wrapped = rng_wrapped(node)
    if wrapped is None:
        return _draws(node.target, node.args, node.kwargs)
    op, args = wrapped
    return op is None or _draws(op, args, node.kwargs)


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


def _describe(node: fx.Node) -> str:
    target, meta = node.target, node.meta
    wrapped = rng_wrapped(node)
    if wrapped is not None:  # a random op checkpointing redraws
        target = wrapped[0] or target
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
        wrapped = rng_wrapped(node) if node.op == "call_function" else None
        if wrapped is None or node.target.name() != "run_with_rng_state" or wrapped[0] is None:
            continue
        op, args = wrapped
        if _draws(op, args, node.kwargs):
            continue
        node.target, node.args = op, args
        count += 1
    if count:
        gm.recompile()
    return count


RANDOM_FIXES = ("Call model.eval() (dropout modules), pass dropout_p=0 to attention calls "
                "that take it (F.scaled_dot_product_attention draws whatever the module's "
                "mode), pass the noise in as an argument (a step that samples), or use "
                "schedule='recompute'.")
"""The fixes a refusal for random numbers names. Turning activation checkpointing off is not one
of them: a checkpointed op that draws draws without checkpointing too, and one that draws
nothing (an attention at ``dropout_p=0``, wrapped in ``run_and_save_rng_state`` for its tag) is
not refused."""
