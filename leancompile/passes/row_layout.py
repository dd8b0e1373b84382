"""Which tensors of a forward graph hold the batch row by row: the analysis that lets LeanGRPO
serve any regrouping of a rollout's rows from what the rollout kept.

The graph is traced with a symbolic batch size ``s`` (dim 0 of the batch-major inputs). Every
node gets a layout:

- ``None``: does not depend on the batch (parameters, batch-independent inputs and what is
  computed from them alone);
- ``RowLayout(outer, inner)``: dim 0 has ``outer * s * inner`` entries, sample ``r``'s entries
  at ``(o * s + r) * inner + i``. ``(1, 1)``: one row per sample; ``(1, 16)``: 16 consecutive
  rows per sample (``[s, 16, d]`` flattened to ``[16*s, d]``); ``(2, 1)``: classifier-free
  guidance's ``cat([uncond, cond])``, the samples twice;
- ``Mixed(reason)``: rows of different samples meet (a reduction over the batch, a softmax over
  dim 0, ``arange(s)``, batch norm in training mode, the batch moved out of dim 0), or an op
  this analysis does not follow along dim 0.

Why it is sound: a node whose batch-carrying inputs all have one layout and whose op works on
each dim-0 entry separately (pointwise ops, matmuls with the batch in the rows, reductions and
normalisations over other dims, attention over other dims) computes sample ``r``'s entries from
sample ``r``'s entries only, so the entries of a gathered batch equal what the same op computes
on that batch. Reshapes, permutations, slices, splits and concatenations move dim-0 entries in
ways the layout tracks exactly; anything else that touches dim 0 is ``Mixed``. A tensor made
without batch-carrying inputs but with ``s`` in its shape is only accepted from constant fills
and expands (every row the same), never from ``arange`` or random ops.

``find_row_layouts(gm, batch_inputs, batch_symbol)`` returns the layout of every node; the
LeanGRPO pass (``lean_grpo.py``) reads those of the outputs and saved tensors.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

__all__ = ["RowLayout", "Mixed", "find_row_layouts", "layout_of_shape", "declare_same_rows",
           "forget_same_rows", "same_rows_groups", "size_in_batch"]

aten = torch.ops.aten


@dataclass(frozen=True)
class RowLayout:
    """dim 0 = ``outer * s * inner``; sample r's entries at ``(o * s + r) * inner + i``."""

    outer: int
    inner: int

    def __str__(self) -> str:
        if self.outer == 1:
            return "one row per sample" if self.inner == 1 else f"{self.inner} rows per sample"
        return f"{self.outer} blocks of {self.inner} row(s) per sample"


@dataclass(frozen=True)
class _Uniform(RowLayout):
    """A batch-sized tensor made from no batch input (``empty``, ``zeros``, an expand): every
    row holds the same (or nothing yet), so it fits whatever row layout it meets."""


@dataclass(frozen=True)
class Mixed:
    """Rows of different samples meet, or the batch leaves dim 0; ``reason`` says where."""

    reason: str


@dataclass(frozen=True)
class _Lifted:
    """A tensor with ``blocks`` (a size without the batch) in dim 0 and rows laid out as
    ``base`` in dim 1. Two spellings make one:

    - ``x.unsqueeze(0)`` on the way to ``cat([x, x])`` as decompositions spell it
      (``unsqueeze(x, 0) -> expand(k, ...) -> clone -> view(k * dim0, ...)``, e.g.
      classifier-free guidance doubling the latents);
    - a permute that moves the batch to dim 1 behind a dim of pieces, on the way to a
      collective over dim 0 and back: Ulysses sequence parallelism's
      ``[B, S/N, N, H/N, D] -> [N, B, S/N, H/N, D] -> all_to_all -> permute back``, and the
      gather of the output tokens (``movedim(1, 0) -> all_gather -> chunk, cat -> movedim``).

    What may read it keeps the rows in dim 1: an expand of dim 0, a clone; a collective over
    dim 0 (all-to-all, all-gather, their wait), a split, slice or cat along dim 0 (``blocks``
    changes); a permute that keeps dims 0 and 1, or brings dim 1 back to dim 0 (``base``
    again); a view that merges dims 0 and 1 (``RowLayout(blocks * base.outer, base.inner)``).
    Anything else is ``Mixed``, and so is a graph output or saved tensor left in this layout.

    A collective is row by row only when every rank of its group holds the same rows in the
    same order, as the ranks of a sequence-parallel group do (they run the same samples on
    their own tokens; ``declare_same_rows``); the per-row backward then exchanges each row's
    pieces with the same row of the other ranks, as the whole-batch backward does. A
    collective over another group, or over a tensor with the batch in dim 0, is ``Mixed``."""

    blocks: object
    """An int, or a sympy expression without the batch symbol."""
    base: RowLayout


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_FILLS = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
          aten.new_full.default, aten.new_zeros.default, aten.new_ones.default,
          aten.new_empty.default, aten.expand.default, aten.empty_strided.default,
          aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
          aten.empty_like.default, aten.scalar_tensor.default)
