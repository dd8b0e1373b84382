"""Retain's regrouped rows: the saved tensors (and outputs) of an update batch gathered row by
row from the kept calls that computed them, laid out as the forward laid them out. ``Retain``
is a part of ``GraphRuntime`` (``runtime.py``)."""

from __future__ import annotations

import time

from ..runtime.reuse import gather_rows
from .graphs import as_traced, saved_size

__all__ = ["Retain"]


class Retain:
    """Gathering kept rows (``GraphRuntime`` methods; ``serve.py`` and ``reweight.py`` call
    them)."""

    def kept_runs(self, assignment):
        """Consecutive rows from one kept call, as (kept, [rows])."""
        runs = []
        for kept, row in assignment:
            if runs and runs[-1][0] is kept:
                runs[-1][1].append(row)
            else:
                runs.append((kept, [row]))
        return runs

    def gathered_saved(self, runs, total: int) -> list:
        """The saved values this graph's backward takes (``bw_saved`` order) for ``runs``
        (``kept_runs``) of ``total`` rows: each batch-major one gathered row by row from the
        kept calls, as traced; a size, for ``total`` rows; a batch-independent one, the first
        kept call's."""
        g = self.g
        start = time.perf_counter()
        layouts = g.layouts["saved"]
        first = runs[0][0]
        symbols = dict(first.symbols)
        if g.batch_symbol is not None:
            symbols[g.batch_symbol] = total
        values = []
        for k in g.bw_saved:
            layout = layouts[k]
            if layout == "symint":
                values.append(saved_size(g, k, symbols))
            elif layout is None:
                values.append(first.saved[k])
            else:
                tensor = gather_rows([(kept.saved[k], kept.batch, rows) for kept, rows in runs],
                                     layout.outer, layout.inner)
                tensor = as_traced(tensor, g.saved_meta[k], symbols)
                self.step._state.stats.gathered_bytes += tensor.numel() * tensor.element_size()
                values.append(tensor)
        self.step._state.stats.gather_seconds += time.perf_counter() - start
        return values

    def gather_output(self, j, runs):
        """Output ``j`` for ``runs`` (``kept_runs``): its rows gathered from the kept calls,
        or the first kept call's when it does not depend on the batch."""
        layout = self.g.layouts["outputs"][j]
        first = runs[0][0]
        if layout is None or layout == "symint":
            return first.outputs[j]
        return gather_rows([(kept.outputs[j], kept.batch, rows) for kept, rows in runs],
                           layout.outer, layout.inner)
