"""Canonicalisation: one spelling for reshapes, no no-op slices, no aliases, no copies into fresh
buffers, and dead code dropped, before any matcher runs.

Post-grad graphs spell "the same tensor with another shape" three ways (``aten.view``,
``aten._unsafe_view``, ``aten.reshape``), keep slices that take a whole dim (DTensor's trim of an
evenly sharded gather, ``x[:, :s]`` with ``s`` the full size) and keep nodes whose results nobody
reads. Matchers in later passes (FlashOverlap's ``all_gather -> reshape -> mm``) then need one
case per spelling and trip over dead users. This pass rewrites the graph so that matchers see
``aten.reshape.default`` only, no slice of a whole dim, and every node has a reader or a side
effect. (Under Inductor its joint-graph passes already drop no-op slices; ``aot_eager`` runs no
such pass, so without this the two compilers would show the matchers different graphs.)

Before::

    mm = aten.mm(x, w)
    v = aten._unsafe_view(mm, [2, 8, 16])
    unused = aten.relu(v)              # nobody reads it
    s = aten.slice(v, 1, 0, 8)         # all 8 rows of dim 1
    out = aten.view(s, [16, 16])

After::

    mm = aten.mm(x, w)
    v = aten.reshape(mm, [2, 8, 16])
    out = aten.reshape(v, [16, 16])

Why it is legal: ``view`` only exists where the input is viewable, and there ``reshape`` returns
the same view, so values, strides and aliasing are unchanged. ``_unsafe_view`` promises that its
result does not alias its input; ``reshape`` may alias, so it is rewritten only where nobody else
can observe the difference: the input is an intermediate (not a graph input or output) read by
this node alone. A slice with step 1 from 0 to at least the size of its dim (proven on the
symbolic sizes, no guard added) is its input with the same shape and strides; it is replaced by
its input except where it is a graph output (AOTAutograd recorded the output as a view).
A ``copy(empty(...), src)`` (an in-place c10d collective written into a fresh buffer, as
torchtitan's default TP backend does, functionalized) is ``src`` when the buffer is read by the
copy alone and both have the same shape, dtype, device and contiguous strides; its readers read
``src`` (also where the copy is a graph output, when ``src`` is a collective's result: a fresh
tensor either way). An ``alias`` that is not a graph output is its input.
Dead nodes are dropped only when they are pure: collectives, mutations and
random ops (which advance the generator) stay, and are reported as skipped with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime.namespaces import ANY_COLLECTIVE_NAMESPACES
from .result import PassResult, recompile

__all__ = ["canonicalize_pass", "find_reshape_matches", "find_noop_slice_matches",
           "find_alias_matches", "find_buffer_copy_matches", "find_dead_code_matches",
           "VERSION"]

VERSION = 3
NAME = "canonicalize"

aten = torch.ops.aten
_VIEW_OPS = (aten.view.default, aten._unsafe_view.default)


@dataclass(frozen=True, kw_only=True)
class _ReshapeMatch:
    node: fx.Node


@dataclass(frozen=True, kw_only=True)
class _DeadMatch:
    node: fx.Node


def _is_graph_output(node: fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)


def find_reshape_matches(graph: fx.Graph, result: PassResult) -> list[_ReshapeMatch]:
    """Every ``view``/``_unsafe_view`` that can become ``reshape``; the others go to ``result``."""
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _VIEW_OPS:
            continue
        if node.target is aten._unsafe_view.default:
            base = node.args[0]
            if not isinstance(base, fx.Node) or base.op == "placeholder":
                result.skip(node, "view->reshape", "input is a graph input; _unsafe_view's "
                            "no-alias promise would be lost")
                continue
            if _is_graph_output(base):
                result.skip(node, "view->reshape", "input is also a graph output; _unsafe_view's "
                            "no-alias promise would be lost")
                continue
            if len(base.users) != 1:
                result.skip(node, "view->reshape", f"input has {len(base.users)} readers; "
                            "_unsafe_view's no-alias promise would be lost")
                continue
        matches.append(_ReshapeMatch(node=node))
    return matches


@dataclass(frozen=True, kw_only=True)
class _NoopSliceMatch:
    node: fx.Node


def _whole_dim(node: fx.Node) -> bool:
    """``slice(x, dim, start, end, step)`` covering all of ``dim``."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    args = list(node.args) + [None] * (5 - len(node.args))
    x, dim, start, end, step = args[:5]
    dim = node.kwargs.get("dim", dim if dim is not None else 0)
    start = node.kwargs.get("start", start if start is not None else 0)
    end = node.kwargs.get("end", end)
    step = node.kwargs.get("step", step if step is not None else 1)
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or step != 1 or isinstance(start, fx.Node) or start != 0:
        return False
    size = val.shape[dim]
    if end is None:
        return True
    if isinstance(end, fx.Node):
        end = end.meta.get("val")
    if not isinstance(end, (int, torch.SymInt)):
        return False
    try:
        return bool(statically_known_true(end >= size))
    except Exception:  # noqa: BLE001 - not provable: not a no-op
        return False


def find_noop_slice_matches(graph: fx.Graph, result: PassResult) -> list[_NoopSliceMatch]:
    """Every ``aten.slice`` that takes a whole dim and can be dropped; those that are graph
    outputs go to ``result``."""
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.slice.Tensor:
            continue
        if not _whole_dim(node):
            continue
        if _is_graph_output(node):
            result.skip(node, "no-op slice", "the slice is a graph output; AOTAutograd "
                        "recorded it as a view of its input")
            continue
        matches.append(_NoopSliceMatch(node=node))
    return matches


def rewrite_noop_slice(match: _NoopSliceMatch) -> None:
    """``slice(x, d, 0, >= size)`` -> ``x``: its readers read the input."""
    node = match.node
    node.replace_all_uses_with(node.args[0])
    node.graph.erase_node(node)


