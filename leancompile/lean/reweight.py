"""Reweight's per-row gradients: taken in the rollout (one vectorised backward per chunk of
rows, ``torch.func.vmap`` of the batch-1 backward, compiled like the step's own graphs), kept
per row or summed per sample, and weighted by the update's cotangents. ``Reweight`` is a part
of ``GraphRuntime`` (``runtime.py``)."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.fx as fx
from torch import Tensor

from ..passes.coalesced_sync import find_gradient_reductions, take_out_reductions
from ..passes.lean_grpo import reweight_rows_per_backward
from ..runtime.accumulate import accumulating
from ..runtime.frameless import frameless
from ..runtime.vmap_ops import (agree_min, dense_scatter_bases, unbatchable_collectives,
                                vmap_friendly)
from .graphs import SLICES, row_shape, saved_size
from .state import KeptCall

__all__ = ["Reweight"]


class Reweight:
    """Per-row gradients (``GraphRuntime`` methods)."""

    def _row_gradients(self, kept: KeptCall, saved: list) -> None:
        """Reweight: the gradient of every per-row scalar output of every trained row, each on
        its own. Batched when the LeanGRPO stage proved the saved tensors hold rows apart: the
        batch-1 backward graph runs under ``torch.func.vmap`` over the rows' own saved state
        (``rows_per_backward`` rows at a time, from the memory budget), one vectorised backward
        instead of one per row; otherwise one backward of the whole call per row, with a
        one-hot cotangent."""
        g, batch = self.g, kept.batch
        outputs = kept.outputs
        scalars = self.scalar_outputs(outputs, batch)
        trainable = [(i, g.roles[i].source) for i in self.params if kept.args[i].requires_grad]
        state = self.step._state
        out_layouts = g.layouts.get("outputs") or []
        batched = bool(g.layouts.get("row_local")) and g.batch_symbol is not None and \
            g.backward_aten is not None and len(kept.rows) > 1 and all(
                j < len(out_layouts) and (out_layouts[j] is None or hasattr(out_layouts[j],
                                                                            "outer"))
                for j in g.differentiable)
        backward = self._unreduced_backward if self.step.config.defer_reductions else \
            self._backward
        if batched and self._unbatchable():
            batched = False
            state.stats.reweight_unbatched = self._unbatchable()
        if batched:
            chunk = self.rows_per_backward(kept)
            for start in range(0, len(kept.rows), chunk):
                rows = kept.rows[start:start + chunk]
                for q in scalars:
                    if self._accumulate_rows(kept, rows, q, trainable):
                        continue
                    stacked = self._vmapped_row_gradients(kept, rows, q, trainable)
                    if self._new_block(kept, rows, q, stacked):
                        continue
                    for n, row in enumerate(rows):
                        self._keep_row_grads(kept, row, q, {
                            source: None if t is None else t[n] for source, t in
                            stacked.items()})
                state.stats.reweight_backwards += 1
                state.stats.reweight_rows_per_backward = max(
                    state.stats.reweight_rows_per_backward, len(rows))
        else:
            gather = bool(g.layouts.get("row_local")) and g.batch_symbol is not None and \
                batch > 1
            for row in kept.rows:
                if gather:
                    bw_saved, row_outputs = self._gathered_saved([(kept, [row])], 1), \
                        [self._gather_output(j, [(kept, [row])]) for j in range(g.num_outputs)]
                else:
                    bw_saved, row_outputs = [saved[k] for k in g.bw_saved], outputs
                for q in scalars:
                    cotangents = [None] * g.num_outputs
                    one = torch.zeros_like(row_outputs[q])
                    one.reshape(-1)[0 if gather else row] = 1
                    cotangents[q] = one
                    grads = backward(bw_saved, row_outputs, cotangents)
                    self._keep_row_grads(kept, row, q, {source: grads[i]
                                                        for i, source in trainable})
                state.stats.reweight_backwards += 1
                state.stats.reweight_rows_per_backward = max(
                    state.stats.reweight_rows_per_backward, 1)
        if kept.samples is not None:
            for row in kept.rows:
                state.sample_rows[kept.samples[row]] += 1
            kept.grads["scalars"] = scalars

    def _chunk_samples(self, kept: KeptCall, rows: list[int]) -> tuple | None:
        """The samples of ``rows`` when the rollout named them, each once; else None."""
        if kept.samples is None:
            return None
        samples = tuple(kept.samples[r] for r in rows)
        return samples if len(set(samples)) == len(samples) else None

    def _new_block(self, kept: KeptCall, rows: list[int], q: int, stacked: dict) -> bool:
        """The first trained step of samples none of which has a buffer yet: their buffers
        become slices of one ``[rows, *shape]`` block per parameter (a contiguous copy of the
        vectorised gradients: vmap may hand a row-independent gradient back as a stride-0
        expand), so later steps of the same samples accumulate into the whole block at once
        (``_accumulate_rows``). False (nothing done) otherwise."""
        state = self.step._state
        samples = self._chunk_samples(kept, rows)
        if samples is None or any((s, q) in state.sample_grads for s in samples):
            return False
        block = {source: t.clone(memory_format=torch.contiguous_format)
                 for source, t in stacked.items() if t is not None}
        for n, s in enumerate(samples):
            state.sample_grads[(s, q)] = {source: b[n] for source, b in block.items()}
        state.sample_blocks[(samples, q)] = block
        return True

    def _accumulate_rows(self, kept: KeptCall, rows: list[int], q: int, trainable: list) -> bool:
        """Later steps of samples whose buffers are one block (``_new_block``): the vectorised
        backward adds into the block in place (``aot_eager``: the graph itself, matmuls as
        ``baddbmm_``, ``runtime/accumulate.py``; ``inductor``: one ``_foreach_add_`` of the
        compiled graph's output). False (nothing done) when the rows' samples are not exactly
        one block's."""
        state = self.step._state
        samples = self._chunk_samples(kept, rows)
        block = None if samples is None else state.sample_blocks.get((samples, q))
        if block is None:
            return False
        if self.step.options.compiler == "aot_eager":
            self._vmapped_row_gradients(kept, rows, q, trainable, into=block)
        else:
            stacked = self._vmapped_row_gradients(kept, rows, q, trainable)
            pairs = [(block[source], t) for source, t in stacked.items()
                     if t is not None and source in block]
            if len(pairs) != len(block):
                return False
            torch._foreach_add_([b for b, _ in pairs], [t for _, t in pairs])
        state.stats.reweight_fused_steps += 1
        state.stats.reweight_inplace_matmuls = self._inplace_matmuls
        return True

    def _unreduced_backward(self, bw_saved, outputs, cotangents) -> list:
        """``defer_reductions``, one row at a time: the backward graph without its gradient
        reductions (``_vmappable_backward``), run as it is (aot_eager's way, also under
        Inductor: this path is for calls the vectorised backward cannot take)."""
        if self._unreduced is None:
            self._unreduced = frameless(self._vmappable_backward())
        tangents = self._tangents(outputs, cotangents)
        with torch.no_grad():
            return list(self._unreduced(*bw_saved, *tangents))

    def _keep_row_grads(self, kept: KeptCall, row: int, q: int, row_grads: dict) -> None:
        if kept.samples is None:
            kept.grads[(row, q)] = row_grads
            return
        # One buffer per sample: its rows' gradients summed (the paper's G_i).
        merged = self.step._state.sample_grads.setdefault((kept.samples[row], q), {})
        new = [(source, gr) for source, gr in row_grads.items()
               if gr is not None and source not in merged]
        old = [(merged[source], gr) for source, gr in row_grads.items()
               if gr is not None and source in merged]
        if old:  # in place, one call for all parameters
            torch._foreach_add_([m for m, _ in old], [gr for _, gr in old])
        for source, gr in new:
            merged[source] = gr.clone()

    def row_grad_bytes(self, args) -> int:
        """Bytes of one row's gradient of one scalar output (the trainable parameters; with
        ``defer_reductions``, the full-size gradients the backward hands back unreduced,
        larger than the sharded inputs)."""
        sizes = {i: args[i].numel() * args[i].element_size() for i in self.params
                 if args[i].requires_grad}
        if self.step.config.defer_reductions and self.g.backward_aten is not None:
            out = next(n for n in self._vmappable_backward().graph.nodes if n.op == "output")
            for i in sizes:
                val = getattr(out.args[0][i], "meta", {}).get("val")
                if isinstance(val, Tensor) and i in self._deferred_outputs:
                    sizes[i] = val.numel() * val.element_size()
        return sum(sizes.values())

    def rows_per_backward(self, kept: KeptCall) -> int:
        """Reweight: how many rows one vectorised backward takes (``reweight_rows``, else from
        what the memory budget leaves; ``passes.lean_grpo.reweight_rows_per_backward``)."""
        state = self.step._state
        rows = reweight_rows_per_backward(
            rows=len(kept.rows), grad_bytes=self.row_grad_bytes(kept.args),
            row_saved_bytes=self.g.kept_bytes(1), requested=self.step.config.reweight_rows,
            room_bytes=state.budget - state.kept_bytes - state.buffer_bytes - state.held_bytes)
        # The vectorised backward's all-to-alls carry `rows` rows: every rank of their group
        # must take the same number (each computed it from its own memory).
        for group in self._exchange_groups():
            rows = agree_min(rows, group, kept.outputs[0].device)
        return rows

    def _exchange_groups(self) -> list[str]:
        """The groups of the all-to-alls in the vectorised backward (found once)."""
        if self._exchanges is None:
            target = torch.ops.leancompile.all_to_all_single.default
            self._exchanges = list(dict.fromkeys(
                n.args[3] for n in self._vmappable_backward().graph.nodes
                if n.op == "call_function" and n.target is target))
        return self._exchanges

    def _vmappable_backward(self) -> fx.GraphModule:
        """The aten backward graph with slice ends of "to the end" (``2**63 - 1``, which
        vmap's batching rules overflow) spelled as None, and ops without a batching rule
        swapped for their twins with one (``runtime/vmap_ops.py``: attention's CPU backward,
        sequence parallelism's all-to-alls)."""
        if self._vmap_backward is None:
            gm = copy.deepcopy(self.g.backward_aten)
            if self.step.config.defer_reductions:
                found = find_gradient_reductions(gm)
                stuck = [(n, why) for n, why in found.skipped if n not in found.compute]
                if stuck:
                    raise NotImplementedError(
                        "reweight with deferred gradient reductions: the backward graph holds "
                        "reductions that cannot be taken out of it: " + "; ".join(
                            f"{n}: {why}" for n, why in stuck))
                gm = take_out_reductions(gm, found)
                self._deferred_outputs = {i for site in found.sites for i in site.outputs}
            vmap_friendly(gm)
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target in SLICES:
                    args = list(node.args)
                    end = SLICES[node.target]
                    if len(args) > end and isinstance(args[end], int) and args[end] >= 2 ** 62:
                        args[end] = None
                        node.args = tuple(args)
            gm.recompile()
            self._vmap_backward = gm
        return self._vmap_backward

    def _unbatchable(self) -> str:
        """Why the vectorised backward cannot take this graph ("" if it can): collectives
        vmap has no rule for that would meet the rows' own saved tensors (they run once per
        row instead)."""
        if self._unbatchable_reason is None:
            layouts = self.g.layouts["saved"]
            batched = {n for n, k in enumerate(self.g.bw_saved)
                       if layouts[k] is not None and layouts[k] != "symint"}
            found = unbatchable_collectives(self._vmappable_backward(), batched)
            self._unbatchable_reason = "" if not found else (
                "the backward's collectives " + ", ".join(found) + " have no batching rule")
        return self._unbatchable_reason

    def _vmapped_row_gradients(self, kept: KeptCall, rows: list[int], q: int,
                               trainable: list, into: dict | None = None) -> dict | None:
        """{parameter source: [len(rows), *shape] gradients of output ``q`` of each row}: the
        batch-1 backward graph under ``vmap`` over the rows' saved tensors (their row slices,
        stacked here), cotangent 1 on output ``q``; traced once per (number of rows, sizes,
        output) into one aten graph and compiled with the step's compiler (``_row_backward``).
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
                blocks = t.reshape(layout.outer, kept.batch, layout.inner, *t.shape[1:])
                blocks = blocks[:, rows[0]:rows[0] + len(rows)] if index is None else \
                    blocks.index_select(1, index)
                # Contiguous: the batch-1 graph views its saved tensors as AOTAutograd saved
                # them (several blocks per row come out strided otherwise).
                per_row.append(blocks.movedim(1, 0).reshape(
                    len(rows), layout.outer * layout.inner, *t.shape[1:]).contiguous())
        symbols = {str(s): v for s, v in kept.symbols.items() if s != g.batch_symbol}
        key = (len(rows), q, tuple(sorted(symbols.items())), into is not None)
        run = self._row_backwards.get(key)
        if run is None:
            run = self._row_backward(kept, q, trainable, per_row + shared,
                                     accumulate=into is not None)
            self._row_backwards[key] = run
        produced = self._produced(trainable)
        if into is not None:
            sources = dict(trainable)
            with torch.no_grad():
                run(per_row + shared + [into[sources[i]] for i in produced])
            return None
        with torch.no_grad():
            stacked = run(per_row + shared)
        by_index = dict(zip(produced, stacked))
        return {source: by_index.get(i) for i, source in trainable}

    def _produced(self, trainable: list) -> list[int]:
        """Indices of the trainable inputs the backward graph gives a gradient for."""
        out = next(n for n in self._vmappable_backward().graph.nodes if n.op == "output")
        return [i for i, _ in trainable if out.args[0][i] is not None]

    def _row_backward(self, kept: KeptCall, q: int, trainable: list, inputs: list, *,
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
        graph = self._vmappable_backward()
        produced = self._produced(trainable)

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
        if self.step.options.compiler == "aot_eager":
            if accumulate:
                traced, self._inplace_matmuls = accumulating(traced)
            run = frameless(traced)  # no Python frame per op (runtime/frameless.py)
            return lambda args: run(*args)
        from torch._inductor.compile_fx import compile_fx

        dense_scatter_bases(traced)
        with torch.no_grad():
            compiled = compile_fx(traced, list(inputs))
        return lambda args: compiled(*args)

    def _merged(self, sample, weights: dict) -> dict:
        """Reweight with one buffer per sample: record the cotangents a row of ``sample``
        brought; when the last of its rows arrives, all must be equal (on-policy they are
        ``-A_i / (B |S|)``) and ``cotangent * G_i`` is its gradient."""
        state = self.step._state
        got = state.arrived.setdefault(sample, [])
        got.append(weights)
        if len(got) < state.sample_rows[sample]:
            return {}
        first = got[0]
        for other in got[1:]:
            for q, w in first.items():
                w2 = other[q]
                if (w is None) != (w2 is None) or (w is not None and not torch.equal(w, w2)):
                    raise ValueError(
                        f"reweight kept one gradient buffer for sample {sample} (the rollout "
                        f"named its rows with samples=), but the update's cotangents for its "
                        f"{len(got)} trained steps differ on output {q} ({first[q]} vs {w2}): "
                        "the loss is not -A_i times the log-prob on every step (off-policy "
                        "ratio, clipping, per-step weights). Use schedule='retain', or rollout "
                        "without samples= (one buffer per row)")
        total = {}
        for q, w in first.items():
            if w is None:
                continue
            for source, gr in state.sample_grads.pop((sample, q), {}).items():
                total[source] = gr * w if source not in total else total[source] + gr * w
        state.arrived[sample] = [None] * len(got)  # complete; its buffer is freed
        state.sample_blocks = {k: b for k, b in state.sample_blocks.items() if sample not in k[0]}
        return total
