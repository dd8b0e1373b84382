"""The calling conventions of the traced graphs, read from AOTAutograd's metadata and the
partitioned graphs: which outputs alias an input (``output_aliases``), which saved values the
backward takes and in what order (``saved_order``), and the storages the saved tensors keep
alive beyond the inputs (``kept_storage``).

The forward returns its outputs, then what it saves; the backward takes the saved values it
reads (named alike, in its own order), then the cotangents::

    forward(primals_1, primals_2) -> (tanh, primals_2, tanh)      outputs: 1, saved: 2
    backward(primals_2, tanh, tangents_1)                         bw_saved: [0, 1]
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..passes.row_layout import size_in_batch

__all__ = ["output_aliases", "saved_order", "backward_saved_order", "kept_storage"]

_VIEW_TARGETS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.permute.default, torch.ops.aten.t.default,
    torch.ops.aten.transpose.int, torch.ops.aten.expand.default, torch.ops.aten.alias.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.as_strided.default, torch.ops.aten.detach.default,
}


def output_aliases(fw_meta, names=None) -> tuple[list[str], list[int | None]]:
    """(per output of the forward's ``ViewAndMutationMeta``: ``fresh``, ``input`` or ``view``;
    the input it is or views, else None; ``names``: the inputs' names for the messages). A
    function that mutates an input, returns a view of an intermediate, or returns a view of an
    input that requires grad, is refused (``ValueError``, with the fix)."""
    if fw_meta.num_mutated_inp_runtime_indices or fw_meta.num_intermediate_bases:
        raise ValueError(
            "the wrapped function mutates an input in place or returns a view of an "
            "intermediate; return fresh tensors (e.g. .clone()) and do not write into its "
            "arguments")
    num_outputs = len(fw_meta.output_info)
    output_types: list[str] = ["fresh"] * num_outputs
    output_bases: list[int | None] = [None] * num_outputs
    for i, info in enumerate(fw_meta.output_info):
        kind = info.output_type.name
        if kind in ("non_alias", "unsafe_view_alias", "custom_function_view"):
            continue
        if kind == "is_input":
            output_types[i], output_bases[i] = "input", info.base_idx
        elif kind == "alias_of_input":
            if info.requires_grad:
                # Its gradient would have to reach the input through the view, outside the
                # backward graph (AOTAutograd regenerates such a view on the input): the
                # step's own backward has no tangent for it, and ran into an internal error
                # (sizes against another output's strides, or too many tangents).
                base = info.base_idx if names is None else names[info.base_idx]
                raise ValueError(
                    f"output {i} of the wrapped function is a view of its input {base}, "
                    "which requires grad; return a fresh tensor (e.g. .clone()), or return the "
                    "input itself and take the view outside the step")
            output_types[i], output_bases[i] = "view", info.base_idx
        else:
            raise ValueError(f"output {i} of the wrapped function aliases an intermediate "
                             f"({kind}); return a fresh tensor (e.g. .clone())")
    return output_types, output_bases


def saved_order(forward: fx.GraphModule, backward: fx.GraphModule,
                num_outputs: int) -> tuple[list[str], list[int]]:
    """(the names of what ``forward`` saves, after its ``num_outputs`` outputs; for each saved
    value ``backward`` takes, in its order, the index into those)."""
    fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    saved_names = [n.name for n in fw_out[num_outputs:]]
    bw_placeholders = [n.name for n in backward.graph.nodes if n.op == "placeholder"
                       and not n.name.startswith("tangents")]
    return saved_names, backward_saved_order(fw_out[num_outputs:], bw_placeholders)


def backward_saved_order(saved: list, bw_names: list[str]) -> list[int]:
    """For each saved input of the backward (its placeholders but the cotangents), the index
    of that value among the forward's saved outputs. The partitioner names them alike, except
    the generator states of random ops that activation checkpointing recomputes: the forward
    returns ``getitem(run_and_save_rng_state(...), 0)`` and the backward takes
    ``rng_state_output_<k>``, in the same order."""
    position = {node.name: i for i, node in enumerate(saved)}
    states = iter([i for i, node in enumerate(saved)
                   if node.op == "call_function" and node.args
                   and isinstance(node.args[0], fx.Node)
                   and isinstance(node.args[0].target, torch._ops.HigherOrderOperator)
                   and node.args[0].target.name() == "run_and_save_rng_state"
                   and node.args[1] == 0])
    order = []
    for name in bw_names:
        if name in position:
            order.append(position[name])
        elif name.startswith("rng_state_output_"):
            order.append(next(states))
        else:
            raise RuntimeError(
                f"the backward graph takes {name!r}, which is not among what the forward "
                f"saves ({[n.name for n in saved]}); please report this graph")
    return order


def kept_storage(forward: fx.GraphModule, num_outputs: int, symbol) -> tuple[list, dict]:
    """(per saved value of ``forward``, its fake value; the storages the saved tensors live in
    that are not inputs or views of inputs: name -> bytes, an int or a sympy expression of the
    batch ``symbol``). Each storage counts once: a view of it costs nothing of its own."""
    fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    saved_meta = [n.meta.get("val") for n in fw_out[num_outputs:]]
    kept_roots = {}
    for node in fw_out[num_outputs:]:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        root = _alias_root(node)
        if root.op != "placeholder":
            kept_roots[root.name] = size_in_batch(
                root.meta["val"].untyped_storage().nbytes(), symbol)
    return saved_meta, kept_roots


def _alias_root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEW_TARGETS:
        node = node.args[0]
    return node