# Ops that move or combine entries along a dim given as an argument: along dim 0 they mix rows.
_ALONG_DIM = {
    aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
    aten.logcumsumexp.default, aten.sort.default, aten.sort.stable, aten.topk.default,
    aten.flip.default, aten.roll.default, aten.gather.default,
    aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
    aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
    aten.index_add.default, aten.index_copy.default, aten.index_fill.int_Scalar,
    aten.argmax.default, aten.argmin.default,
    torch.ops.prims.rev.default,  # (flip, as Inductor's decompositions spell it)
}
# Reductions and normalisations that take their dims as an argument: row by row unless one of
# them is dim 0 (or none is given: all dims).
_OVER_DIMS = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.var_mean.correction, aten.std.correction,
    aten.std_mean.correction, aten.prod.dim_int, aten.max.dim, aten.min.dim,
    aten.logsumexp.default, aten.linalg_vector_norm.default, aten.any.dim, aten.any.dims,
    aten.all.dim, aten.all.dims, aten.aminmax.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.unsqueeze.default, aten.select.int, aten.narrow.default, aten.diagonal.default,
    aten.unfold.default, aten.repeat_interleave.self_int, aten._fft_c2c.default,
    aten._fft_r2c.default, aten._fft_c2r.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.slice_scatter.default, aten.select_scatter.default,
    aten.diagonal_scatter.default,
}
# Ops that work on each entry of dim 0 on its own whatever their other arguments (the batch is
# dim 0 of their input: attention's and convolution's N, per-sample norms and pools).
_PER_ENTRY = {
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.copy.default,
    aten.convolution.default, aten.native_group_norm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
    aten.avg_pool2d.default, aten.max_pool2d_with_indices.default,
    aten.avg_pool3d.default, aten.max_pool3d_with_indices.default,
    aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec,
    aten.upsample_bilinear2d.default, aten.upsample_bilinear2d.vec,
    aten.upsample_nearest3d.default, aten.upsample_nearest3d.vec,
    aten.view_as_real.default, aten.view_as_complex.default, aten.real.default,
    aten.imag.default, aten.complex.default, aten.polar.default, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
    aten.fill.Scalar, aten.fill.Tensor, aten.repeat.default,
}
_BATCH_MIXING = {aten._native_batch_norm_legit_functional.default,
                 aten._native_batch_norm_legit.default, aten.native_batch_norm.default,
                 aten._native_batch_norm_legit_no_training.default,
                 aten.index_put.default, aten.arange.default,
                 aten.arange.start, aten.arange.start_step, aten.randperm.default,
                 # the source's entries go to the mask's true places in order, across rows
                 aten.masked_scatter.default}
# Schema types of size arguments (a batch-dependent size is fine there: a view's shape).
_SIZE_TYPE = re.compile(r"^(Optional\[)?(List\[)?(int|bool)\]?\]?$")
_LOOKUPS = {aten.index.Tensor, aten.index_select.default, aten.embedding.default}
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2)}
_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)

_SAME_ROWS: Counter = Counter()


def _group_name(group) -> str:
    return group if isinstance(group, str) else group.group_name


def declare_same_rows(group) -> None:
    """Declare that every rank of ``group`` (a process group or its ``group_name``) runs the
    same samples in the same order, as the ranks of a sequence-parallel group do
    (``parallelize_ulysses`` declares its group, ``SequenceParallel.undo`` forgets it). Only
    over such a group does an exchange or gather of whole pieces of dim 0 keep each sample's
    entries with that sample; over any other group (data parallelism: each rank its own
    samples) it is ``Mixed``. Declarations are counted: ``forget_same_rows`` undoes one."""
    _SAME_ROWS[_group_name(group)] += 1


