"""Reweight's vectorised backward of one graph (``RowBackward``): the batch-1 backward graph
made vmappable, traced under ``torch.func.vmap`` over a chunk of rows' saved tensors into one
aten graph per (number of rows, output, sizes), and compiled with the step's compiler. What
``Reweight`` (``reweight.py``) runs to take the per-row gradients of a rollout's trained call.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.fx as fx

from ..capture import StepGraphs, without_rng_wrappers
from ..passes.coalesced_sync import find_gradient_reductions, take_out_reductions
from ..runtime.accumulate import accumulating
from ..runtime.frameless import frameless
from ..runtime.reuse import rows_per_sample
from ..runtime.vmap_ops import dense_scatter_bases, unbatchable_collectives, vmap_friendly
from .graphs import SLICES, row_shape, saved_size
from .state import KeptCall

__all__ = ["RowBackward"]


class RowBackward:
    """The vectorised per-row backward of one graph, built once and compiled per chunk shape.

    ``defer_reductions``: the backward runs without its gradient reductions
    (``passes/coalesced_sync.py``; ``deferred_outputs`` are the gradients it then hands back
    full-size). ``compiler``: the step's (``inductor`` compiles, ``aot_eager`` runs the traced
    graph frameless)."""

    def __init__(self, graphs: StepGraphs, *, defer_reductions: bool, compiler: str):
        self.g = graphs
        self.defer_reductions = defer_reductions
        self.compiler = compiler
        self.deferred_outputs: set[int] = set()
        """Indices of the gradients handed back unreduced (``defer_reductions``; known once
        ``vmappable`` ran)."""
        self.inplace_matmuls = 0
        """Matmuls the accumulating graph adds into its buffers in place (the last one built)."""
        self._vmappable: fx.GraphModule | None = None
        self._unbatchable_reason: str | None = None
        self._exchanges: list[str] | None = None
        self._compiled: dict = {}
        """The compiled per-row backwards, by (number of rows, output, sizes, accumulating)."""
        self._unreduced: Callable | None = None

    def unreduced(self) -> Callable:
        """The backward graph without its gradient reductions, run as it is (frameless)."""
        if self._unreduced is None:
            self._unreduced = frameless(self.vmappable())
        return self._unreduced

    def exchange_groups(self) -> list[str]:
        """The groups of the all-to-alls in the vectorised backward (found once)."""
        if self._exchanges is None:
            target = torch.ops.leancompile.all_to_all_single.default
            self._exchanges = list(dict.fromkeys(
                n.args[3] for n in self.vmappable().graph.nodes
                if n.op == "call_function" and n.target is target))
        return self._exchanges

    def vmappable(self) -> fx.GraphModule:
        """The aten backward graph with slice ends of "to the end" (``2**63 - 1``, which
        vmap's batching rules overflow) spelled as None, and ops without a batching rule
        swapped for their twins with one (``runtime/vmap_ops.py``: attention's CPU backward,
        sequence parallelism's all-to-alls), and checkpointing's generator-state wrappers
        taken off ops that draw nothing (``capture/random_ops.py``)."""
        if self._vmappable is None:
            gm = copy.deepcopy(self.g.backward_aten)
            if self.defer_reductions:
                found = find_gradient_reductions(gm)
                stuck = [(n, why) for n, why in found.skipped if n not in found.compute]
                if stuck:
                    raise NotImplementedError(
                        "reweight with deferred gradient reductions: the backward graph holds "
                        "reductions that cannot be taken out of it: " + "; ".join(
                            f"{n}: {why}" for n, why in stuck))
                gm = take_out_reductions(gm, found)
                self.deferred_outputs = {i for site in found.sites for i in site.outputs}
            without_rng_wrappers(gm)  # (checkpointing's, around ops that draw nothing)
            vmap_friendly(gm)
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target in SLICES:
                    args = list(node.args)
                    end = SLICES[node.target]
                    if len(args) > end and isinstance(args[end], int) and args[end] >= 2 ** 62:
                        args[end] = None
                        node.args = tuple(args)
            gm.recompile()
            self._vmappable = gm
        return self._vmappable

    def unbatchable(self) -> str:
        """Why the vectorised backward cannot take this graph ("" if it can): collectives
        vmap has no rule for that would meet the rows' own saved tensors (they run once per
        row instead)."""
        if self._unbatchable_reason is None:
            layouts = self.g.layouts["saved"]
            batched = {n for n, k in enumerate(self.g.bw_saved)
                       if layouts[k] is not None and layouts[k] != "symint"}
            found = unbatchable_collectives(self.vmappable(), batched)
            self._unbatchable_reason = "" if not found else (
                "the backward's collectives " + ", ".join(found) + " have no batching rule")
        return self._unbatchable_reason

    def stacked_gradients(self, kept: KeptCall, rows: list[int], q: int, trainable: list,
                          into: dict | None = None) -> dict | None:
        """{parameter source: [len(rows), *shape] gradients of output ``q`` of each row}: the
        batch-1 backward graph under ``vmap`` over the rows' saved tensors (their row slices,
        stacked here), cotangent 1 on output ``q``; traced once per (number of rows, sizes,
        output) into one aten graph and compiled with the step's compiler (``_compile``).
        Which rows they are does not matter to the compiled graph: DanceGRPO's per-sample
        step subsets train other rows at every step. ``into``: {source: [len(rows), *shape]
        buffer}: the gradients are added into these in place and None is returned."""
        g = self.g
        layouts = g.layouts["saved"]
        per_row, shared = [], []
        index = None if rows == list(range(rows[0], rows[0] + len(rows))) else \
            torch.tensor(rows, device=kept.outputs[q].device)
        for k in g.bw_saved:
            layout = layouts[k]
            if layout is None:
                shared.append(kept.saved[k])
            elif layout != "symint":
                t = kept.saved[k]
                inner = rows_per_sample(layout.inner, [t], layout.outer, [kept.batch])
                blocks = t.reshape(layout.outer, kept.batch, inner, *t.shape[1:])
                blocks = blocks[:, rows[0]:rows[0] + len(rows)] if index is None else \
                    blocks.index_select(1, index)
                # Contiguous: the batch-1 graph views its saved tensors as AOTAutograd saved
                # them (several blocks per row come out strided otherwise).
                per_row.append(blocks.movedim(1, 0).reshape(
                    len(rows), layout.outer * inner, *t.shape[1:]).contiguous())
        symbols = {str(s): v for s, v in kept.symbols.items() if s != g.batch_symbol}
        key = (len(rows), q, tuple(sorted(symbols.items())), into is not None)
        run = self._compiled.get(key)
        if run is None:
            run = self._compile(kept, q, trainable, per_row + shared,
                                accumulate=into is not None)
            self._compiled[key] = run
        produced = self.produced(trainable)
        if into is not None:
            sources = dict(trainable)
            with torch.no_grad():
                run(per_row + shared + [into[sources[i]] for i in produced])
            return None
        with torch.no_grad():
            stacked = run(per_row + shared)
        by_index = dict(zip(produced, stacked))
        return {source: by_index.get(i) for i, source in trainable}

    def produced(self, trainable: list) -> list[int]:
        """Indices of the trainable inputs the backward graph gives a gradient for."""
        out = next(n for n in self.vmappable().graph.nodes if n.op == "output")
        return [i for i, _ in trainable if out.args[0][i] is not None]

    def _compile(self, kept: KeptCall, q: int, trainable: list, inputs: list, *,
                 accumulate: bool = False) -> Callable:
        """The per-row gradients of output ``q``, as one compiled function of the rows' stacked
        saved tensors (``[rows, *per-row shape]``, in the backward's order) and then the saved
        tensors every row shares.

        Before: the batch-1 backward graph ``bw(saved_1, ..., tangents) -> grads``. Traced here
        (``make_fx`` of ``vmap`` over dim 0 of the stacked tensors, with fake tensors) into one
        aten graph in which every op holds all the rows at once (``mm`` of a weight gradient
        becomes ``bmm``, attention folds the rows into its batch)::

            def rows_backward(stacked_0, ..., shared_0, ...):
                ...
                return (bmm(...), ...)          # [rows, *param.shape] each

        then compiled like the step's own graphs (``inductor``: ``compile_fx``; ``aot_eager``:
        run as traced), so Reweight's backward runs the same kernels as recompute's.
        ``accumulate`` (``aot_eager`` only): the graph takes one buffer per gradient after its
        inputs and adds into it in place (``runtime/accumulate.py``), returning nothing."""
        from torch.fx.experimental.proxy_tensor import make_fx

        g = self.g
        layouts = g.layouts["saved"]
        symbols = dict(kept.symbols)
        symbols[g.batch_symbol] = 1
        held = [k for k in g.bw_saved if layouts[k] != "symint" and layouts[k] is not None]
        shared = [k for k in g.bw_saved if layouts[k] is None]
        sizes = {k: saved_size(g, k, symbols) for k in g.bw_saved if layouts[k] == "symint"}
        tangent_shapes = [(row_shape(kept.outputs[j], g.layouts["outputs"][j], kept.batch),
                           kept.outputs[j].dtype, j == q) for j in g.differentiable]
        graph = self.vmappable()
        produced = self.produced(trainable)

        def rows_backward(*tensors):
            per_row, by_k = tensors[:len(held)], dict(zip(shared, tensors[len(held):]))
            tangents = [(torch.ones if one else torch.zeros)(shape, dtype=dtype,
                                                             device=tensors[0].device)
                        for shape, dtype, one in tangent_shapes]

            def one_row(*row_saved):
                it = iter(row_saved)
                values = [sizes[k] if k in sizes else by_k[k] if k in by_k else next(it)
                          for k in g.bw_saved]
                grads = graph(*values, *tangents)
                return tuple(grads[i] for i in produced)

            return torch.func.vmap(one_row)(*per_row)

        with torch.no_grad():
            traced = make_fx(rows_backward, tracing_mode="fake")(*inputs)
        if self.compiler == "aot_eager":
            if accumulate:
                traced, self.inplace_matmuls = accumulating(traced)
            run = frameless(traced)  # no Python frame per op (runtime/frameless.py)
            return lambda args: run(*args)
        from torch._inductor.compile_fx import compile_fx

        dense_scatter_bases(traced)
        with torch.no_grad():
            compiled = compile_fx(traced, list(inputs))
        return lambda args: compiled(*args)
