"""An update call served from what the rollout kept (``ServedUpdate``): whether the kept rows
can serve it (or why it is recomputed instead), its outputs copied or gathered from the kept
calls, and its backward, which assembles each parameter's gradient from Retain's backwards of
the kept saved tensors (``retain.py``) and Reweight's per-row gradients weighted by the
update's cotangents (``reweight.py``). ``GraphRuntime._reuse`` (``runtime.py``) runs it."""

from __future__ import annotations

import torch
from torch import Tensor

from .graphs import batch_independent, cotangent_rows

__all__ = ["ServedUpdate"]


class ServedUpdate:
    """One update call of ``runtime``'s graph whose rows ``assignment`` found in kept calls
    (``[(kept call, row)]`` per row of the call, ``keys.py``)."""

    def __init__(self, *, runtime, args: list, assignment: list):
        self.runtime = runtime
        self.state = runtime.step._state
        self.g = runtime.g
        self.args = args
        self.assignment = assignment
        self.batch = len(assignment)
        self.runs = runtime.kept_runs(assignment)
        """Consecutive rows from one kept call, as (kept, [rows])."""
        self.kept_graph = self.runs[0][0].runtime
        """The runtime of the graph that kept the rows (every run's, or ``refusal`` says)."""
        self.layouts = self.kept_graph.g.layouts
        kept_g = self.kept_graph.g
        self.out_map = list(range(kept_g.num_outputs))
        """The kept graph's output for each of this call's outputs: the same, but where the
        step returned its sample argument as given (``passthrough_fingerprint``): Dynamo
        returns it outside this call's graph, which lacks that output."""
        if self.g.num_outputs != kept_g.num_outputs:
            del self.out_map[kept_g.sample_output]
        self.whole = all(rows == list(range(k.batch)) for k, rows in self.runs) and \
            len({id(k) for k, _ in self.runs}) == len(self.runs)
        """Every kept call served whole, each once (no rows regrouped)."""
        self.trainable = [i for i in runtime.params if args[i].requires_grad]
        self.sources = [self.g.roles[i].source for i in self.trainable]
        self.retain = [(i, a) for i, a in enumerate(assignment) if a[0].mode == "retain"]
        self.reweight = [(i, a) for i, a in enumerate(assignment) if a[0].mode == "reweight"]

    def refusal(self) -> str:
        """Why the kept rows cannot serve this call ("" when they can): rows kept by different
        graphs, rows regrouped where the LeanGRPO stage did not prove them apart, or one row
        regrouped where the kept graph's backward cannot run at a batch of 1
        (``GraphRuntime.no_batch_of_one``)."""
        g, layouts = self.g, self.layouts
        kept_g = self.kept_graph.g
        if any(k.runtime.g is not kept_g and (k.runtime.g.bw_saved != kept_g.bw_saved or
                                              k.runtime.g.layouts != layouts)
               for k, _ in self.runs):
            return "rows kept by different graphs"
        row_local = bool(layouts.get("row_local"))
        splittable = all(lay is None or lay == "symint" or hasattr(lay, "outer")
                         for lay in layouts.get("outputs", [object()] * g.num_outputs))
        if not (row_local or (self.whole and (len(self.runs) == 1 or splittable))):
            reason = layouts.get("reason") or "the LeanGRPO stage did not run"
            return f"rows regrouped, and {reason}"
        if not self.whole and len(self.retain) == 1 and self.kept_graph.no_batch_of_one:
            return ("one row regrouped into a backward compiled for a symbolic batch that runs "
                    "a 3-D convolution's backward, which at a batch of 1 returns its gradients "
                    "in another memory format than Inductor compiled for")
        return ""

    def outputs(self) -> list:
        """The call's outputs: the kept outputs (one whole kept call) or their rows gathered,
        always as copies; an output that is an input, that input."""
        g, runs, args = self.g, self.runs, self.args
        outputs = []
        kept_storages = {o.untyped_storage().data_ptr() for kept, _ in runs
                         for o in kept.outputs if isinstance(o, Tensor)}
        for j, k in enumerate(self.out_map):
            if g.output_types[j] == "input":
                outputs.append(args[g.output_bases[j]])
                continue
            out = runs[0][0].outputs[k] if len(runs) == 1 and self.whole else \
                self.kept_graph.gather_output(k, runs)
            # A copy, never the kept tensor (or a view of it): an in-place edit of the served
            # output (v.mul_(dt)) would rewrite the rollout's output the caller holds and what
            # the backward reads.
            if isinstance(out, Tensor) and out.untyped_storage().data_ptr() in kept_storages:
                out = out.clone()
            outputs.append(out)
        return outputs

    def claim(self) -> None:
        """Mark the served rows used (a kept call all of whose trained rows were served is
        released) and count the call; refuse a sample's Reweight buffer served twice."""
        state = self.state
        for kept, row in self.assignment:
            if kept.mode != "reweight" or kept.samples is None:
                continue
            claimed = state.claimed.setdefault(kept.samples[row], set())
            if (id(kept), row) in claimed:
                raise ValueError(
                    f"reweight keeps one gradient buffer per sample (rollout(samples=...)): the "
                    f"sum of its trained steps' gradients, each once, applied when the last one "
                    f"arrives. This update call serves a step of sample {kept.samples[row]} a "
                    "second time, which that buffer cannot give (and a step served twice "
                    "leaves another never served). Use schedule='retain', or rollout without "
                    "samples= (one buffer per row)")
            claimed.add((id(kept), row))
        for kept, rows in self.runs:
            kept.used.update(rows)
            if set(kept.rows) <= kept.used:
                state.release(kept)
        state.stats.mechanisms["per-row gradients" if not self.retain else
                               "whole kept calls" if self.whole else "gathered rows"] += 1
        state.stats.reused_calls += 1
        state.stats.reused_rows += self.batch

    def backward(self, cotangents) -> list:
        """The trainable parameters' gradients for the outputs' ``cotangents`` (what
        ``Reused`` hands autograd): Retain's and Reweight's summed; those of deferred
        reductions held for ``take_deferred_grads`` instead."""
        # An output the update's own graph does not differentiate (the sample passed back in:
        # a constant there, differentiable in a rollout graph that drew it) brings no
        # gradient, whatever the kept graph would make of its cotangent.
        differentiable = set(self.g.differentiable)
        mine = [c if j in differentiable else None for j, c in enumerate(cotangents)]
        cotangents = [None] * self.kept_graph.g.num_outputs  # (the kept graph's outputs)
        for j, k in enumerate(self.out_map):
            cotangents[k] = mine[j]
        total: dict[str, Tensor] = {}
        if self.retain:
            self._retained(cotangents, total)
        if self.reweight:
            self._reweighted(cotangents, total)
        self._hold_deferred(total)
        zero = self.runtime.step.config.zero_grads
        return [total[s] if s in total else torch.zeros_like(self.args[i]) if zero else None
                for s, i in zip(self.sources, self.trainable)]

    def _add(self, total: dict, grads: dict) -> None:
        for source, gr in grads.items():
            if gr is not None and source in self.sources:
                total[source] = gr if source not in total else total[source] + gr

    def _retained(self, cotangents, total: dict) -> None:
        """Retain: the backward of each kept call (served whole), or one backward of the rows'
        saved tensors gathered (regrouped)."""
        batch, out_layouts = self.batch, self.layouts.get("outputs")
        retain_runs = self.runtime.kept_runs([a for _, a in self.retain])
        update_rows = [i for i, _ in self.retain]
        if self.whole:
            offset = 0
            for n, (kept, rows) in enumerate(retain_runs):
                mine = update_rows[offset:offset + len(rows)]
                offset += len(rows)
                # An output that does not depend on the batch is the same value in every kept
                # call: its cotangent goes into one backward, not each.
                cots = [None if n and batch_independent(out_layouts, j) else
                        cotangent_rows(c, out_layouts, j, batch, mine)
                        for j, c in enumerate(cotangents)]
                kg = kept.runtime
                grads = kg.backward([kept.saved[k] for k in kg.g.bw_saved], kept.outputs, cots)
                self._add(total, {kg.g.roles[i].source: grads[i] for i in kg.params})
        else:
            kg = retain_runs[0][0].runtime
            bw_saved = kg.gathered_saved(retain_runs, len(update_rows))
            outs = [kg.gather_output(j, retain_runs) for j in range(kg.g.num_outputs)]
            cots = [cotangent_rows(c, out_layouts, j, batch, update_rows)
                    for j, c in enumerate(cotangents)]
            grads = kg.backward(bw_saved, outs, cots)
            self._add(total, {kg.g.roles[i].source: grads[i] for i in kg.params})

    def _reweighted(self, cotangents, total: dict) -> None:
        """Reweight: each row's kept per-row gradients times its cotangent (or, with one
        buffer per sample, the sample's buffer once its last row arrived)."""
        batch = self.batch
        scalars = set()
        for _, (kept, _) in self.reweight:
            scalars |= set(kept.grads.get("scalars", ()))
            scalars |= {key[1] for key in kept.grads if isinstance(key, tuple)}
        for j, c in enumerate(cotangents):
            if c is not None and j not in scalars and bool(torch.any(c != 0)):
                raise ValueError(
                    f"reweight kept per-row gradients of the per-row scalar outputs "
                    f"{sorted(scalars)}, but the update's loss also depends on output "
                    f"{j} (shape {tuple(c.shape)}), which it cannot serve: use "
                    "schedule='retain', or compute that term inside the step as a "
                    "per-row scalar output")
        for i, (kept, row) in self.reweight:
            weights = {q: (cotangents[q].reshape(batch, -1)[i].sum()
                           if cotangents[q] is not None else None) for q in scalars}
            if kept.samples is not None:
                self._add(total, self.runtime.merged_sample_grads(kept.samples[row], weights))
                continue
            for q, weight in weights.items():
                if weight is not None:
                    self._add(total, {source: None if gr is None else gr * weight
                                      for source, gr in kept.grads[(row, q)].items()})

    def _hold_deferred(self, total: dict) -> None:
        """``defer_reductions``: Reweight's gradients of the parameters whose reductions were
        taken out of the backward leave ``total`` and are summed for ``take_deferred_grads``."""
        state = self.state
        deferred = self.kept_graph.row_backward.deferred_outputs if self.reweight else set()
        for s, i in zip(self.sources, self.trainable):
            if i in deferred and s in total:
                grad = total.pop(s)
                held = state.deferred.get(id(self.args[i]))
                # (the held sum is this runtime's own tensor: added to in place)
                state.deferred[id(self.args[i])] = (self.args[i], grad if held is None
                                                    else held[1].add_(grad))
                if held is None:
                    state.held_bytes += grad.numel() * grad.element_size()
                    state.note_peak()