def forget_same_rows(group) -> None:
    """Undo one ``declare_same_rows(group)``."""
    name = _group_name(group)
    _SAME_ROWS[name] -= 1
    if _SAME_ROWS[name] <= 0:
        del _SAME_ROWS[name]


def same_rows_groups() -> frozenset[str]:
    """The names of the groups declared with ``declare_same_rows`` (and not forgotten)."""
    return frozenset(_SAME_ROWS)


def _collectives():
    """Functional collectives over dim 0 that a ``_Lifted`` tensor may pass: (exchange or
    gather ops with their group name's argument index, their wait)."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None:
        return {}, ()
    return {ops.all_to_all_single.default: 3, ops.all_gather_into_tensor.default: 2}, \
        (ops.wait_tensor.default,)


def _is_collective(target) -> bool:
    from ..runtime.vmap_ops import COLLECTIVE_NAMESPACES

    return getattr(target, "namespace", None) in COLLECTIVE_NAMESPACES + ("c10d", "_dtensor")


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _has(expr, symbol) -> bool:
    if isinstance(expr, torch.SymInt):
        expr = expr.node.expr
    return isinstance(expr, sympy.Basic) and symbol in expr.free_symbols


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def layout_of_shape(shape, symbol) -> RowLayout | Mixed | None:
    """The row count per sample of a shape alone: ``None`` without ``s``; ``RowLayout(1, k)``
    when dim 0 is ``k*s`` and no other dim holds ``s``; ``Mixed`` otherwise."""
    if not any(_has(d, symbol) for d in shape):
        return None
    if any(_has(d, symbol) for d in shape[1:]):
        return Mixed(f"the batch is outside dim 0 (shape {tuple(shape)})")
    ratio = sympy.simplify(_expr(shape[0]) / symbol)
    if not (ratio.is_Integer and ratio > 0):
        return Mixed(f"dim 0 is {shape[0]}, not a multiple of the batch size")
    return RowLayout(1, int(ratio))


def size_in_batch(size, symbol):
    """A traced size as an int or a sympy expression of the batch symbol alone: other
    symbols (e.g. the size of the generator state a checkpointed random op saves, which the
    fake mode made symbolic) take the value they were traced with."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr, shape_env = size.node.expr, size.node.shape_env
    hints = shape_env.backed_var_to_val
    expr = expr.subs({s: hints[s] for s in expr.free_symbols if s != symbol and s in hints})
    return int(expr) if expr.is_number else expr


def _dim0(layout: RowLayout, symbol):
    return layout.outer * symbol * layout.inner


