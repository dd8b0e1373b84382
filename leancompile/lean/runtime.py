"""One Dynamo graph of a wrapped function at run time: ``GraphRuntime`` is the compiled function
Dynamo calls, dispatching each call by phase (outside the phases: as ``torch.compile`` would;
rollout: keep what the schedule needs; update: reuse what was kept, or recompute with the
reason). Its parts: a trained rollout call kept (``keep.py``), row keys and matching
(``keys.py``), Retain's gathered rows
(``retain.py``), Reweight's per-row gradients (``reweight.py``, its vectorised backward
``row_backward.py``), an update call served from the kept calls (``serve.py``)."""

from __future__ import annotations

import re
import time
import warnings
from collections import Counter

import torch
from torch import Tensor

from ..capture import StepGraphs
from ..runtime.reuse import Reused
from .config import ReuseWarning, StepStats
from .graphs import as_traced, empty_outputs, readable, restrided, sizes_of, traced_stride
from .keep import KeptRollout
from .keys import Keys
from .retain import Retain
from .reweight import Reweight
from .row_backward import RowBackward
from .serve import ServedUpdate

__all__ = ["GraphRuntime", "warn_little_reuse"]


class GraphRuntime(KeptRollout, Keys, Retain, Reweight):
    """The compiled function Dynamo calls for one graph of the wrapped function."""

    def __init__(self, step, graphs: StepGraphs):
        """``step``: the ``LeanStep`` (``api.py``) whose graph this is."""
        self.step = step
        self.g = graphs
        self.params = [i for i, r in enumerate(graphs.roles) if r.kind == "param"]
        symbol = graphs.batch_symbol
        placeholders = [n for n in (graphs.forward or graphs.inference).graph.nodes
                        if n.op == "placeholder"]
        self.symbol_inputs = {}
        for i, node in enumerate(placeholders):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
                self.symbol_inputs[i] = val.node.expr
        self.batch_symint = {i for i, s in self.symbol_inputs.items() if s == symbol}
        self.sample_input = next((i for i, r in enumerate(graphs.roles)
                                  if r.source == "<sample>"), None)
        self.trainable_sources = [graphs.roles[i].source for i in self.params]
        self.at_one: tuple | None = None
        """(fingerprint, sample fingerprint) at a batch of 1, once traced
        (``Keys.fingerprints_at_one``)."""
        self.row_backward = RowBackward(graphs, defer_reductions=step.config.defer_reductions,
                                        compiler=step.options.compiler)
        """Reweight's vectorised per-row backward of this graph (``row_backward.py``)."""
        backward = graphs.backward_aten
        self._tangent_metas = [] if backward is None else [
            n.meta.get("val") for n in backward.graph.nodes
            if n.op == "placeholder" and n.name.startswith("tangents")]
        """The backward graph's tangents as traced (their strides: a compiled backward
        assumes them; ``tangents_for``)."""
        self._saved_metas = [] if backward is None else [
            n.meta.get("val") for n in backward.graph.nodes
            if n.op == "placeholder" and not n.name.startswith("tangents")]
        self._relaid = step.options.compiler == "inductor" and graphs.forward is not None
        """Inductor lays a convolution's tensors out its own way (layout optimisation, e.g.
        channels-last weights) and its forward may return saved tensors with other strides
        than traced, while the backward compiled here asserts the traced ones (AOTAutograd
        compiles its backward for the forward's strides instead): such saved tensors are laid
        out as traced before the backward (``_saved_as_traced``). Which ones: from the strides
        Inductor reported for the compiled forward (``StepGraphs.saved_relaid``; every saved
        tensor when it reported none)."""
        self.no_batch_of_one = step.options.compiler == "inductor" and \
            graphs.batch_symbol is not None and backward is not None and any(
                n.target is torch.ops.aten.convolution_backward.default
                and any(_channels_last_3d(a.meta.get("val")) for a in n.args[1:3])
                for n in backward.graph.nodes if n.op == "call_function")
        """Whether this graph's compiled backward must not run at a batch of 1: compiled for a
        symbolic batch (Dynamo never runs such a graph at 1), it runs a 3-D convolution's
        backward on channels-last-3d tensors, which at a batch of 1 returns its gradients
        contiguous (torch 2.13; channels-last-3d at any other batch), and Inductor asserts the
        format it compiled for (``ServedUpdate.refusal``)."""
        self._relaid_positions: list[int] | None = None
        """The backward's saved inputs to lay out as traced (``_relaid_saved``), once known."""
        self._saved_strides: dict[tuple, tuple] = {}
        self.saved_at_sizes: dict[tuple, dict] = {}
        """Per batch and sizes: the saved sizes' values and tensors' traced strides
        (``Retain.saved_at``)."""
        self.rows_like: dict[str, int] = {}
        """For a graph specialised to a batch of 1: the rows per sample of each input, from the
        kept graph with a symbolic batch that computes the same (``_fingerprint_for``)."""

    def __call__(self, *args):
        state = self.step._state
        state.reached = True
        state.graphs_called.append(self.g)
        args = list(args)
        grad = state.grad_mode
        if state.phase == "plan":  # compiled, not run: outputs of the right metadata
            return self._finish(empty_outputs(self.g), args)
        if grad or state.phase == "rollout":
            self._check_frozen(args)
        if state.phase == "rollout" and state.current is not None and self.g.trainable:
            return self._rollout(args, state.current, grad)
        if state.phase == "update" and self.g.trainable and grad:
            return self._update(args)
        if state.phase == "update":
            if grad:
                state.stats.forwards_run += 1
            else:
                state.stats.no_grad_calls += 1
        if state.phase == "rollout" and not grad:
            return self._inference_timed(args)
        return self._plain(args, grad)

    def _inference_timed(self, args):
        """An untrained rollout call, its time in the cycle's ledger (``costs.py``: F0)."""
        ledger, ready = self.step._state.ledger, "inference" in self.g.compiled
        start = time.perf_counter()
        out = self._plain(args, False)
        if ready and ledger.note(args):
            ledger.infer_seconds += time.perf_counter() - start
            ledger.infer_rows += self.batch_of(args)
        return out

    def _check_frozen(self, args) -> None:
        """Refuse a call where an input that did not require grad when the graphs were traced
        now does: their backward has no gradient for it. Dynamo recompiles for such a change
        of an input's ``requires_grad``, but torch 2.11 does not for a parameter read from a
        module (plain ``torch.compile`` there leaves its ``.grad`` empty)."""
        changed = [readable(self.g.roles[i].source) for i in self.g.traced_frozen
                   if args[i].requires_grad]
        if changed:
            one = len(changed) == 1
            raise RuntimeError(
                f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} now "
                f"require{'s' if one else ''} grad but did not when this graph was compiled, "
                "and Dynamo ran the graph without compiling it again: its backward would give "
                f"{'it' if one else 'them'} no gradient. Set requires_grad before the first "
                "compiled call, or call torch._dynamo.reset() after changing it (torch "
                f"{torch.__version__}; torch 2.11 does not recompile for a module's "
                "parameter, torch 2.13 does)")

    def batch_of(self, args) -> int:
        """The batch size of a call: from a batch-major input, else dim 0 of the call's first
        tensor argument (``LeanStep`` notes it), else 1."""
        for i, role in enumerate(self.g.roles):
            if role.batch_rows:
                return args[i].shape[0] // role.batch_rows
        return self.step._state_batch or 1

    def rows_of_input(self, i: int) -> int:
        """Rows per sample of input ``i`` (0: not batch-major), from its role or, for a graph
        specialised to a batch of 1, from the kept graph that computes the same (``rows_like``)."""
        role = self.g.roles[i]
        return role.batch_rows or self.rows_like.get(role.source, 0)

    def _finish(self, outputs, args) -> tuple:
        out = list(outputs)
        for j, kind in enumerate(self.g.output_types):
            if kind == "input":
                out[j] = args[self.g.output_bases[j]]
        return tuple(out)

    def _symbols(self, args) -> dict:
        return {sym: int(args[i]) for i, sym in self.symbol_inputs.items()}

    def param_versions(self, args) -> dict:
        """Per parameter: its version counter, storage and ``requires_grad`` (a parameter
        frozen in the rollout has no gradient in what the rollout kept)."""
        return {self.g.roles[i].source: (args[i]._version, args[i].data_ptr(),
                                         args[i].requires_grad)
                for i in self.params}

    def _plain(self, args, grad: bool):
        g = self.g
        needs = grad and g.trainable and any(
            isinstance(a, Tensor) and a.requires_grad for a in args)
        if not needs:
            with torch.no_grad():
                outs = g.run_inference(args)
            return self._finish(outs[:g.num_outputs], args)
        with torch.no_grad():
            full = g.run_forward(args)
        outputs, saved = list(full[:g.num_outputs]), list(full[g.num_outputs:])
        inputs = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]

        def backward_fn(cotangents):
            grads = self.backward([saved[k] for k in g.bw_saved], outputs, cotangents)
            return [grads[i] for i in inputs]

        results = Reused.apply(backward_fn, outputs, *[args[i] for i in inputs])
        return self._finish(results, args)

    def tangents_for(self, outputs, cotangents) -> list:
        """The backward graph's tangent inputs: the differentiable outputs' cotangents
        (zeros where none), laid out with the strides the backward was traced with, as
        AOTAutograd's own runtime lays them out (Inductor's backward asserts them: SD3's output
        leaves its unpatchify einsum permuted, and its tangent was traced so)."""
        tangents = []
        metas = self._tangent_metas
        for n, j in enumerate(self.g.differentiable):
            c = cotangents[j] if j < len(cotangents) else None
            t = torch.zeros_like(outputs[j]) if c is None else c
            meta = metas[n] if n < len(metas) else None
            tangents.append(as_traced(t, meta, sizes_of(meta, t)) if meta is not None
                            else t.contiguous())
        return tangents

    def backward(self, bw_saved, outputs, cotangents) -> list:
        """The backward graph on ``bw_saved`` and the outputs' ``cotangents``: the gradient
        of every input (None where none)."""
        tangents = self.tangents_for(outputs, cotangents)
        self.step._state.stats.backward_graphs_run += 1
        if self._relaid:
            positions = self._relaid_saved(len(bw_saved))
            if positions:
                bw_saved = self._saved_as_traced(bw_saved, positions)
        with torch.no_grad():
            return list(self.g.run_backward(list(bw_saved) + tangents))

    def _relaid_saved(self, count: int) -> list[int]:
        """The positions among the backward's ``count`` saved inputs that the compiled forward
        may return with other strides than traced (``StepGraphs.saved_relaid``; all of them
        when Inductor reported no strides)."""
        if self._relaid_positions is None:
            relaid = self.g.saved_relaid
            if "forward" not in self.g.compiled:  # (not known before the forward compiled)
                return list(range(count))
            self._relaid_positions = list(range(count)) if relaid is None else [
                i for i, k in enumerate(self.g.bw_saved) if k in relaid]
        return self._relaid_positions

    def _saved_as_traced(self, saved, positions) -> list:
        """``saved`` (the backward's saved inputs, in order) with the strides the backward was
        traced with at ``positions`` (per input and shape, worked out once)."""
        out = list(saved)
        for i in positions:
            t = out[i]
            meta = self._saved_metas[i] if i < len(self._saved_metas) else None
            if isinstance(t, Tensor) and isinstance(meta, Tensor):
                key = (i, tuple(t.shape))
                stride = self._saved_strides.get(key)
                if stride is None:
                    stride = self._saved_strides[key] = traced_stride(meta, sizes_of(meta, t))
                out[i] = restrided(t, stride)
        return out

    def _update(self, args):
        state = self.step._state
        state.stats.update_calls += 1
        state.ledger.update_calls += 1
        start = time.perf_counter()
        assignment, reason = self.match_kept(args)
        if assignment is None:
            if state.kept:  # (a parameter change frees everything: recomputed everywhere)
                return self._fallback(args, reason)
            return self._recompute(args, reason)
        return self._reuse(args, assignment, start)

    def _fallback(self, args, reason: str):
        """An update call that should have reused kept state and cannot: recomputed, or
        ``StepConfig(fallback="raise")``'s error."""
        if self.step.config.fallback == "raise":
            raise RuntimeError(
                f"this update call cannot reuse what the rollout kept ({reason}), and "
                "fallback='raise' (graphs with collectives, parallel='fsdp': recomputing on "
                "this rank alone would run gathers the other ranks do not). Make the update "
                "calls repeat the rollout's trained calls (same rows, same inputs, no "
                "parameter change in between)")
        return self._recompute(args, reason)

    def _reuse(self, args, assignment, start: float):
        """An update call served from the kept calls that hold its rows (``serve.py``), or
        recomputed (``_fallback``) where they cannot serve it. ``start``: when the call began
        (its matching and outputs go in the cycle's ledger)."""
        served = ServedUpdate(runtime=self, args=args, assignment=assignment)
        refused = served.refusal()
        if refused:
            return self._fallback(args, refused)
        outputs = served.outputs()
        served.claim()
        ledger = self.step._state.ledger
        if served.retain and ledger.timed:
            ledger.serve_seconds += time.perf_counter() - start
            ledger.served_rows += len(served.retain)
        results = Reused.apply(served.backward, outputs, *[args[i] for i in served.trainable])
        return self._finish(results, args)

    def _recompute(self, args, reason: str):
        state = self.step._state
        state.stats.recomputed[reason] += 1
        state.stats.forwards_run += 1
        return self._plain(args, True)