@dataclass(frozen=True, kw_only=True)
class _BufferCopyMatch:
    node: fx.Node
    buffer: fx.Node


_EMPTY_OPS = (aten.empty.memory_format, aten.empty_strided.default)
_WAIT = torch.ops._c10d_functional.wait_tensor.default


def find_buffer_copy_matches(graph: fx.Graph, result: PassResult) -> list[_BufferCopyMatch]:
    """Every ``copy(empty(...), src)`` that is ``src`` itself: an in-place c10d collective
    written into a fresh buffer (``dist.all_gather_into_tensor(out, x)`` with ``out =
    torch.empty(...)``), functionalized. The buffer is read by the copy alone and has ``src``'s
    shape, dtype, device and (contiguous) strides; ``src`` is contiguous."""
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        buffer, src = node.args[0], node.args[1]
        if not (isinstance(buffer, fx.Node) and isinstance(src, fx.Node)
                and buffer.op == "call_function" and buffer.target in _EMPTY_OPS
                and len(buffer.users) == 1 and not node.kwargs.get("non_blocking", False)):
            continue
        b, v = buffer.meta.get("val"), src.meta.get("val")
        if not (isinstance(b, torch.Tensor) and isinstance(v, torch.Tensor)
                and b.dtype == v.dtype and b.device == v.device
                and _same_sizes(b.shape, v.shape) and _contiguous(b) and _contiguous(v)):
            continue
        if _is_graph_output(node) and src.target is not _WAIT:
            result.skip(node, "buffer copy", "the copy is a graph output and its source is not "
                        "a collective's result; it stays a copy")
            continue
        matches.append(_BufferCopyMatch(node=node, buffer=buffer))
    return matches


def _same_sizes(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _contiguous(t: torch.Tensor) -> bool:
    """Contiguous strides, decided without adding guards (False when unknown)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def find_alias_matches(graph: fx.Graph, result: PassResult) -> list[_ReshapeMatch]:
    """Every ``aten.alias`` that is not a graph output: the same tensor, same shape and strides
    (activation checkpointing's graphs spell the in-place gather's buffer through them)."""
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.alias.default:
            continue
        if _is_graph_output(node):
            result.skip(node, "alias", "the alias is a graph output; AOTAutograd recorded it "
                        "as a view of its input")
            continue
        matches.append(_ReshapeMatch(node=node))
    return matches


def rewrite_alias(match: _ReshapeMatch) -> None:
    """``alias(x)`` -> ``x``."""
    node = match.node
    node.replace_all_uses_with(node.args[0])
    node.graph.erase_node(node)


def rewrite_buffer_copy(match: _BufferCopyMatch) -> None:
    """``copy(empty(...), src)`` -> ``src``; the buffer goes with the copy."""
    node = match.node
    node.replace_all_uses_with(node.args[1])
    node.graph.erase_node(node)
    node.graph.erase_node(match.buffer)


def rewrite_reshape(match: _ReshapeMatch) -> None:
    """``view(x, shape)`` / ``_unsafe_view(x, shape)`` -> ``reshape(x, shape)``, meta kept."""
    match.node.target = aten.reshape.default


def _side_effect_reason(node: fx.Node) -> str | None:
    target = node.target
    namespace = getattr(target, "namespace", "") or getattr(
        getattr(target, "_overloadpacket", None), "__module__", "")
    if namespace in ANY_COLLECTIVE_NAMESPACES:
        return "collective: every rank must issue it"
    schema = getattr(target, "_schema", None)
    if schema is not None and any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutates an input"
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return "random op: dropping it would shift the random stream"
    if node.is_impure():
        return "has side effects"
    return None


def find_dead_code_matches(graph: fx.Graph, result: PassResult) -> list[_DeadMatch]:
    """Unread ``call_function`` nodes that are safe to drop, in reverse graph order.

    Dropping a node can make its inputs dead; the scan walks backwards and counts users that
    are themselves about to be dropped, so whole dead chains come out in one call.
    """
    dead: set[fx.Node] = set()
    matches = []
    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        if any(user not in dead for user in node.users):
            continue
        reason = _side_effect_reason(node)
        if reason is not None:
            if not node.users:
                result.skip(node, "dead code", f"unread but kept: {reason}")
            continue
        dead.add(node)
        matches.append(_DeadMatch(node=node))
    return matches


def rewrite_dead_code(match: _DeadMatch) -> None:
    """Erase an unread, pure node (its users, if any, were erased before it)."""
    match.node.graph.erase_node(match.node)


def canonicalize_pass(gm: fx.GraphModule, options=None) -> PassResult:
    """Rewrite views to ``aten.reshape``, drop no-op slices and dead pure nodes; see the module
    docstring.
    Takes no options (``options`` is the pipeline's ``CompileOptions``, unused here)."""
    result = PassResult(name=NAME)
    for match in find_dead_code_matches(gm.graph, result):
        rewrite_dead_code(match)
        result.rewrite(match.node, "dead code")
    for match in find_alias_matches(gm.graph, result):
        result.rewrite(match.node, "alias")
        rewrite_alias(match)
    for match in find_buffer_copy_matches(gm.graph, result):
        result.rewrite(match.node, "buffer copy")
        rewrite_buffer_copy(match)
    for match in find_noop_slice_matches(gm.graph, result):
        result.rewrite(match.node, "no-op slice")
        rewrite_noop_slice(match)
    for match in find_reshape_matches(gm.graph, result):
        rewrite_reshape(match)
        result.rewrite(match.node, "view->reshape")
    if result.rewritten:
        gm.graph.lint()
        recompile(gm)
    return result
