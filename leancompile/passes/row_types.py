"""The layouts a node of a forward graph can have in the row-layout analysis
(``row_layout.py``), and the arithmetic of sizes with the symbolic batch ``s`` they are read
from: ``None`` (no batch), ``RowLayout`` (rows of each sample apart), ``Uniform`` (a
batch-sized fill), ``Mixed`` (rows of samples meet, with the reason). ``Lifted``, the batch held
in dim 1 for a while, is in ``row_lifted.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

__all__ = ["RowLayout", "Uniform", "Mixed", "layout_of_shape", "size_in_batch", "has_symbol",
           "size_expr", "batch_dim0", "static_size", "dim0_of", "row_count"]


@dataclass(frozen=True)
class RowLayout:
    """dim 0 = ``outer * s * inner``; sample r's entries at ``(o * s + r) * inner + i``.
    ``inner`` is an int, or a product of other sizes where those are dynamic too
    (``torch.compile(dynamic=True)``: a ``[B, L, D]`` activation flattened to ``[B*L, D]`` for
    a matmul has ``L`` rows per sample); the runtime reads such a count off each tensor
    (``runtime.reuse.rows_per_sample``)."""

    outer: int
    inner: int | sympy.Expr

    def __str__(self) -> str:
        if self.outer == 1:
            return "one row per sample" if self.inner == 1 else f"{self.inner} rows per sample"
        return f"{self.outer} blocks of {self.inner} row(s) per sample"


@dataclass(frozen=True)
class Uniform(RowLayout):
    """A batch-sized tensor made from no batch input (``empty``, ``zeros``, an expand): every
    row holds the same (or nothing yet), so it fits whatever row layout it meets."""


@dataclass(frozen=True)
class Mixed:
    """Rows of different samples meet, or the batch leaves dim 0; ``reason`` says where."""

    reason: str



def has_symbol(expr, symbol) -> bool:
    if isinstance(expr, torch.SymInt):
        expr = expr.node.expr
    return isinstance(expr, sympy.Basic) and symbol in expr.free_symbols


def size_expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def layout_of_shape(shape, symbol) -> RowLayout | Mixed | None:
    """The row count per sample of a shape alone: ``None`` without ``s``; ``RowLayout(1, k)``
    when dim 0 is ``k*s`` and no other dim holds ``s``; ``Mixed`` otherwise."""
    if not any(has_symbol(d, symbol) for d in shape):
        return None
    if any(has_symbol(d, symbol) for d in shape[1:]):
        return Mixed(f"the batch is outside dim 0 (shape {tuple(shape)})")
    ratio = row_count(size_expr(shape[0]) / symbol, symbol)
    if ratio is None:
        return Mixed(f"dim 0 is {shape[0]}, not a multiple of the batch size")
    return RowLayout(1, ratio)


def row_count(expr, symbol):
    """``expr`` as a count of rows (per sample, or of blocks): an int when it is a positive
    one; a product of other sizes (positive integer symbols) times a positive int, where those
    sizes are dynamic; None otherwise (it holds the batch symbol, or may not be a positive
    whole number: ``s1/2``, ``s1 - 1``)."""
    expr = sympy.simplify(expr)
    if expr.is_Integer:
        return int(expr) if expr > 0 else None
    if symbol in expr.free_symbols:
        return None
    coeff, rest = expr.as_coeff_Mul()
    if not (coeff.is_Integer and coeff > 0):
        return None
    for factor in sympy.Mul.make_args(rest):
        base, exp = factor.as_base_exp()
        if not (base.is_Symbol and base.is_integer and base.is_positive and exp.is_Integer
                and exp > 0):
            return None
    return expr


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


def batch_dim0(layout: RowLayout, symbol):
    return layout.outer * symbol * layout.inner




def static_size(size):
    """A size as an int when it is one, else its sympy expression."""
    expr = size_expr(size)
    return int(expr) if expr.is_Integer else expr


def dim0_of(val):
    return size_expr(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else \
        sympy.Integer(1)
