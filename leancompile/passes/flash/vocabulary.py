"""The words every FlashOverlap matcher and rewrite speaks: the site kinds a report names, the
op sets (matmuls, reshapes, transposes, layout ops, metadata reads), ``Skip`` (a site left
alone, with its reason) and ``find_sites`` (each collective of a kind: a match or a skip), the
checks every site goes through (its one wait, its group, the divisibility of its sizes), and the
small graph helpers the matchers share (shapes without guards, reshape dim groups, readers).

Nothing here changes a graph. The other modules of ``passes/flash/`` import from this one; it
passes on the names other passes share, defined once elsewhere (``RESHAPES``, ``TRANSPOSES``,
``SPLITS``, ``node_arg``, ``norm_dim`` in ``passes/aten_ops.py``; ``node_val`` in
``runtime/fx_values.py``).

Dynamic shapes. Sizes in ``meta["val"]`` may be SymInts. ``divisible`` decides the
divisibility of a gathered (or reduced) size by ``N * m`` on the shape environment's sympy
expression, without adding guards (``statically_known_true``). When it is only true for the
traced sizes (``4*s27`` by 8 holds when ``s27`` is even), it returns the sympy condition, e.g.
``Eq(Mod(4*s27, 8), 0)``, which the match carries as ``needs_guard`` (the site is not
skipped); a rewrite that uses the match must install it first:
``shape_env.evaluate_expr(match.needs_guard)`` adds it to the shape environment, whose guards
Dynamo turns into the compiled region's guards after the backend returns (AOTAutograd compiles
the forward and the backward graph before that). ``allow_guards=False`` skips such sites
instead, naming the symbol and the guard (the FlashOverlap pass allows guards in forward and
inference graphs, not in backward graphs). A symbolic size that is false for the traced sizes,
or has no hint (data-dependent), is skipped.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...runtime.fx_values import node_val
from ..aten_ops import RESHAPES, SPLITS, TRANSPOSES, node_arg, norm_dim
from ..result import PassResult

__all__ = [
    "A2A_SITE", "AG_SITE", "ALL_GATHER", "ALL_TO_ALL", "ATTENTION_RS_SITE", "ATTENTION_SITE",
    "FLASH_MATMULS", "LAYOUT", "METADATA", "PASS_THROUGH", "REDUCE_SCATTER", "RESHAPES",
    "RS_SITE", "SAME_LAYOUT", "SPLITS", "TRANSPOSES", "Skip", "cat_dim", "cat_of",
    "check_divisor", "check_group", "collective_group", "data_readers", "descendants",
    "describe", "divisible", "find_sites", "graph_order", "is_backward_graph", "is_cast",
    "is_slice_of", "is_transpose", "matmul_operand", "matmul_operands", "node_arg",
    "node_names", "node_val", "norm_dim", "only_wait", "ordered_slices", "propagate_dims",
    "reshape_groups", "round_up", "same_shape", "same_size", "shape_of", "split_pieces",
    "swap_dim", "unique_in_order",
]

# The kinds of site a report names (``PassResult.rewrite`` / ``skip``).
AG_SITE = "all_gather+mm"
RS_SITE = "mm+reduce_scatter"
A2A_SITE = "all_to_all"
ATTENTION_SITE = "all_to_all+attention"
ATTENTION_RS_SITE = "attention+matmul+reduce_scatter"
"""An attention split by query inside a reduce-scatter schedule."""

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_TO_ALL = _c10d.all_to_all_single.default

FLASH_MATMULS = (aten.mm.default, aten.addmm.default)
"""The matmuls a FlashOverlap schedule slices (``passes/row_rules.py`` has its own table of
matmuls with their operand indices, for another question)."""
SAME_LAYOUT = (aten.clone.default, aten.alias.default)
PASS_THROUGH = RESHAPES + TRANSPOSES + SAME_LAYOUT
"""What a matcher follows between a collective and its matmul."""
LAYOUT = RESHAPES + (aten.permute.default,) + SAME_LAYOUT
"""The layout ops between an all-to-all and its attention (or an attention and its matmul)."""
METADATA = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
            aten.sym_storage_offset.default)
"""Ops that read a tensor's metadata only, never its data."""