def _arg(node, index, name, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _norm(dim, ndim):
    return dim + ndim if isinstance(dim, int) and dim < 0 else dim


def _touches_dim0(node: fx.Node, x) -> bool:
    """Whether an op's ``dim``/``dims`` argument names dim 0 of its first input."""
    ndim = len(_val(x).shape) if isinstance(_val(x), torch.Tensor) else 1
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        if arg.name not in ("dim", "dims", "dimension", "dim1", "dim2"):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if value is None:  # None: all dims
            return True
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(_norm(v, ndim) == 0 for v in values):
            return True
    return False


class _Analysis:
    def __init__(self, gm: fx.GraphModule, batch_inputs: dict[int, int], symbol):
        self.gm = gm
        self.symbol = symbol
        self.batch_inputs = batch_inputs
        self.state: dict[fx.Node, object] = {}

    def run(self) -> dict[fx.Node, object]:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            self.state[node] = RowLayout(1, self.batch_inputs[i]) if i in self.batch_inputs \
                else None
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                self.state[node] = self.visit(node)
        for node, layout in self.state.items():  # a lifted tensor read by nothing that merges
            if isinstance(layout, _Lifted):
                self.state[node] = Mixed(f"{_name(node)}: the batch is outside dim 0 (shape "
                                         f"{tuple(_val(node).shape)})")
        return self.state

    # -- one node ---------------------------------------------------------------------------
    def visit(self, node: fx.Node):
        inputs = [a for a in node.all_input_nodes]
        layouts = [self.state.get(a) for a in inputs]
        for layout in layouts:
            if isinstance(layout, Mixed):
                return layout
        sized = self.batch_size_as_value(node)
        if sized is not None:
            return Mixed(f"{_name(node)} reads the batch size ({sized}) as a value: its result "
                         "differs with the number of rows a call has")
        val = _val(node)
        lifted = [a for a, lay in zip(inputs, layouts) if isinstance(lay, _Lifted)]
        if lifted:
            return self.lifted(node, lifted[0], sum(isinstance(_val(a), torch.Tensor)
                                                    for a in inputs))
        if node.target is aten.unsqueeze.default and isinstance(val, torch.Tensor) and \
                layouts and isinstance(layouts[0], RowLayout) and \
                _norm(node.args[1], val.dim()) == 0:
            return _Lifted(1, layouts[0])
        if node.target in _PERMUTES and layouts and isinstance(layouts[0], RowLayout):
            order = _permutation(node)
            if len(order) > 1 and order[1] == 0 and not _has(val.shape[0], self.symbol) and \
                    not any(_has(d, self.symbol) for d in val.shape[2:]):
                return _Lifted(_static(val.shape[0]), layouts[0])
        if node.target is operator.getitem:
            source = self.state.get(node.args[0])
            if isinstance(source, tuple):
                return source[node.args[1]]
            return source
        carrying = [a for a, lay in zip(inputs, layouts) if isinstance(lay, (RowLayout, tuple))]
        if isinstance(val, (tuple, list)):
            return self.multi(node, carrying, val)
        if not isinstance(val, torch.Tensor):
            return None
        shaped = layout_of_shape(val.shape, self.symbol)
        if not carrying:
            if shaped is None:
                return None
            if node.target in _FILLS:
                return _Uniform(shaped.outer, shaped.inner) if isinstance(shaped, RowLayout) \
                    else shaped
            return Mixed(f"{_name(node)} makes a batch-sized tensor from no batch input")
        if isinstance(shaped, Mixed):
            return Mixed(f"{_name(node)}: {shaped.reason}")
        if shaped is None:
            return Mixed(f"{_name(node)} reduces over the batch (output shape "
                         f"{tuple(val.shape)})")
        if _is_collective(node.target) and node.target not in _collectives()[1]:
            # Over dim 0 with the batch in it, pieces of dim 0 are rows: an exchange moves
            # another rank's rows into this one's (a reduction adds them).
            return Mixed(f"{_name(node)}: a collective over the batch dim")
        return self.single(node, carrying, shaped, val)

    def batch_size_as_value(self, node):
        """The batch-dependent size an op takes as a value (a scalar operand, a fill value:
        ``h * x.shape[0]``), not as a size (a view's shape, a slice's bounds); else None."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or self.symbol is None:
            return None
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if not isinstance(value, fx.Node) or _SIZE_TYPE.match(str(arg.type)):
                continue
            v = _val(value)
            if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
                    self.symbol in v.node.expr.free_symbols:
                return v
        return None

    def multi(self, node, carrying, vals):
        if not carrying:
            shapes = [layout_of_shape(v.shape, self.symbol) if isinstance(v, torch.Tensor)
                      else None for v in vals]
            if all(s is None for s in shapes):
                return tuple(None for _ in vals)
            return Mixed(f"{_name(node)} makes batch-sized tensors from no batch input")
        target = node.target
        if target in (aten.split.Tensor, aten.split_with_sizes.default,
                      aten.unbind.int, aten.chunk.default):
            return self.split(node, carrying, vals)
        if target in _BATCH_MIXING or (target in _ALONG_DIM and _touches_dim0(node, carrying[0])):
            return Mixed(f"{_name(node)} combines entries along the batch dim")
        unknown = _no_row_rule(node, carrying[0])
        if unknown:
            return Mixed(unknown)
        base = self.state[carrying[0]]
        out = []
        for v in vals:
            if not isinstance(v, torch.Tensor):
                out.append(None)
                continue
            shaped = layout_of_shape(v.shape, self.symbol)
            if shaped is None:
                out.append(Mixed(f"{_name(node)} reduces over the batch"))
            elif isinstance(shaped, Mixed) or _dim0_of(v) != _dim0(base, self.symbol):
                out.append(Mixed(f"{_name(node)} changes dim 0 ({_dim0_of(v)})")
                           if not isinstance(shaped, Mixed) else shaped)
            else:
                out.append(base)
        return tuple(out)

    def split(self, node, carrying, vals):
        x = node.args[0]
        layout = self.state[x]
        dim = _norm(_arg(node, 2, "dim", 0) if node.target is not aten.unbind.int
                    else _arg(node, 1, "dim", 0), len(_val(x).shape))
        if dim != 0:
            return tuple(layout for _ in vals)
        block = self.symbol * layout.inner
        out, start = [], sympy.Integer(0)
        for v in vals:
            size = _expr(v.shape[0]) if v.dim() else sympy.Integer(1)
            first = sympy.simplify(start / block)
            count = sympy.simplify(size / block)
            start = start + size
            if first.is_Integer and count.is_Integer and count > 0:
                out.append(RowLayout(int(count), layout.inner))
            else:
                out.append(Mixed(f"{_name(node)} splits dim 0 inside a block of samples"))
        return tuple(out)

    def single(self, node, carrying, shaped: RowLayout, val):
        target = node.target
        symbol = self.symbol
        first = self.state[carrying[0]]
        if target in _BATCH_MIXING:
            return Mixed(f"{_name(node)} combines entries along the batch dim")
        if target in _LOOKUPS:
            return self.lookup(node, val)
        if target in _ALONG_DIM and _touches_dim0(node, carrying[0]):
            return Mixed(f"{_name(node)} works along dim 0, the batch")
        if target in _VIEWS:
            return self.reshape(node, first, val)
        if target in _PERMUTES:
            moved = _permutation(node)[0] != 0
            return Mixed(f"{_name(node)} moves the batch out of dim 0") if moved else first
        if target is aten.slice.Tensor:
            return self.slice(node, first)
        if target is aten.cat.default:
            return self.cat(node)
        if target in _MATMULS:
            a_index, b_index = _MATMULS[target]
            a, b = node.args[a_index], node.args[b_index]
            a_layout, b_layout = self.state.get(a), self.state.get(b)
            if target in (aten.mm.default, aten.addmm.default) and b_layout is not None:
                return Mixed(f"{_name(node)}: the batch is in the weight operand")
            if target is aten.addmm.default and self.state.get(node.args[0]) is not None:
                return Mixed(f"{_name(node)}: a batch-dependent bias")
            if target in (aten.bmm.default, aten.baddbmm.default) and b_layout is not None \
                    and b_layout != a_layout:
                return Mixed(f"{_name(node)}: operands with different row layouts")
            if a_layout is None:
                return Mixed(f"{_name(node)}: the batch is in the weight operand")
            return a_layout
        if target in (aten.expand.default,):
            return first if _dim0_of(val) == _dim0(first, symbol) else \
                Mixed(f"{_name(node)} expands dim 0")
        # Any other op with a row rule (an allowlist: pointwise ops, reductions and
        # normalisations over other dims, per-entry ops such as attention): dim 0 kept as it
        # is, every batch-carrying input in one layout (a _Uniform input fits any).
        unknown = _no_row_rule(node, carrying[0])
        if unknown:
            return Mixed(unknown)
        dim0 = _dim0_of(val)
        first = next((self.state[a] for a in carrying
                      if not isinstance(self.state[a], _Uniform)), first)
        for arg in carrying:
            lay = self.state[arg]
            arg_dim0 = _dim0_of(_val(arg))
            if sympy.simplify(arg_dim0 - dim0) != 0:
                if sympy.simplify(arg_dim0 - 1) == 0:  # broadcast from a size-1 dim 0
                    continue
                return Mixed(f"{_name(node)} changes dim 0 from {arg_dim0} to {dim0}")
            if lay != first and not isinstance(lay, _Uniform):
                return Mixed(f"{_name(node)} combines tensors with different row layouts "
                             f"({first} and {lay})")
        return first

    def lifted(self, node, source, count: int):
        """An op reading a ``_Lifted`` tensor (see there); ``count``: its tensor inputs."""
        lay, src, val = self.state[source], _val(source), _val(node)
        target = node.target
        outside = Mixed(f"{_name(node)}: the batch is outside dim 0 (shape {tuple(src.shape)})")
        same = (lambda a, b: len(a) == len(b) and all(
            sympy.simplify(_expr(x) - _expr(y)) == 0 for x, y in zip(a, b)))
        exchanges, waits = _collectives()
        if target in _SPLITS and count == 1 and isinstance(val, (tuple, list)):
            dim = _norm(_arg(node, 1, "dim", 0) if target is aten.unbind.int
                        else _arg(node, 2, "dim", 0), src.dim())
            if target is aten.unbind.int or dim == 1:
                return outside
            return tuple(_Lifted(_static(v.shape[0]) if dim == 0 else lay.blocks, lay.base)
                         for v in val)
        if target is aten.cat.default:
            tensors = list(node.args[0])
            layouts = [self.state.get(t) for t in tensors]
            if _norm(_arg(node, 1, "dim", 0), src.dim()) == 0 and all(
                    isinstance(other, _Lifted) and other.base == lay.base and
                    same(_val(t).shape[1:], src.shape[1:]) for t, other in zip(tensors, layouts)):
                return _Lifted(_static(val.shape[0]), lay.base)
            return outside
        if count != 1 or not isinstance(val, torch.Tensor):
            return outside
        if target is aten.expand.default:
            if not _has(val.shape[0], self.symbol) and same(val.shape[1:], src.shape[1:]):
                return _Lifted(_static(val.shape[0]), lay.base)
            return outside
        if target in (aten.clone.default, aten.contiguous.default) or target in waits:
            return lay
        if target in exchanges and _arg(node, exchanges[target], "group_name") not in \
                _SAME_ROWS:
            return Mixed(f"{_name(node)}: a collective over a group not declared to hold the "
                         "same samples on every rank (declare_same_rows)")
        if target in exchanges or (target is aten.slice.Tensor and _norm(
                _arg(node, 1, "dim", 0), src.dim()) == 0):
            # Whole pieces of dim 0 move (between ranks that hold the same rows, or out of a
            # slice); dim 1 stays.
            return _Lifted(_static(val.shape[0]), lay.base) if same(
                val.shape[1:], src.shape[1:]) else outside
        if target in _PERMUTES:
            order = _permutation(node)
            if order[0] == 1 and not any(_has(d, self.symbol) for d in val.shape[1:]):
                return lay.base
            return lay if order[:2] == [0, 1] else outside
        if target in _VIEWS and val.dim() == src.dim() - 1 and \
                isinstance(lay.blocks, int) and same(val.shape[1:], src.shape[2:]) and \
                sympy.simplify(_expr(val.shape[0]) - lay.blocks * _expr(src.shape[1])) == 0:
            return RowLayout(lay.blocks * lay.base.outer, lay.base.inner)
        return outside

    def lookup(self, node, val):
        """Indexing: rows looked up in a batch-independent table by batch-carrying indices
        (``sigmas[step_index]``, an embedding) follow the indices' rows; a batch-carrying
        tensor indexed on later dims by batch-independent indices keeps its rows."""
        target = node.target
        if target is aten.embedding.default:
            table, index = node.args[0], node.args[1]
            indices, source = [index], table
        elif target is aten.index_select.default:
            source, dim, index = node.args[0], node.args[1], node.args[2]
            ndim = len(_val(source).shape)
            indices = [index] if _norm(dim, ndim) == 0 else [None] * _norm(dim, ndim) + [index]
        else:  # aten.index.Tensor
            source, indices = node.args[0], list(node.args[1])
        src = self.state.get(source)
        idx = [self.state.get(i) if isinstance(i, fx.Node) else None for i in indices]
        if src is None and indices and indices[0] is not None and isinstance(idx[0], RowLayout) \
                and all(i is None for i in indices[1:]):
            return idx[0] if _dim0_of(val) == _dim0_of(_val(indices[0])) else \
                Mixed(f"{_name(node)} indexes with a multi-dim batch index")
        if isinstance(src, RowLayout) and (not indices or indices[0] is None) and \
                all(lay is None for lay in idx) and _dim0_of(val) == _dim0_of(_val(source)):
            return src
        return Mixed(f"{_name(node)} indexes along the batch dim")

    def reshape(self, node, layout: RowLayout, val):
        source = _val(node.args[0])
        symbol = self.symbol
        rest_in = sympy.Integer(1)
        for d in source.shape[1:]:
            rest_in *= _expr(d)
        rest_out = sympy.Integer(1)
        for d in val.shape[1:]:
            rest_out *= _expr(d)
        per_sample = sympy.simplify(layout.inner * rest_in / rest_out)
        dim0 = _expr(val.shape[0])
        if per_sample.is_Integer and per_sample > 0 and \
                sympy.simplify(dim0 - layout.outer * symbol * per_sample) == 0:
            return RowLayout(layout.outer, int(per_sample))
        return Mixed(f"{_name(node)} reshapes dim 0 across samples "
                     f"({tuple(source.shape)} -> {tuple(val.shape)})")

    def slice(self, node, layout: RowLayout):
        x = node.args[0]
        ndim = len(_val(x).shape)
        dim = _norm(_arg(node, 1, "dim", 0), ndim)
        if dim != 0:
            return layout
        start, end = _arg(node, 2, "start", 0) or 0, _arg(node, 3, "end", None)
        step = _arg(node, 4, "step", 1)
        size = _dim0(layout, self.symbol)
        start = _expr(_val(start) if isinstance(start, fx.Node) else start)
        end = size if end is None else _expr(_val(end) if isinstance(end, fx.Node) else end)
        if isinstance(end, sympy.Integer) and int(end) >= 2 ** 62:
            end = size
        block = self.symbol * layout.inner
        first, last = sympy.simplify(start / block), sympy.simplify(end / block)
        if step == 1 and first.is_Integer and last.is_Integer and last > first:
            return RowLayout(int(last - first), layout.inner)
        return Mixed(f"{_name(node)} slices dim 0 inside a block of samples")

    def cat(self, node):
        tensors = list(node.args[0])
        ndim = len(_val(tensors[0]).shape)
        dim = _norm(_arg(node, 1, "dim", 0), ndim)
        layouts = [self.state.get(t) for t in tensors]
        if dim != 0:
            carrying = [lay for lay in layouts if lay is not None]
            if any(lay != carrying[0] for lay in carrying) or len(carrying) != len(layouts):
                return Mixed(f"{_name(node)} joins tensors of different row layouts")
            return carrying[0]
        if any(lay is None for lay in layouts):
            return Mixed(f"{_name(node)} adds rows that are not samples' to dim 0")
        inner = {lay.inner for lay in layouts}
        if len(inner) != 1:
            return Mixed(f"{_name(node)} joins blocks of different row counts")
        return RowLayout(sum(lay.outer for lay in layouts), inner.pop())


def _no_row_rule(node: fx.Node, x) -> str:
    """Why the row rule of an op that keeps dim 0 does not apply ("" when it does): an op is
    row by row only where a rule says so (a pointwise op, an op over dims that are not dim 0,
    an op that works on each dim-0 entry on its own); anything else (an unknown or custom op,
    an FFT or scan along dim 0) may combine samples' entries without changing a shape."""
    target = node.target
    if torch.Tag.pointwise in getattr(target, "tags", ()) or target in _PER_ENTRY:
        return ""
    if target in _OVER_DIMS or target in _ALONG_DIM:
        dims = _arg(node, 1, "dims", None) if target is aten.roll.default else ()
        if dims == [] or (target is not aten.roll.default and _touches_dim0(node, x)):
            return f"{_name(node)} works along dim 0, the batch"
        return ""
    if target is aten.constant_pad_nd.default:
        pad = _arg(node, 1, "pad", [])
        return f"{_name(node)} pads dim 0" if len(pad) // 2 >= _val(x).dim() else ""
    if target is aten.native_layer_norm.default:
        shape = _arg(node, 1, "normalized_shape", [])
        return f"{_name(node)} normalises over dim 0" if len(shape) >= _val(x).dim() else ""
    return (f"{_name(node)}: no row rule for this op (only ops known to work on each sample's "
            "entries apart are followed: an unknown op may combine samples)")


def _permutation(node: fx.Node) -> list[int]:
    """The source dim of each output dim of a permute, transpose or ``t``."""
    ndim = len(_val(node.args[0]).shape)
    if node.target is aten.permute.default:
        return [_norm(d, ndim) for d in node.args[1]]
    order = list(range(ndim))
    if node.target is aten.t.default:
        return order[::-1]
    a, b = (_norm(d, ndim) for d in node.args[1:3])
    order[a], order[b] = order[b], order[a]
    return order


def _static(size):
    """A size as an int when it is one, else its sympy expression."""
    expr = _expr(size)
    return int(expr) if expr.is_Integer else expr


def _dim0_of(val):
    return _expr(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else \
        sympy.Integer(1)


def _name(node: fx.Node) -> str:
    target = node.target
    label = str(target) if hasattr(target, "_schema") else getattr(target, "__name__", target)
    return f"{label} at {node.name}"


def find_row_layouts(gm: fx.GraphModule, batch_inputs: dict[int, int],
                     batch_symbol) -> dict[fx.Node, object]:
    """The layout of every node of ``gm`` (see the module docstring). ``batch_inputs`` maps the
    index of each batch-major placeholder to its rows per sample; ``batch_symbol`` is the sympy
    symbol of the batch size in the graph's shapes."""
    return _Analysis(gm, batch_inputs, batch_symbol).run()
