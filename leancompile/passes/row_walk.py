"""The walk of the row-layout analysis (``row_layout.py``): every node of a forward graph
traced with a symbolic batch gets its layout from its inputs' and its op's rule
(``row_rules.py``; a tensor with the batch in dim 1: ``row_lifted.py``).

An op that activation checkpointing recomputes in the backward and that carries a random-number
tag is wrapped by the partitioner; the wrapper is followed as the op it calls, its first output
(the generator's state) holding no batch::

    run_and_save_rng_state = run_and_save_rng_state(aten._scaled_dot_product_flash_attention,
                                                    permute_1, permute_3, permute_5)
    getitem_2 = run_and_save_rng_state[0]    # the generator's state: None
    getitem_3 = run_and_save_rng_state[1]    # the attention's outputs: as the op's rule says
    getitem = getitem_3[0]                   #   one row per sample

A node the walk cannot see into (no traced value, or an output nested in a tuple that no rule
reads) is ``Mixed`` when a batch-carrying tensor goes in: not knowing where the rows went is
never taken for "no batch".
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ..runtime.fx_values import node_val
from .aten_ops import RESHAPES, TRANSPOSES, node_arg, norm_dim, rng_wrapped
from .row_groups import collective_ops, is_collective
from .row_lifted import Lifted, lifted_layout
from .row_rules import (ALONG_DIM, BATCH_MIXING, FILLS, LOOKUPS, MATMULS, SIZE_TYPE, no_row_rule,
                        op_label, permutation, touches_dim0)
from .row_types import (Mixed, RowLayout, Uniform, batch_dim0, dim0_of, has_symbol,
                        layout_of_shape, row_count, size_expr, static_size)

__all__ = ["find_row_layouts"]

aten = torch.ops.aten
RNG_WRAPPER = torch.ops.higher_order.run_and_save_rng_state


def _batch_taken_out(node: fx.Node, val: torch.Tensor) -> str:
    """What an op whose output has no batch left did to the batch dim (its input's dim 0), in
    words: picked rows out of it (``x[0]``, ``x[:2]``, ``x[idx]``: every row's output would be
    those rows') or reduced over it."""
    if node.target is aten.index.Tensor:
        picked = node.args[1][0] is not None
    else:
        picked = node.target in (aten.select.int, aten.slice.Tensor,
                                 aten.index_select.default) and touches_dim0(node, node.args[0])
    if not picked:
        return "reduces over the batch"
    if node.target is aten.select.int:
        return f"picks row {node.args[2]} of the batch"
    n = static_size(val.shape[0]) if val.dim() else 1
    return f"picks {n} fixed row{'s' * (n != 1)} of the batch"


class _Analysis:
    """The walk over a graph's nodes in order, each given its layout from its inputs'."""

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
            if isinstance(layout, Lifted):
                self.state[node] = Mixed(f"{op_label(node)}: the batch is outside dim 0 (shape "
                                         f"{tuple(node_val(node).shape)})")
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
            return Mixed(f"{op_label(node)} reads the batch size ({sized}) as a value: its result "
                         "differs with the number of rows a call has")
        val = node_val(node)
        lifted = [a for a, lay in zip(inputs, layouts) if isinstance(lay, Lifted)]
        if lifted:
            return lifted_layout(node, lifted[0], sum(isinstance(node_val(a), torch.Tensor)
                                                      for a in inputs),
                                  self.state, self.symbol)
        if node.target is aten.unsqueeze.default and isinstance(val, torch.Tensor) and \
                layouts and isinstance(layouts[0], RowLayout) and \
                norm_dim(node.args[1], val.dim()) == 0:
            return Lifted(1, layouts[0])
        if node.target in TRANSPOSES and layouts and isinstance(layouts[0], RowLayout):
            order = permutation(node)
            if len(order) > 1 and order[1] == 0 and not has_symbol(val.shape[0], self.symbol) and \
                    not any(has_symbol(d, self.symbol) for d in val.shape[2:]):
                return Lifted(static_size(val.shape[0]), layouts[0])
        if node.target is operator.getitem:
            source = self.state.get(node.args[0])
            if isinstance(source, tuple):
                return source[node.args[1]]
            return source
        carrying = [a for a, lay in zip(inputs, layouts) if isinstance(lay, (RowLayout, tuple))]
        if node.target is RNG_WRAPPER:
            return self.wrapped(node)
        if val is None and carrying:
            return Mixed(f"{op_label(node)}: no traced value to follow the batch through")
        if isinstance(val, (tuple, list)):
            return self.multi(node, carrying, val)
        if not isinstance(val, torch.Tensor):
            return None
        shaped = layout_of_shape(val.shape, self.symbol)
        if not carrying:
            if shaped is None:
                return None
            if node.target in FILLS:
                return Uniform(shaped.outer, shaped.inner) if isinstance(shaped, RowLayout) \
                    else shaped
            return Mixed(f"{op_label(node)} makes a batch-sized tensor from no batch input")
        if isinstance(shaped, Mixed):
            return Mixed(f"{op_label(node)}: {shaped.reason}")
        if shaped is None:
            return Mixed(f"{op_label(node)} {_batch_taken_out(node, val)} (output shape "
                         f"{tuple(val.shape)})")
        if is_collective(node.target) and node.target not in collective_ops()[1]:
            # Over dim 0 with the batch in it, pieces of dim 0 are rows: an exchange moves
            # another rank's rows into this one's (a reduction adds them).
            return Mixed(f"{op_label(node)}: a collective over the batch dim")
        return self.single(node, carrying, shaped, val)

    def wrapped(self, node):
        """``run_and_save_rng_state(op, *args)``: (the generator's state, ``op(*args)``), the
        second laid out as ``op``'s rule says, on a stand-in node of ``op`` that carries the
        value the partitioner put on ``getitem(node, 1)``."""
        op, args = rng_wrapped(node)
        value = next((node_val(u) for u in node.users
                      if u.target is operator.getitem and u.args[1] == 1), None)
        if op is None or value is None:
            return Mixed(f"{op_label(node)}: a wrapped op this analysis cannot see")
        scratch = fx.Graph()
        stand_in = scratch.create_node("call_function", op, args, dict(node.kwargs),
                                       name=node.name)
        stand_in.meta["val"] = value
        try:  # (the stand-in is a user of the real inputs until it is erased)
            layout = self.visit(stand_in)
        finally:
            scratch.erase_node(stand_in)
        return (None, layout)

    def batch_size_as_value(self, node):
        """The batch-dependent size an op takes as a value (a scalar operand, a fill value:
        ``h * x.shape[0]``), not as a size (a view's shape, a slice's bounds); else None."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or self.symbol is None:
            return None
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if not isinstance(value, fx.Node) or SIZE_TYPE.match(str(arg.type)):
                continue
            v = node_val(value)
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
            return Mixed(f"{op_label(node)} makes batch-sized tensors from no batch input")
        target = node.target
        if target in (aten.split.Tensor, aten.split_with_sizes.default,
                      aten.unbind.int, aten.chunk.default):
            return self.split(node, carrying, vals)
        if target in BATCH_MIXING or (target in ALONG_DIM and touches_dim0(node, carrying[0])):
            return Mixed(f"{op_label(node)} combines entries along the batch dim")
        unknown = no_row_rule(node, carrying[0])
        if unknown:
            return Mixed(unknown)
        base = self.state[carrying[0]]
        out = []
        for v in vals:
            if isinstance(v, (tuple, list)):  # read by nothing this walk follows
                out.append(Mixed(f"{op_label(node)}: an output nested in a tuple"))
                continue
            if not isinstance(v, torch.Tensor):
                out.append(None)
                continue
            shaped = layout_of_shape(v.shape, self.symbol)
            if shaped is None:
                out.append(Mixed(f"{op_label(node)} reduces over the batch"))
            elif isinstance(shaped, Mixed) or dim0_of(v) != batch_dim0(base, self.symbol):
                out.append(Mixed(f"{op_label(node)} changes dim 0 ({dim0_of(v)})")
                           if not isinstance(shaped, Mixed) else shaped)
            else:
                out.append(base)
        return tuple(out)

    def split(self, node, carrying, vals):
        x = node.args[0]
        layout = self.state[x]
        dim = norm_dim(node_arg(node, 2, "dim", 0) if node.target is not aten.unbind.int
                    else node_arg(node, 1, "dim", 0), len(node_val(x).shape))
        if dim != 0:
            return tuple(layout for _ in vals)
        block = self.symbol * layout.inner
        out, start = [], sympy.Integer(0)
        for v in vals:
            size = size_expr(v.shape[0]) if v.dim() else sympy.Integer(1)
            first = sympy.simplify(start / block)
            count = sympy.simplify(size / block)
            start = start + size
            if first.is_Integer and count.is_Integer and count > 0:
                out.append(RowLayout(int(count), layout.inner))
            else:
                out.append(Mixed(f"{op_label(node)} splits dim 0 inside a block of samples"))
        return tuple(out)

    def single(self, node, carrying, shaped: RowLayout, val):
        target = node.target
        symbol = self.symbol
        first = self.state[carrying[0]]
        if target in BATCH_MIXING:
            return Mixed(f"{op_label(node)} combines entries along the batch dim")
        if target in LOOKUPS:
            return self.lookup(node, val)
        if target in ALONG_DIM and touches_dim0(node, carrying[0]):
            return Mixed(f"{op_label(node)} works along dim 0, the batch")
        if target in RESHAPES:
            return self.reshape(node, first, val)
        if target in TRANSPOSES:
            moved = permutation(node)[0] != 0
            return Mixed(f"{op_label(node)} moves the batch out of dim 0") if moved else first
        if target is aten.slice.Tensor:
            return self.slice(node, first)
        if target is aten.cat.default:
            return self.cat(node)
        if target in MATMULS:
            a_index, b_index = MATMULS[target]
            a, b = node.args[a_index], node.args[b_index]
            a_layout, b_layout = self.state.get(a), self.state.get(b)
            if target in (aten.mm.default, aten.addmm.default) and b_layout is not None:
                return Mixed(f"{op_label(node)}: the batch is in the weight operand")
            if target is aten.addmm.default and self.state.get(node.args[0]) is not None:
                return Mixed(f"{op_label(node)}: a batch-dependent bias")
            if target in (aten.bmm.default, aten.baddbmm.default) and b_layout is not None \
                    and b_layout != a_layout:
                return Mixed(f"{op_label(node)}: operands with different row layouts")
            if a_layout is None:
                return Mixed(f"{op_label(node)}: the batch is in the weight operand")
            return a_layout
        if target in (aten.expand.default,):
            return first if dim0_of(val) == batch_dim0(first, symbol) else \
                Mixed(f"{op_label(node)} expands dim 0")
        # Any other op with a row rule (an allowlist: pointwise ops, reductions and
        # normalisations over other dims, per-entry ops such as attention): dim 0 kept as it
        # is, every batch-carrying input in one layout (a Uniform input fits any).
        unknown = no_row_rule(node, carrying[0])
        if unknown:
            return Mixed(unknown)
        dim0 = dim0_of(val)
        first = next((self.state[a] for a in carrying
                      if not isinstance(self.state[a], Uniform)), first)
        for arg in carrying:
            lay = self.state[arg]
            arg_dim0 = dim0_of(node_val(arg))
            if sympy.simplify(arg_dim0 - dim0) != 0:
                if sympy.simplify(arg_dim0 - 1) == 0:  # broadcast from a size-1 dim 0
                    continue
                return Mixed(f"{op_label(node)} changes dim 0 from {arg_dim0} to {dim0}")
            if lay != first and not isinstance(lay, Uniform):
                return Mixed(f"{op_label(node)} combines tensors with different row layouts "
                             f"({first} and {lay})")
        return first

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
            ndim = len(node_val(source).shape)
            dim = norm_dim(dim, ndim)
            indices = [index] if dim == 0 else [None] * dim + [index]
        else:  # aten.index.Tensor
            source, indices = node.args[0], list(node.args[1])
        src = self.state.get(source)
        idx = [self.state.get(i) if isinstance(i, fx.Node) else None for i in indices]
        if src is None and indices and indices[0] is not None and isinstance(idx[0], RowLayout) \
                and all(i is None for i in indices[1:]):
            return idx[0] if dim0_of(val) == dim0_of(node_val(indices[0])) else \
                Mixed(f"{op_label(node)} indexes with a multi-dim batch index")
        if isinstance(src, RowLayout) and (not indices or indices[0] is None) and \
                all(lay is None for lay in idx) and dim0_of(val) == dim0_of(node_val(source)):
            return src
        return Mixed(f"{op_label(node)} indexes along the batch dim")

    def reshape(self, node, layout: RowLayout, val):
        source = node_val(node.args[0])
        symbol = self.symbol
        rest_in = sympy.Integer(1)
        for d in source.shape[1:]:
            rest_in *= size_expr(d)
        rest_out = sympy.Integer(1)
        for d in val.shape[1:]:
            rest_out *= size_expr(d)
        per_sample = row_count(layout.inner * rest_in / rest_out, symbol)
        dim0 = size_expr(val.shape[0])
        if per_sample is not None and \
                sympy.simplify(dim0 - layout.outer * symbol * per_sample) == 0:
            return RowLayout(layout.outer, per_sample)
        return Mixed(f"{op_label(node)} reshapes dim 0 across samples "
                     f"({tuple(source.shape)} -> {tuple(val.shape)})")

    def slice(self, node, layout: RowLayout):
        x = node.args[0]
        ndim = len(node_val(x).shape)
        dim = norm_dim(node_arg(node, 1, "dim", 0), ndim)
        if dim != 0:
            return layout
        start, end = node_arg(node, 2, "start", 0) or 0, node_arg(node, 3, "end", None)
        step = node_arg(node, 4, "step", 1)
        size = batch_dim0(layout, self.symbol)
        start = size_expr(node_val(start) if isinstance(start, fx.Node) else start)
        end = size if end is None else size_expr(node_val(end) if isinstance(end, fx.Node) else end)
        if isinstance(end, sympy.Integer) and int(end) >= 2 ** 62:
            end = size
        block = self.symbol * layout.inner
        first, last = sympy.simplify(start / block), sympy.simplify(end / block)
        if step == 1 and first.is_Integer and last.is_Integer and last > first:
            return RowLayout(int(last - first), layout.inner)
        return Mixed(f"{op_label(node)} slices dim 0 inside a block of samples")

    def cat(self, node):
        tensors = list(node.args[0])
        ndim = len(node_val(tensors[0]).shape)
        dim = norm_dim(node_arg(node, 1, "dim", 0), ndim)
        layouts = [self.state.get(t) for t in tensors]
        if dim != 0:
            carrying = [lay for lay in layouts if lay is not None]
            if any(lay != carrying[0] for lay in carrying) or len(carrying) != len(layouts):
                return Mixed(f"{op_label(node)} joins tensors of different row layouts")
            return carrying[0]
        if any(lay is None for lay in layouts):
            return Mixed(f"{op_label(node)} adds rows that are not samples' to dim 0")
        inner = {lay.inner for lay in layouts}
        if len(inner) != 1:
            return Mixed(f"{op_label(node)} joins blocks of different row counts")
        return RowLayout(sum(lay.outer for lay in layouts), inner.pop())


def find_row_layouts(gm: fx.GraphModule, batch_inputs: dict[int, int],
                     batch_symbol) -> dict[fx.Node, object]:
    """The layout of every node of ``gm`` (see the module docstring). ``batch_inputs`` maps the
    index of each batch-major placeholder to its rows per sample; ``batch_symbol`` is the sympy
    symbol of the batch size in the graph's shapes."""
    return _Analysis(gm, batch_inputs, batch_symbol).run()