class Skip(Exception):
    """This site is left alone, with ``args[0]`` as the reason; ``local="shape"``
    when the reason depends on this rank's sizes (another rank may decide otherwise)."""

    def __init__(self, reason: str, *, local: str = ""):
        super().__init__(reason)
        self.local = local


def find_sites(graph: fx.Graph, target, kind: str, match_one, result: PassResult,
               on_error: str) -> list:
    """``match_one(node)`` for every ``target`` node: its match, or a skip with the reason.
    With ``on_error="skip"`` an unexpected exception is a skip too (the matcher only reads the
    graph, so the site stays as it was)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not target:
            continue
        try:
            matches.append(match_one(node))
        except Skip as skip:
            result.skip(node, kind, skip.args[0], local=skip.local)
        except Exception as exc:  # noqa: BLE001 - reported as the skip reason
            if on_error == "raise":
                raise
            result.skip(node, kind, f"the matcher raised {type(exc).__name__}: {exc}; the site "
                        "was left as it was (a bug in leancompile: please report it)",
                        local="error")
    return matches


def check_divisor(divisor, name: str) -> None:
    """``ValueError`` unless ``divisor`` (the option ``name``) is an int >= 1."""
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor ({name}) must be a positive int, got {divisor!r}")


# ----------------------------------------------------------------------------------------------
# Checks every site goes through


def only_wait(collective: fx.Node) -> fx.Node:
    """The one ``wait_tensor`` reading ``collective``; ``Skip`` when anything else reads it."""
    users = data_readers(collective, keep_output=True)
    if len(users) == 1 and users[0].target is _c10d.wait_tensor.default:
        return users[0]
    listed = ", ".join(map(describe, users)) or "none"
    raise Skip(f"wait_tensor is not the only user of the collective (users: {listed})")


def collective_group(node: fx.Node, size_index: int) -> tuple:
    """(group size, group name) of a functional collective whose ``group_size`` argument is at
    ``size_index`` and ``group_name`` right after it; ``Skip`` unless the name is a live
    process group of that size."""
    size = node_arg(node, size_index, "group_size")
    name = node_arg(node, size_index + 1, "group_name")
    check_group(name, size)
    return size, name


def check_group(name, size) -> None:
    """``Skip`` unless ``name`` is a live process group of ``size`` ranks."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - any failure to resolve means "not a live group here"
        raise Skip(f"group {name!r} is unknown: not a registered process group name "
                   "(unknown group)") from None
    if group.size() != size:
        raise Skip(f"group size argument {size} does not match the size {group.size()} of "
                   f"group {name!r}")


def divisible(size, n: int, m: int, what: str, allow_guards: bool, name: str):
    """None when ``size`` is divisible by ``n * m``; the sympy guard when only the traced sizes
    make it so; raises ``Skip`` otherwise. ``name``: the option ``m`` came from."""
    k = n * m
    by = f"world size {n} x {name} {m} = {k}" if m > 1 else f"world size {n}"
    fix = f" or set {name}=1"
    if isinstance(size, int):
        if size % k == 0:
            return None
        also = fix if m > 1 and size % n == 0 else ""
        raise Skip(f"{what} of size {size} is not divisible by {by}; pad {what.split(' ', 1)[1]} "
                   f"to {round_up(size, k)}{also}", local="shape")
    cond = size % k == 0
    if statically_known_true(cond):
        return None
    expr = cond.node.expr
    if not cond.node.has_hint():
        raise Skip(f"symbolic size {size} of {what} cannot be proven divisible by {by} "
                   "(data-dependent size, no hint)", local="shape")
    hint = size.node.hint
    if not cond.node.hint:
        raise Skip(f"symbolic size {size} of {what} (= {hint} for the traced shapes) is not "
                   f"divisible by {by}; pad it to a multiple of {k}"
                   + (fix if m > 1 else ""), local="shape")
    if not allow_guards:
        raise Skip(f"symbolic size {size} of {what} cannot be proven divisible by {by}: true "
                   f"for the traced shapes (= {hint}) only under the guard {expr}, which is "
                   "not added here (guards are added while compiling a forward graph, not a "
                   "backward one); mark the dim static" + (fix if m > 1 else ""), local="shape")
    return expr


# ----------------------------------------------------------------------------------------------
# Small graph helpers


