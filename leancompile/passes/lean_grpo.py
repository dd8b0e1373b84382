"""LeanGRPO: turn the captured graphs of a policy step into Recompute / Retain / Reweight
schedules, and choose one from the memory the graphs really save.

Input: a captured step (forward graph ``(params, x_t, step, noise, cond) -> (x_{t+1},
log_prob[, mean], *saved)``, backward graph ``(*saved, cotangents) -> grads``, inference graph),
the timestep selection drawn before the rollout, and the byte size of one trainable-parameter
gradient. Output: a ``SchedulePlan`` per schedule. A plan is data: which graph runs at each
rollout step for selected and unselected samples, what runs once the rewards are known, and
the cotangent of each backward. ``leancompile.lean.LeanStep`` executes it (the trainer,
``leancompile.grpo.trainer``, drives one).

Rollout and update per schedule (``S_i`` = selected steps of sample ``i``, ``B`` samples)::

    recompute  rollout: inference graph at every step
               update:  for t in S_i: forward(save) on (x_t, x_{t+1}); backward with the PPO
                        cotangent d loss / d log_prob (ratio 1 on-policy)
    retain     rollout: t in S_i: forward(save), keep saved tensors; else inference graph
               update:  backward(kept, cotangent -A_i/(B*|S|))
    reweight   rollout: t in S_i: forward(save), backward(cotangent -1/(B*|S|)) into G_i, free
               update:  grad += A_i * G_i

Why Retain is legal: on-policy the update forward recomputes the rollout forward on the same
inputs with the same parameters, so the saved tensors are the same values; the PPO ratio is
exactly 1, clipping is inactive, and d loss / d log_prob = -A_i/(B*|S|). Reweight additionally
uses the linearity of the backward in its cotangent: backward(c*A) = A*backward(c), which holds
in real arithmetic (not bit for bit: the scaling moves from before to after the backward).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .result import PassResult, format_bytes

__all__ = ["PlanOp", "SchedulePlan", "StepCosts", "ScheduleReport", "build_schedule_plans",
           "choose_schedule", "reweight_rows_per_backward", "graph_flops", "lean_grpo_pass", "SCHEDULES", "VERSION", "NAME"]

log = logging.getLogger("leancompile")

NAME = "lean_grpo"
VERSION = 3
SCHEDULES = ("recompute", "retain", "reweight")
"""The concrete LeanGRPO schedules, what a plan or a kept call runs (``lean/config.py``
``SCHEDULE_CHOICES`` adds ``auto``, which picks one of these per call)."""
SITE = "kept for reuse"


def lean_grpo_pass(gm, options=None) -> PassResult:
    """The LeanGRPO stage of the pipeline, on the forward graph of a step wrapped by
    ``lean_compile(schedule=...)`` (``gm.meta["lean_grpo"]`` says how many outputs it has and
    which inputs hold the batch): which outputs and saved tensors an update may reuse, and how.

    Every saved tensor and output is a site: rewritten (planned for reuse) when it holds the
    batch row by row (``RowLayout``: the rows of any regrouped batch can be gathered) or does not
    depend on the batch; skipped, with the reason, when rows of different samples meet in it
    (then a kept call serves only an update call with exactly its rows). Writes the layouts to
    ``gm.meta["lean_grpo"]`` for the step wrapper. Other graphs: nothing to do. The graph itself
    is not changed (a planning stage)."""
    from .row_layout import Mixed, RowLayout, find_row_layouts

    result = PassResult(name=NAME)
    info = getattr(gm, "meta", {}).get("lean_grpo")
    if info is None or "layouts" in info:
        return result
    n = info["num_outputs"]
    outs = list(next(node for node in gm.graph.nodes if node.op == "output").args[0])
    symbol = info["batch_symbol"]
    state = find_row_layouts(gm, info["batch_inputs"], symbol) if symbol is not None else {}
    layouts = []
    reasons = []
    for i, node in enumerate(outs):
        what = f"output {i}" if i < n else f"saved {node.name}"
        val = node.meta.get("val") if hasattr(node, "meta") else node
        if not isinstance(val, torch.Tensor):
            layouts.append("symint")
            continue
        if symbol is None:
            layout = Mixed("the batch size is static (1 or not marked): a kept call serves "
                           "update calls of exactly its rows")
        else:
            layout = state.get(node)
        layouts.append(layout)
        if isinstance(layout, Mixed):
            reasons.append(f"{what}: {layout.reason}")
            result.skip(node, SITE, f"{what} ({tuple(val.shape)}): {layout.reason}; a kept "
                        "call serves only an update call with exactly its rows")
        else:
            how = str(layout) if isinstance(layout, RowLayout) else "no batch dim"
            result.rewrite(node, f"{SITE}: {how}")
    info["layouts"] = {"outputs": layouts[:n], "saved": layouts[n:],
                       "row_local": not reasons, "reason": reasons[0] if reasons else ""}
    return result


@dataclass(frozen=True, kw_only=True)
class PlanOp:
    """One operation of a schedule.

    ``op`` is one of ``forward_infer`` (inference graph), ``forward_save`` (forward graph, its
    saved tensors kept for a backward), ``backward_now`` (backward graph right away),
    ``backward_later`` (backward graph on kept tensors once advantages are known),
    ``scale_buffer`` (``grad += A_i * G_i``) and ``sync`` (gradient all-reduce point; a no-op
    in a single process). ``cotangent`` is the cotangent of the log-prob, as a formula.
    """

    phase: str
    """``rollout`` (per step), or ``update`` (after rewards and advantages)."""
    op: str
    applies_to: str
    """``selected`` / ``unselected`` steps, ``selected after rewards``, or ``all``."""
    cotangent: str = ""
    target: str = ""
    """Where the gradient goes: ``grad`` (the parameters' .grad) or ``G_i`` (a per-sample
    buffer)."""

    def __str__(self) -> str:
        text = f"{self.phase:7s} {self.op:15s} on {self.applies_to}"
        if self.cotangent:
            text += f", d/dlogp = {self.cotangent}"
        if self.target:
            text += f" -> {self.target}"
        return text


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Per-call costs of the captured graphs, from their metadata."""

    saved_bytes: int
    """Activation bytes one forward(save) call keeps (storages that are not inputs)."""
    forward_flops: int
    backward_flops: int
    inference_flops: int
    forward_s: float | None = None
    """Predicted seconds of one call of each graph on a device model (``leancompile/sim``),
    when the caller has one; ``auto`` then takes the fastest plan that fits."""
    backward_s: float | None = None
    inference_s: float | None = None


