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

The analysis in modules: the layouts (``row_types.py``), the op rules (``row_rules.py``), the
groups whose collectives keep rows (``row_groups.py``), the batch held in dim 1
(``row_lifted.py``), the walk over the graph (``row_walk.py``). This module is their entry.
"""

from __future__ import annotations

from .row_groups import declare_same_rows, forget_same_rows, same_rows_groups
from .row_types import Mixed, RowLayout, layout_of_shape, size_in_batch
from .row_walk import find_row_layouts

__all__ = ["RowLayout", "Mixed", "find_row_layouts", "layout_of_shape", "declare_same_rows",
           "forget_same_rows", "same_rows_groups", "size_in_batch"]