def data_readers(node: fx.Node, *, keep_output: bool = False) -> list[fx.Node]:
    """Users that read the data (sym_size and friends only read metadata)."""
    return [u for u in node.users
            if not (u.op == "call_function" and u.target in METADATA)
            and (keep_output or u.op != "output")]


def matmul_operand(mm: fx.Node, which: str):
    """Operand ``"A"`` (rows) or ``"B"`` (the weight side) of an mm/addmm node."""
    offset = 1 if mm.target is aten.addmm.default else 0
    return mm.args[offset + (0 if which == "A" else 1)]


def matmul_operands(mm: fx.Node):
    """(bias or None, A, B) of an mm/addmm node; None for an addmm with alpha or beta != 1 (no
    schedule slices a scaled product)."""
    if mm.target is aten.addmm.default:
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            return None
        return mm.args[0], mm.args[1], mm.args[2]
    return None, mm.args[0], mm.args[1]


def shape_of(node: fx.Node) -> tuple:
    """``node``'s shape from its ``meta["val"]`` (ints or SymInts); ``Skip`` without one."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        name = getattr(node, "name", node)
        raise Skip(f"no shape metadata (meta['val']) on {name}; run on a traced post-grad graph")
    return tuple(val.shape)


def split_pieces(split: fx.Node, n: int) -> list[fx.Node] | None:
    """The ``n`` getitems of a split, in order, when the split makes exactly ``n`` pieces."""
    vals = split.meta.get("val")
    if not isinstance(vals, (list, tuple)) or len(vals) != n:
        return None
    by_index = {}
    for user in split.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        by_index[user.args[1]] = user
    if sorted(by_index) != list(range(n)):
        return None
    return [by_index[i] for i in range(n)]


def is_slice_of(node: fx.Node, source: fx.Node, dim: int) -> bool:
    """Whether ``node`` is a step-1 ``slice`` of ``source`` along ``dim``."""
    return (node.target is aten.slice.Tensor and node.args[0] is source
            and norm_dim(node_arg(node, 1, "dim", 0), len(shape_of(source))) == dim
            and node_arg(node, 4, "step", 1) == 1)


def ordered_slices(nodes, source: fx.Node, dim: int, n: int) -> list[fx.Node] | None:
    """``n`` slices of ``source`` on ``dim`` that tile it from 0 to its end, in tiling order."""
    if len(nodes) != n or not all(is_slice_of(s, source, dim) for s in nodes):
        return None
    ordered, at = [], 0
    for _ in range(n):
        piece = next((s for s in nodes if same_size(node_arg(s, 2, "start", 0), at)), None)
        if piece is None:
            return None
        ordered.append(piece)
        at = node_arg(piece, 3, "end")
    size = shape_of(source)[dim]
    if not (same_size(at, size) or (isinstance(at, int) and isinstance(size, int) and at >= size)):
        return None
    return ordered


def cat_of(pieces: list[fx.Node]) -> fx.Node | None:
    """The cat that reads exactly ``pieces``, in order."""
    return next((user for user in pieces[0].users if user.target is aten.cat.default
                 and list(user.args[0]) == list(pieces)), None)


def cat_dim(cat: fx.Node, shape: tuple) -> int:
    """The dim ``cat`` joins along, non-negative (``shape``: its output's)."""
    return norm_dim(node_arg(cat, 1, "dim", 0), len(shape))


def same_shape(a: tuple, b: tuple) -> bool:
    """Shapes equal, decided without guards (``(s0, 4) == (4,)`` in Python would compare
    ``s0 == 4`` and specialize ``s0``)."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def same_size(a, b) -> bool:
    """a == b for ints, SymInts (statically, no guard) or fx nodes carrying SymInts."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if a is b:
            return True
        a = a.meta.get("val") if isinstance(a, fx.Node) else a
        b = b.meta.get("val") if isinstance(b, fx.Node) else b
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return statically_known_true(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def propagate_dims(node: fx.Node, tags: tuple[frozenset, ...]) -> tuple[frozenset, ...] | None:
    """Dim tags of ``node``'s output from those of its input (None: cannot follow)."""
    target = node.target
    if target in SAME_LAYOUT or is_cast(node):
        return tags
    if target is aten.t.default:
        return tags[::-1] if len(tags) == 2 else tags
    if target is aten.transpose.int:
        a, b = (norm_dim(d, len(tags)) for d in node.args[1:3])
        out = list(tags)
        out[a], out[b] = tags[b], tags[a]
        return tuple(out)
    if target is aten.permute.default:
        return tuple(tags[norm_dim(d, len(tags))] for d in node.args[1])
    if target in RESHAPES:
        groups = reshape_groups(shape_of(node.args[0]), shape_of(node))
        if groups is None:
            return None
        out = [frozenset()] * len(shape_of(node))
        for src, dst in groups:
            merged = frozenset().union(*(tags[i] for i in src))
            for j in dst:
                out[j] = merged
        return tuple(out)
    return None


def reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input dims with runs of output dims of equal product (a reshape's dim
    groups); decided on the traced sizes (hints) for SymInts."""
    s = [_hint(x) for x in src]
    d = [_hint(x) for x in dst]
    if None in s or None in d or 0 in s or 0 in d:
        return None
    groups, i, j = [], 0, 0
    while i < len(s) or j < len(d):
        src_dims, dst_dims, ps, pd = [], [], 1, 1
        if i < len(s):
            src_dims.append(i)
            ps *= s[i]
            i += 1
        if j < len(d):
            dst_dims.append(j)
            pd *= d[j]
            j += 1
        while ps != pd:
            if ps < pd and i < len(s):
                src_dims.append(i)
                ps *= s[i]
                i += 1
            elif pd < ps and j < len(d):
                dst_dims.append(j)
                pd *= d[j]
                j += 1
            else:
                return None
        groups.append((src_dims, dst_dims))
    return groups


def _hint(size):
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    return node.hint if node is not None and node.has_hint() else None


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that reads ``node``, directly or through others."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def is_backward_graph(graph: fx.Graph) -> bool:
    """True for an AOTAutograd backward graph (it has ``tangents`` inputs)."""
    return any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)


def is_transpose(node) -> bool:
    """Whether ``node`` transposes a matrix (``t``, ``transpose``, ``permute([1, 0])``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.t.default, aten.transpose.int):
        return True
    return node.target is aten.permute.default and list(node.args[1]) == [1, 0]


def is_cast(node: fx.Node) -> bool:
    """A dtype conversion and nothing else: ``prims.convert_element_type`` (Inductor's
    decomposition) or ``aten._to_copy`` with only ``dtype`` (same device, layout, format)."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.prims.convert_element_type.default:
        return True
    return (node.target is aten._to_copy.default and len(node.args) == 1
            and set(node.kwargs) == {"dtype"})


def swap_dim(node: fx.Node) -> int | None:
    """d when ``node`` is ``permute(x, p)`` with p swapping dims 0 and d (``movedim(d, 0)`` of a
    3-D tensor, or ``transpose(0, d)``), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.permute.default):
        return None
    perm = [norm_dim(d, len(node.args[1])) for d in node.args[1]]
    d = perm[0]
    expected = list(range(len(perm)))
    expected[0], expected[d] = d, 0
    return d if d != 0 and perm == expected else None


def graph_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Node -> its position in ``graph``."""
    return {node: i for i, node in enumerate(graph.nodes)}


def unique_in_order(nodes) -> tuple[fx.Node, ...]:
    """``nodes`` without repeats, in graph order."""
    seen: dict[fx.Node, None] = {}
    for node in nodes:
        seen.setdefault(node, None)
    if not seen:
        return ()
    order = graph_order(next(iter(seen)).graph)
    return tuple(sorted(seen, key=order.__getitem__))


def describe(node: fx.Node) -> str:
    """``node`` as a skip reason names it: ``"aten.relu.default at relu"``."""
    if node.op == "output":
        return "the graph output (saved for backward or returned)"
    if node.op == "placeholder":
        return f"graph input {node.name}"
    target = node.target
    name = str(target) if hasattr(target, "_schema") else getattr(target, "__name__", str(target))
    return f"{name} at {node.name}"


def node_names(nodes) -> str:
    """The nodes' names, comma-separated (``"no node"`` for none)."""
    return ", ".join(n.name for n in nodes) or "no node"


def round_up(size, k: int) -> str:
    """``size`` rounded up to a multiple of ``k``, for a message."""
    if isinstance(size, int):
        return str(-(-size // k) * k)
    return f"a multiple of {k}"
