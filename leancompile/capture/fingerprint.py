"""What a captured graph computes, to match a rollout call with an update call: structural
hashes of its outputs (``structural_hashes``), and the outputs whose gradient flows through the
drawn sample (``sample_gradient_outputs``).

``structural_hashes`` names each placeholder by its role's source, so that two traces of the
same code hash alike whatever their node names; an alias computes nothing::

    def forward(primals_1, primals_2):     # roles: L['self']..._parameters['weight'], L['x']
        mm = aten.mm(primals_2, primals_1)   # h = sha256("call_function:aten.mm.default:
        alias = aten.alias(mm)               #   [in(L['x']),in(L['self']...)]:{}")[:32]
        return (alias,)                      -> hashes (h,), inputs reached [0, 1]

With ``cut=i``, output ``i`` hashes as ``<sample>`` and what it computes is not followed.
"""

from __future__ import annotations

import hashlib

import sympy
import torch
import torch.fx as fx

from .roles import InputRole

__all__ = ["structural_hashes", "sample_gradient_outputs"]

_SAME_VALUE = {torch.ops.aten.alias.default, torch.ops.aten.detach.default}


def structural_hashes(gm: fx.GraphModule, roles: list[InputRole], cut: int | None = None):
    """(hash of each output, indices of the inputs the outputs depend on): a Merkle hash of the
    computation behind every output, placeholders named by their role's source, so that two
    traces of the same code hash alike whatever their node names. With ``cut``, that output's
    node counts as an input named ``<sample>`` (what it computes is not compared) and is not
    followed to the inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {p: i for i, p in enumerate(placeholders)}
    outs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    cut_node = outs[cut] if cut is not None and isinstance(outs[cut], fx.Node) else None
    memo: dict[fx.Node, str] = {}
    names = _size_names(placeholders, roles)

    def value(a) -> str:
        if isinstance(a, fx.Node):
            return memo[a]
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(value(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{value(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, torch.SymInt):
            return f"sym({a.node.expr.xreplace(names)})"
        return repr(a)

    for node in gm.graph.nodes:  # topological: every input is hashed before its users
        if node.op == "output":
            continue
        if node is cut_node:
            memo[node] = "<sample>"
        elif node.op == "call_function" and node.target in _SAME_VALUE:
            memo[node] = memo[node.args[0]]  # an alias computes nothing
        elif node.op == "placeholder":
            source = roles[index[node]].source
            memo[node] = source if source == "<sample>" else f"in({source})"
        elif node.target is torch.sym_sum:  # (its terms in the order of their symbols' names)
            text = f"{node.op}:sym_sum:{sorted(value(a) for a in node.args[0])}"
            memo[node] = hashlib.sha256(text.encode()).hexdigest()[:32]
        else:
            text = f"{node.op}:{node.target}:{value(node.args)}:{value(node.kwargs)}"
            memo[node] = hashlib.sha256(text.encode()).hexdigest()[:32]
    hashes = tuple(value(o) for o in outs)
    reached, seen = set(), set()
    stack = [o for o in outs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or node is cut_node:
            continue
        seen.add(node)
        if node.op == "placeholder":
            reached.add(index[node])
        stack.extend(node.all_input_nodes)
    return hashes, sorted(reached)


def _size_names(placeholders: list[fx.Node], roles: list[InputRole]) -> dict:
    """Each size symbol of the graph's inputs -> a symbol named for where it is first bound (a
    size input's role source, else ``<source>.size(d)`` of the first tensor input holding it):
    two traces of the same code number their symbols in the order Dynamo met them (``s50``
    in the rollout's graph, ``s9`` in the update's under ``dynamic=True``), which would make
    the same computation hash apart."""
    names: dict = {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        source = roles[i].source
        if isinstance(val, torch.SymInt):
            expr = val.node.expr
            if isinstance(expr, sympy.Symbol) and expr not in names:
                names[expr] = sympy.Symbol(f"in({source})")
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                expr = size.node.expr if isinstance(size, torch.SymInt) else None
                if isinstance(expr, sympy.Symbol) and expr not in names:
                    names[expr] = sympy.Symbol(f"in({source}).size({d})")
    return names


_IN_PLACE_OPERATORS = {"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod",
                       "ipow", "imatmul", "iand", "ior", "ixor", "ilshift", "irshift"}
_VIEWS = {"view", "reshape", "getitem", "__getitem__", "transpose", "permute", "unsqueeze",
          "squeeze", "select", "narrow", "expand", "flatten", "unflatten", "t", "view_as",
          "movedim", "swapaxes", "diagonal", "unbind", "split", "chunk", "as_strided"}


def _name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _writes_in_place(node: fx.Node) -> bool:
    """A Dynamo-graph op that writes into its first argument (``x.add_(y)``, ``x += y``)."""
    name = _name(node)
    return node.op in ("call_function", "call_method") and (
        name.strip("_") in _IN_PLACE_OPERATORS or name.endswith("_") and not name.endswith("__"))


def sample_gradient_outputs(gm: fx.GraphModule, sample_output: int | None) -> list[int]:
    """The outputs (other than ``sample_output``) that the drawn sample reaches through values
    that require grad, in the Dynamo graph ``gm`` (traced with gradients on): their gradient
    flows through the sample. An update that passes the sample back holds it constant, so such
    a rollout graph's backward is not the update's (FlowGRPO's and DanceGRPO's steps detach the
    sample where the log-prob reads it; a step that does not must be recomputed).

    Conservative: a value that requires grad and reads a reached value is reached (an op that
    does not differentiate through that input still counts), and an in-place op on a reached
    value marks the tensor it writes into."""
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if sample_output is None or sample_output >= len(outs) or \
            not isinstance(outs[sample_output], fx.Node):
        return []

    def requires_grad(node) -> bool:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value.requires_grad
        # a tuple of tensors (split, chunk): its getitems decide; sizes and flags carry none
        return isinstance(value, (list, tuple)) and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in value)

    sample = outs[sample_output]
    reached = {sample} if requires_grad(sample) else set()
    for node in gm.graph.nodes:
        if not reached:
            break
        if node in reached or node.op in ("placeholder", "output"):
            continue
        if not any(a in reached for a in node.all_input_nodes):
            continue
        if requires_grad(node):
            reached.add(node)
        if _writes_in_place(node):  # (x[i] = sample returns nothing, and writes into x)
            # later readers of the written tensor (and of what it views) see the sample
            written = node.args[0] if node.args else None
            while isinstance(written, fx.Node):
                reached.add(written)
                written = written.args[0] if _name(written) in _VIEWS and written.args \
                    else None
    return [i for i, o in enumerate(outs)
            if i != sample_output and isinstance(o, fx.Node) and o in reached]