@dataclass(kw_only=True)
class SchedulePlan:
    """A schedule as data: its ops and what it costs for one rollout."""

    name: str
    ops: list[PlanOp]
    selected_calls: int
    """Selected (step, micro-batch) forward calls in one rollout."""
    total_calls: int
    peak_bytes: int
    """Extra memory at the peak: kept activations (retain), per-sample gradient buffers plus
    one step's activations (reweight), one step's activations (recompute)."""
    flops: int
    """Estimated floating point operations of rollout plus update."""
    memory_budget: float | None = None
    """The partitioner's activation budget the graphs were captured with (retain)."""
    fits: bool = True
    note: str = ""
    seconds: float | None = None
    """Predicted seconds of rollout plus update (when the costs carry predicted times)."""

    def describe(self, baseline_flops: int | None = None) -> str:
        relative = (f" ({self.flops / baseline_flops:.2f}x recompute's)"
                    if baseline_flops else "")
        lines = [f"schedule {self.name}: peak extra memory {format_bytes(self.peak_bytes)}, "
                 f"~{self.flops / 1e9:.3f} GFLOP{relative}"
                 + (f", predicted {self.seconds * 1e3:.2f} ms" if self.seconds is not None
                    else "")
                 + (f", partitioner budget {self.memory_budget}" if self.memory_budget is not
                    None else "")
                 + ("" if self.fits else " (does not fit)")]
        lines += [f"  {op}" for op in self.ops]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def graph_flops(gm, batch_symbol, batch: int) -> int:
    """FLOPs of graph ``gm`` for ``batch`` rows (its sizes in ``batch_symbol``), counted on
    fake tensors (nothing runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from .row_layout import size_in_batch

    def concrete(size):
        if isinstance(size, torch.SymInt):
            size = size_in_batch(size, batch_symbol)
            return size if isinstance(size, int) else int(size.subs({batch_symbol: batch}))
        return size

    mode = FakeTensorMode()
    values = []
    with mode:
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                values.append(torch.empty([concrete(d) for d in val.shape], dtype=val.dtype))
            else:
                values.append(concrete(val))
    run = gm
    if any(n.target in _Unwrapped.WRAPPERS for n in gm.graph.nodes):
        run = _Unwrapped(gm).run  # the flop counter cannot dispatch these wrappers
    with mode, FlopCounterMode(display=False) as counter:
        run(*values)
    return counter.get_total_flops()


class _Unwrapped(torch.fx.Interpreter):
    """Runs a graph calling the ops that higher-order wrappers hold directly: ops with side
    effects behind effect tokens (``linalg.inv``'s error check), and random ops whose generator
    state activation checkpointing saves for the backward. What counts FLOPs on fake tensors,
    not what runs a step."""

    WRAPPERS = {torch.ops.higher_order.with_effects,
                torch.ops.higher_order.run_and_save_rng_state,
                torch.ops.higher_order.run_with_rng_state,
                torch.ops.prims._make_token.default, torch.ops.prims._sink_tokens.default}

    def call_function(self, target, args, kwargs):
        if target is torch.ops.higher_order.with_effects:
            token, op, *rest = args
            out = op(*rest, **kwargs)
            return (token, *out) if isinstance(out, tuple) else (token, out)
        if target is torch.ops.higher_order.run_and_save_rng_state:
            return torch.empty(0, dtype=torch.uint8), args[0](*args[1:], **kwargs)
        if target is torch.ops.higher_order.run_with_rng_state:
            return args[1](*args[2:], **kwargs)
        if target is torch.ops.prims._make_token.default:
            return torch.empty(0)
        if target is torch.ops.prims._sink_tokens.default:
            return None
        return super().call_function(target, args, kwargs)


def reweight_rows_per_backward(*, rows: int, grad_bytes: int, row_saved_bytes: int,
                               room_bytes: int, requested: int | None = None) -> int:
    """Reweight's per-row gradients come from one vectorised backward (``torch.func.vmap`` of
    the batch-1 backward graph over the rows): how many of a call's ``rows`` one backward
    takes. ``requested`` when given; else as many as ``room_bytes`` holds, each row costing its
    parameter gradients (``grad_bytes``) and its share of the backward's working memory (taken
    as twice what one row saves for the backward). LoRA: small gradients, all rows at once;
    full fine-tuning: fewer rows per backward."""
    if requested is not None:
        return max(1, min(rows, requested))
    per_row = grad_bytes + 2 * row_saved_bytes
    return max(1, min(rows, room_bytes // max(per_row, 1)))


def build_schedule_plans(*, costs: StepCosts, selected_calls: int, total_calls: int,
                         retain_bytes: int, reweight_call_bytes: int, samples_in_flight: int,
                         grad_bytes: int, with_kl: bool, memory_budget_bytes: int,
                         partitioner_budget: float | None = None,
                         reweight_rows: int = 1, held_grads: int = 0) -> dict[str, SchedulePlan]:
    """The three schedules for one rollout.

    ``costs``: per-call costs of the graphs for the full batch. ``selected_calls`` /
    ``total_calls``: forward calls at selected steps / in the whole rollout.
    ``retain_bytes``: activation bytes Retain keeps until the rewards, summed exactly over the
    selected calls from the graphs' metadata. ``reweight_call_bytes``: activations of one
    per-sample call (freed after its backward). ``samples_in_flight``: samples whose gradient
    buffers Reweight holds at once. ``grad_bytes``: one trainable-parameter gradient.
    ``reweight_rows``: rows per vectorised backward (``reweight_rows_per_backward``); their
    per-row gradients exist together until added into the sample buffers, so the peak counts
    the least of them (one row), the most that fit being taken at run time. ``held_grads``:
    full-size corrected gradients Reweight holds beside the buffers until a later reduction
    (sharded parameters reduced once per update: 1).
    """
    unselected_calls = total_calls - selected_calls
    f_i, f, b = costs.inference_flops, costs.forward_flops, costs.backward_flops
    kl_note = "; KL gradient in its own buffer, not scaled by A_i" if with_kl else ""
    plans = {
        "recompute": SchedulePlan(
            name="recompute", selected_calls=selected_calls, total_calls=total_calls,
            ops=[PlanOp(phase="rollout", op="forward_infer", applies_to="all"),
                 PlanOp(phase="update", op="forward_save", applies_to="selected after rewards"),
                 PlanOp(phase="update", op="backward_now", applies_to="selected after rewards",
                        cotangent="PPO: -A_i*ratio/(B*|S|) unclipped (ratio 1 on-policy)",
                        target="grad"),
                 PlanOp(phase="update", op="sync", applies_to="all")],
            peak_bytes=costs.saved_bytes, flops=total_calls * f_i + selected_calls * (f + b)),
        "retain": SchedulePlan(
            name="retain", selected_calls=selected_calls, total_calls=total_calls,
            ops=[PlanOp(phase="rollout", op="forward_save", applies_to="selected"),
                 PlanOp(phase="rollout", op="forward_infer", applies_to="unselected"),
                 PlanOp(phase="update", op="backward_later", applies_to="selected after rewards",
                        cotangent="-A_i/(B*|S|)" + (" (+ beta*KL)" if with_kl else ""),
                        target="grad"),
                 PlanOp(phase="update", op="sync", applies_to="all")],
            peak_bytes=retain_bytes,
            flops=unselected_calls * f_i + selected_calls * (f + b),
            memory_budget=partitioner_budget),
        "reweight": SchedulePlan(
            name="reweight", selected_calls=selected_calls, total_calls=total_calls,
            ops=[PlanOp(phase="rollout", op="forward_save", applies_to="selected"),
                 PlanOp(phase="rollout", op="backward_now", applies_to="selected",
                        cotangent=f"one-hot per row, vmapped over {reweight_rows} row(s)",
                        target="G_i"),
                 PlanOp(phase="rollout", op="forward_infer", applies_to="unselected"),
                 PlanOp(phase="update", op="scale_buffer", applies_to="all",
                        cotangent="grad += A_i * G_i", target="grad"),
                 PlanOp(phase="update", op="sync", applies_to="all")],
            # The rows per backward adapt to the room left (one at the least).
            peak_bytes=(samples_in_flight + (1 if with_kl else 0) + 1 + held_grads)
            * grad_bytes + reweight_call_bytes,
            flops=unselected_calls * f_i + selected_calls * (f + b * (2 if with_kl else 1)),
            note=f"one gradient buffer per sample in flight ({samples_in_flight}); per-row "
                 f"gradients from one vectorised backward of up to {reweight_rows} row(s) "
                 "(torch.func.vmap of the batch-1 backward)" + kl_note
                 + ("; the corrected full-size gradient held until the update's reduction"
                    if held_grads else "")),
    }
    for plan in plans.values():
        plan.fits = plan.peak_bytes <= memory_budget_bytes
    if None not in (costs.inference_s, costs.forward_s, costs.backward_s):
        t_i, t_f, t_b = costs.inference_s, costs.forward_s, costs.backward_s
        plans["recompute"].seconds = total_calls * t_i + selected_calls * (t_f + t_b)
        plans["retain"].seconds = unselected_calls * t_i + selected_calls * (t_f + t_b)
        plans["reweight"].seconds = unselected_calls * t_i + selected_calls * (
            t_f + t_b * (2 if with_kl else 1))
    return plans


def choose_schedule(plans: dict[str, SchedulePlan]) -> tuple[str, str]:
    """``auto``: with predicted times (a device model), the fastest plan that fits; otherwise
    Retain if its kept activations fit, else Reweight if its buffers fit, else Recompute.
    Returns (name, reason). (Keeping less under Retain, by recapturing with a
    smaller partitioner budget, is done by the caller before giving up on Retain.)"""
    retain, reweight = plans["retain"], plans["reweight"]
    timed = [p for p in (retain, reweight, plans["recompute"]) if p.fits and p.seconds]
    if timed and all(p.seconds is not None for p in plans.values()):
        best = min(timed, key=lambda p: p.seconds)  # ties: retain, then reweight
        return best.name, (f"{best.name}: predicted {best.seconds * 1e3:.1f} ms per rollout + "
                           "update, the fastest that fits the memory budget (" + ", ".join(
                               f"{p.name} {p.seconds * 1e3:.1f} ms"
                               f"{'' if p.fits else ' (does not fit)'}"
                               for p in plans.values()) + ")")
    if retain.fits:
        return "retain", (f"retain keeps {format_bytes(retain.peak_bytes)} of activations, within"
                          " the memory budget; it is exact and skips the update forward")
    if reweight.fits:
        return "reweight", (f"retain needs {format_bytes(retain.peak_bytes)}, over the budget; "
                            f"reweight's gradient buffers need {format_bytes(reweight.peak_bytes)}")
    return "recompute", (f"neither retain ({format_bytes(retain.peak_bytes)}) nor reweight "
                         f"({format_bytes(reweight.peak_bytes)}) fits the memory budget")


@dataclass(kw_only=True)
class ScheduleReport:
    """What ``GRPOTrainer.explain`` shows: the three plans with their memory and time
    estimates, and the schedule that would run with the reason."""

    plans: dict[str, SchedulePlan]
    chosen: str
    reason: str
    batch: int
    num_steps: int
    selected_per_sample: int
    saved_bytes_per_call: int
    memory_budget_bytes: int
    graph_nodes: dict[str, int] = field(default_factory=dict)
    pipeline: object = None
    """The pipeline's ``Report`` of the policy step's graphs (its ``lean_grpo`` stage says
    which saved tensors hold the batch row by row)."""
    gradient_sync: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Data parallel: per schedule, the gradient reductions one update issues on each rank
    and their bytes (empty in one process)."""
    gradient_sync_note: str = ""
    """Where those counts come from (parallelism, ranks, rounds of prompt groups)."""
    regather: str = ""
    """The chosen schedule's graphs gather parameters again in the backward
    (``passes/regather_params.py``): which, and the bytes a kept call does not hold."""
    gathered_peak: dict[str, int] = field(default_factory=dict)
    """Sharded parameters: per graph of the chosen schedule's step, the most bytes of gathered
    weights alive at once (``passes/gather_at_use.peak_gathered_bytes``)."""

    def __str__(self) -> str:
        lines = [
            f"LeanGRPO schedules: batch {self.batch}, {self.num_steps} steps, "
            f"{self.selected_per_sample} trained per sample; one forward(save) keeps "
            f"{format_bytes(self.saved_bytes_per_call)}; memory budget "
            f"{format_bytes(self.memory_budget_bytes)}",
            "captured graphs: " + ", ".join(f"{k} {v} nodes" for k, v in
                                            self.graph_nodes.items()),
        ]
        base = self.plans["recompute"].flops or 1
        for plan in self.plans.values():
            lines.append(plan.describe(base))
        lines.append(f"-> {self.chosen}: {self.reason}")
        if self.gradient_sync:
            lines.append("gradient reductions per update: " + ", ".join(
                f"{name} {count} ({format_bytes(nbytes)})"
                for name, (count, nbytes) in self.gradient_sync.items())
                + f" [{self.gradient_sync_note}]")
        if self.regather:
            lines.append(self.regather)
        if self.gathered_peak:
            lines.append("gathered weights alive at the peak (per call): " + ", ".join(
                f"{name} {format_bytes(n)}" for name, n in self.gathered_peak.items()))
        if self.pipeline is not None:
            for result in self.pipeline.pass_results(NAME):
                if result.disabled:
                    lines.append("pipeline stage lean_grpo: disabled")
                    continue
                if result.rewritten or result.skipped:
                    lines.append(f"pipeline stage lean_grpo: {len(result.rewritten)} outputs and "
                                 f"saved tensors reusable row by row, {len(result.skipped)} not"
                                 + (f" (first: {result.skipped[0].reason})"
                                    if result.skipped else ""))
        return "\n".join(lines)
