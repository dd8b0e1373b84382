"""Reweight's per-row gradients: taken in the rollout (one vectorised backward per chunk of
rows, ``torch.func.vmap`` of the batch-1 backward, compiled like the step's own graphs), kept
per row or summed per sample, and weighted by the update's cotangents. ``Reweight`` is a part
of ``GraphRuntime`` (``runtime.py``); the vectorised backward it runs is ``RowBackward``
(``row_backward.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..passes.lean_grpo import reweight_rows_per_backward
from ..runtime.vmap_ops import agree_min
from .graphs import numel_per_row
from .state import KeptCall

__all__ = ["Reweight"]


class Reweight:
    """Per-row gradients (``GraphRuntime`` methods)."""

    def row_gradients(self, kept: KeptCall, saved: list) -> None:
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
            self.backward
        if batched and self.row_backward.unbatchable():
            batched = False
            state.stats.reweight_unbatched = self.row_backward.unbatchable()
        if batched:
            chunk = self.rows_per_backward(kept)
            for start in range(0, len(kept.rows), chunk):
                rows = kept.rows[start:start + chunk]
                for q in scalars:
                    if self._accumulate_rows(kept, rows, q, trainable):
                        continue
                    stacked = self.row_backward.stacked_gradients(kept, rows, q, trainable)
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
                    bw_saved, row_outputs = self.gathered_saved([(kept, [row])], 1), \
                        [self.gather_output(j, [(kept, [row])]) for j in range(g.num_outputs)]
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

    def scalar_outputs(self, outputs, batch: int) -> list[int]:
        """Differentiable outputs holding one value per row: what reweight keeps gradients of
        (by the traced shape: an output that does not depend on the batch is not one, even
        when its length equals this call's batch size)."""
        return [j for j in self.g.differentiable
                if isinstance(outputs[j], Tensor) and outputs[j].numel() == batch
                and outputs[j].dim() >= 1 and outputs[j].shape[0] == batch
                and numel_per_row(self.g, j, batch) == 1]

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
            self.row_backward.stacked_gradients(kept, rows, q, trainable, into=block)
        else:
            stacked = self.row_backward.stacked_gradients(kept, rows, q, trainable)
            pairs = [(block[source], t) for source, t in stacked.items()
                     if t is not None and source in block]
            if len(pairs) != len(block):
                return False
            torch._foreach_add_([b for b, _ in pairs], [t for _, t in pairs])
        state.stats.reweight_fused_steps += 1
        state.stats.reweight_inplace_matmuls = self.row_backward.inplace_matmuls
        return True

    def _unreduced_backward(self, bw_saved, outputs, cotangents) -> list:
        """``defer_reductions``, one row at a time: the backward graph without its gradient
        reductions (``RowBackward.unreduced``), run as it is (aot_eager's way, also under
        Inductor: this path is for calls the vectorised backward cannot take)."""
        unreduced = self.row_backward.unreduced()
        tangents = self.tangents_for(outputs, cotangents)
        with torch.no_grad():
            return list(unreduced(*bw_saved, *tangents))

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
            out = next(n for n in self.row_backward.vmappable().graph.nodes
                       if n.op == "output")
            for i in sizes:
                val = getattr(out.args[0][i], "meta", {}).get("val")
                if isinstance(val, Tensor) and i in self.row_backward.deferred_outputs:
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
        for group in self.row_backward.exchange_groups():
            rows = agree_min(rows, group, kept.outputs[0].device)
        return rows


    def merged_sample_grads(self, sample, weights: dict) -> dict:
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