def _channels_last_3d(val) -> bool:
    """Whether ``val`` (a traced tensor) is 5-D with its channels innermost."""
    if not isinstance(val, Tensor) or val.ndim != 5:
        return False
    channels, stride = val.shape[1], val.stride()[1]
    return isinstance(stride, int) and stride == 1 and not (isinstance(channels, int)
                                                             and channels == 1)


def warn_little_reuse(kept_rows: bool, stats: StepStats, calls: int, reused: int,
                       recomputed: Counter) -> None:
    """At ``update()`` exit: warn when the rollout kept rows and fewer than half of this
    update's calls reused them, naming the reasons, most frequent first (each of them: with
    two optimizer steps per rollout the second window's "parameters changed" counts as many
    calls as whatever stopped the first window, and naming one would hide the other)."""
    if stats is None or not kept_rows:
        return
    calls, reused = stats.update_calls - calls, stats.reused_calls - reused
    if not calls or 2 * reused >= calls:
        return
    reasons = Counter(stats.recomputed)
    reasons.subtract(recomputed)
    causes = Counter()  # one cause whichever row a call's reason names ("row 3: ...")
    for reason, n in reasons.items():
        if n > 0:
            causes[re.sub(r"^row \d+: ", "", reason)] += n
    ranked = causes.most_common()
    said = " | ".join(f"({n} x) {r}" for r, n in ranked[:3]) or "unknown"
    if len(ranked) > 3:
        said += f" | and {len(ranked) - 3} more"
    warnings.warn(
        f"update(): {reused} of {calls} calls reused what the rollout kept; the reasons for "
        f"the others, most frequent first: {said}. If the rollout trains the wrong calls "
        "(several sampling batches of T steps: rollout(train=..., trajectory_steps=T)), or "
        "more than one optimizer step follows a rollout, the kept memory is wasted; see "
        "step.stats.summary()", ReuseWarning, stacklevel=4)
