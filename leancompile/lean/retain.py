"""Retain's regrouped rows: the saved tensors (and outputs) of an update batch gathered row by
row from the kept calls that computed them, laid out as the forward laid them out. ``Retain``
is a part of ``GraphRuntime`` (``runtime.py``)."""

from __future__ import annotations

import time

import torch

from ..runtime.reuse import RowGather
from .graphs import restrided, saved_size, traced_stride

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

    def row_gather(self, runs) -> tuple[list, RowGather]:
        """The distinct kept calls of ``runs`` (``kept_runs``), in order of first use, and the
        gather of the update's rows from them (one plan for every tensor of the call)."""
        sources: list = []
        position: dict[int, int] = {}
        pieces = []
        for kept, rows in runs:
            if id(kept) not in position:
                position[id(kept)] = len(sources)
                sources.append(kept)
            pieces.append((position[id(kept)], rows))
        return sources, RowGather([kept.batch for kept in sources], pieces)

    def gathered_saved(self, runs, total: int) -> list:
        """The saved values this graph's backward takes (``bw_saved`` order) for ``runs``
        (``kept_runs``) of ``total`` rows: each batch-major one gathered row by row from the
        kept calls, as traced; a size, for ``total`` rows; a batch-independent one, the first
        kept call's."""
        g = self.g
        start = time.perf_counter()
        layouts = g.layouts["saved"]
        sources, plan = self.row_gather(runs)
        first = sources[0]
        symbols = dict(first.symbols)
        if g.batch_symbol is not None:
            symbols[g.batch_symbol] = total
        at = self.saved_at(symbols)
        values = []
        gathered = 0
        for k in g.bw_saved:
            layout = layouts[k]
            if layout == "symint":
                values.append(at[k])
            elif layout is None:
                values.append(first.saved[k])
            else:
                tensor = plan([kept.saved[k] for kept in sources], layout.outer, layout.inner)
                if at[k] is not None:
                    tensor = restrided(tensor, at[k])
                gathered += tensor.numel() * tensor.element_size()
                values.append(tensor)
        state = self.step._state
        seconds = time.perf_counter() - start
        state.stats.gathered_bytes += gathered
        state.stats.gather_seconds += seconds
        state.ledger.gather_seconds += seconds
        return values

    def saved_at(self, symbols: dict) -> dict:
        """Per saved value at the sizes ``symbols``: a size's value, a batch-major tensor's
        traced strides (``as_traced``), made once per sizes (sympy's substitution costs more
        than the gather of a small tensor)."""
        key = tuple(sorted(symbols.items(), key=lambda item: str(item[0])))
        at = self.saved_at_sizes.get(key)
        if at is None:
            g, at = self.g, {}
            for k, layout in enumerate(g.layouts["saved"]):
                if layout == "symint":
                    at[k] = saved_size(g, k, symbols)
                elif layout is not None:
                    meta = g.saved_meta[k]
                    at[k] = traced_stride(meta, symbols) if isinstance(meta, torch.Tensor) \
                        else None
            self.saved_at_sizes[key] = at
        return at

    def gather_output(self, j, runs):
        """Output ``j`` for ``runs`` (``kept_runs``): its rows gathered from the kept calls,
        or the first kept call's when it does not depend on the batch."""
        layout = self.g.layouts["outputs"][j]
        sources, plan = self.row_gather(runs)
        if layout is None or layout == "symint":
            return sources[0].outputs[j]
        return plan([kept.outputs[j] for kept in sources], layout.outer, layout.inner)
