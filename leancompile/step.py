"""LeanGRPO in the loops users already own: ``lean_compile(fn, schedule=...)``.

FlowGRPO- and DanceGRPO-style trainers sample trajectories under ``no_grad``, score them, then
run the model again on every trained step to get gradients. On-policy that second forward
computes what the rollout already computed. Wrap the function both phases call (the model's
velocity, or a whole step: velocity + SDE transition + log-prob) and mark the two phases::

    step = leancompile.lean_compile(transformer_velocity, schedule="auto")
    with step.rollout(train=range(n_train)):     # the sampling loop, unchanged
        with torch.no_grad():
            for k in range(T):
                v = step(x, t[k], cond)
                ...
    with step.update():                           # the training loop, unchanged
        for batch in shuffled_minibatches:
            v = step(x_b, t_b, cond_b)            # no forward: the rollout's outputs
            loss(v).backward()                    # backward through what the rollout kept
            ...

How a call runs (each Dynamo graph of the function is captured by ``capture.capture_graph``
into forward, backward and inference graphs through the pass pipeline):

- outside both phases: as ``torch.compile`` would (inference graph under ``no_grad``,
  forward + backward with autograd otherwise);
- ``rollout``: calls chosen by ``train`` run the forward graph and keep what the schedule
  needs: ``retain`` the saved activations, ``reweight`` one gradient per trained row of every
  per-row scalar output (a log-prob), taken at once; the other calls run the inference graph.
  ``auto`` retains while the kept bytes fit the memory budget, then reweights (when the step has
  a per-row scalar output) or keeps nothing;
- ``update``: a call whose every row equals a kept row (same computation: a structural hash of
  the graph; same inputs: row fingerprints confirmed with ``torch.equal``; same parameter
  versions) returns the kept outputs without running a forward; its backward runs the kept
  backward graph (whole kept calls as they are, or the rows of any regrouping gathered when the
  LeanGRPO stage proved the graph keeps samples' rows apart) or sums the kept per-row gradients
  weighted by the incoming cotangents. Every other call is recomputed, and counted with its
  reason in ``step.stats``.

A step that draws its sample inside (FlowGRPO's and DanceGRPO's SDE steps when no
``prev_sample`` is given) declares it: ``sample_output`` is the output holding the drawn sample,
``sample_arg`` the keyword the update passes it back in. A rollout call and an update call then
match when the update graph computes, from the sample, exactly what the rollout graph computes
from the value it drew (the rollout graph's sample output is hashed as an input). The drawn
sample must reach the other outputs detached (FlowGRPO's ``prev_sample.detach()`` in the
log-prob): the update holds the sample it passes back constant, so a rollout graph whose
gradients flow through the sample is refused (``capture._sample_gradient_outputs``).
"""

from __future__ import annotations

import copy

import contextlib
import dataclasses
import logging
import os
import re
import time
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils._pytree import tree_flatten

from .capture import RandomOpInGraphError, StepGraphs, capture_graph
from .compiler import LeanBackend, LeanGraphPass
from .options import CompileOptions
from .passes.lean_grpo import reweight_rows_per_backward
from .report import Report, record_report
from .passes.coalesced_sync import find_gradient_reductions, take_out_reductions
from .runtime.accumulate import accumulating
from .runtime.frameless import frameless
from .runtime.reuse import (Reused, gather_rows, row_hashes, storage_bytes, values_digest,
                            whole_hash)
from .runtime.vmap_ops import (agree_min, dense_scatter_bases, unbatchable_collectives,
                               vmap_friendly)

__all__ = ["lean_compile", "LeanStep", "LeanModule", "ReuseWarning", "StepConfig", "StepStats", "StepReport", "SCHEDULES",
           "free_memory_bytes", "synchronize"]

log = logging.getLogger("leancompile")

SCHEDULES = ("auto", "retain", "reweight", "recompute")


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What ``lean_compile(fn, schedule=...)`` takes beyond the compile options."""

    schedule: str = "auto"
    """``retain``, ``reweight``, ``recompute`` (the baseline: nothing kept) or ``auto``."""
    sample_output: int | None = None
    """The output that is the sample the step draws (a step that samples inside)."""
    sample_arg: str | None = None
    """The keyword argument the update call passes that sample back in."""
    memory_budget_bytes: int | None = None
    """``auto``: bytes the kept state may take; None: ``memory_fraction`` of the free memory
    when the rollout starts."""
    memory_fraction: float = 0.5
    partitioner_budget: float | None = None
    """The min-cut partitioner's activation memory budget (0..1): below 1 the forward saves
    less and the backward recomputes cheap ops (what Retain keeps shrinks)."""
    reshard_after_forward: bool = False
    """Parameters the step all-gathers itself (FSDP-style, e.g. ``GRPOTrainer(parallel=
    "fsdp")`` or torchtitan's SimpleFSDP) are gathered again by the backward instead of saved
    full-size (``leancompile/passes/regather_params.py``), as ``fully_shard``'s
    ``reshard_after_forward=True``: what Retain keeps per call holds this rank's parts, not
    the full weights, at one more all-gather per backward. False: the partitioner saves the
    gathered weights (no collective in the backward but the gradients' own)."""
    reweight_rows: int | None = None
    """Reweight: rows per vectorised backward (``torch.func.vmap`` of the batch-1 backward over
    the rows); None: as many as the memory budget leaves room for (parameter gradients and
    working memory per row); 1: one backward per row."""
    zero_grads: bool = True
    """Reweight, one buffer per sample: an update call that completes no sample's buffer yet
    hands autograd zeros for the parameters' gradients (True: every backward reaches every
    parameter, which ``DistributedDataParallel``'s reducer requires) or nothing (False: no
    parameter-sized zeros written and added to ``.grad`` per call; for callers that read
    ``.grad`` only after the last update call, as ``GRPOTrainer`` does)."""
    defer_reductions: bool = False
    """Reweight with gradient reduce-scatters in the backward graph (``parallel="fsdp"``): the
    per-row backward runs without them (``passes/coalesced_sync.py``), so per-row gradients
    are full-size and rank-local; the weighted gradients of those parameters are not handed to
    autograd but summed for ``take_deferred_grads()``, whose caller reduces them once."""
    fallback: str = "recompute"
    """What an update call does when it cannot reuse what its rollout kept (rows regrouped
    across graphs, a fingerprint collision, a parameter change): ``"recompute"`` it (counted
    in ``stats.recomputed`` with the reason) or ``"raise"`` (for graphs that hold collectives,
    ``parallel="fsdp"``: a recompute on one rank would run gathers its peers do not)."""

    def __post_init__(self):
        if self.fallback not in ("recompute", "raise"):
            raise ValueError(f"fallback={self.fallback!r}; use 'recompute' or 'raise'")
        if self.defer_reductions and self.schedule == "auto":
            raise ValueError(
                "defer_reductions=True with schedule='auto': auto picks retain or reweight per "
                "call from this process's memory, so data-parallel ranks could run different "
                "collectives; pick the schedule for all ranks (retain or reweight)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; use one of {SCHEDULES}")
        if (self.sample_output is None) != (self.sample_arg is None):
            raise ValueError("sample_output and sample_arg go together: the output holding the "
                             "drawn sample and the keyword the update passes it back in")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r} must be "
                             "True or False")
        if self.reweight_rows is not None and self.reweight_rows < 1:
            raise ValueError(f"reweight_rows={self.reweight_rows} must be >= 1 (rows per "
                             "vectorised backward) or None (from the memory budget)")


@dataclass(kw_only=True)
class StepStats:
    """What the wrapper did: calls per phase, what it kept, reused and recomputed (with the
    reasons), memory and seconds per phase."""

    rollout_calls: int = 0
    trained_calls: int = 0
    kept: Counter = field(default_factory=Counter)
    """Trained rollout calls by what was kept: ``retain``, ``reweight``, or why nothing was."""
    kept_rows: int = 0
    update_calls: int = 0
    reused_calls: int = 0
    reused_rows: int = 0
    forwards_run: int = 0
    """Forward graphs run with gradients in the update phase: 0 when every update call was
    served from the rollout."""
    no_grad_calls: int = 0
    """Calls in the update phase under ``no_grad`` (a KL reference under
    ``disable_adapter()``, logging): run as plain inference, never reused, not in
    ``update_calls``."""
    recomputed: Counter = field(default_factory=Counter)
    """Update calls recomputed, by reason."""
    mechanisms: Counter = field(default_factory=Counter)
    """Reused update calls by how their backward runs: ``whole kept calls`` (the rollout's
    batches as they were), ``gathered rows`` (a regrouped batch), ``per-row gradients``."""
    gather_seconds: float = 0.0
    gathered_bytes: int = 0
    peak_kept_bytes: int = 0
    """Activation bytes kept at the peak (storages not shared with inputs or parameters)."""
    peak_buffer_bytes: int = 0
    """Bytes of per-row gradient buffers at the peak (``reweight``), with the corrected
    full-size gradients held back for a later reduction (``defer_reductions``)."""
    reweight_backwards: int = 0
    """Backwards run in the rollout for per-row gradients (one per vectorised chunk of rows)."""
    reweight_rows_per_backward: int = 0
    """The most rows one of those backwards took (1: one backward per row)."""
    reweight_unbatched: str = ""
    """Why per-row gradients ran one backward per row although the rows were apart ("" if
    they did not, or batched)."""
    reweight_fused_steps: int = 0
    """Vectorised backwards that added into their samples' gradient buffers in place (every
    trained step of a sample after its first, when its rows come in the same chunks)."""
    backward_graphs_run: int = 0
    """Runs of the step's compiled backward graph (recompute's and Retain's backwards)."""
    reweight_inplace_matmuls: int = 0
    """Weight gradients of such a backward computed as an in-place ``baddbmm_`` into the
    buffer (``aot_eager``); the others are added with ``add_``."""
    unused_rows: int = 0
    unused_bytes: int = 0
    """Kept rows (and their bytes) that no update call used, freed at ``update()`` exit or at
    the next rollout."""
    rollout_seconds: float = 0.0
    update_seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"rollout: {self.rollout_calls} calls, {self.trained_calls} trained, kept "
                 f"{dict(self.kept)} ({self.kept_rows} rows), peak "
                 f"{self.peak_kept_bytes / 2**20:.2f} MiB activations, "
                 f"{self.peak_buffer_bytes / 2**20:.2f} MiB gradient buffers, "
                 f"{self.rollout_seconds:.3f} s",
                 f"update: {self.update_calls} calls, {self.reused_calls} reused "
                 f"({self.reused_rows} rows; {dict(self.mechanisms)}), forwards run "
                 f"{self.forwards_run}, {self.no_grad_calls} no-grad calls, "
                 f"{self.update_seconds:.3f} s"]
        for reason, count in self.recomputed.items():
            lines.append(f"  recomputed {count} x: {reason}")
        if self.gathered_bytes:
            lines.append(f"  regrouped rows: {self.gathered_bytes / 2**20:.2f} MiB gathered in "
                         f"{self.gather_seconds:.3f} s")
        if self.reweight_unbatched:
            lines.append(f"  per-row gradients one row at a time: {self.reweight_unbatched}")
        if self.unused_rows:
            lines.append(f"  never used: {self.unused_rows} kept rows "
                         f"({self.unused_bytes / 2**20:.2f} MiB), freed")
        return "\n".join(lines)


@dataclass(kw_only=True)
class StepReport:
    """What ``leancompile.explain(step, *args)`` returns: per graph a call runs, what each
    schedule would keep for a call like this one, and the pipeline's report of the graphs
    (their ``lean_grpo`` stage)."""

    schedule: str
    batch: int
    budget_bytes: int
    graphs: list[dict]
    reports: list

    def __str__(self) -> str:
        mib = 2 ** 20
        lines = [f"LeanStep schedule={self.schedule!r}, a call of {self.batch} rows; auto's "
                 f"memory budget {self.budget_bytes / mib:.1f} MiB"]
        for i, g in enumerate(self.graphs):
            lines.append(f"graph {i}: retain keeps {g['kept_bytes'] / mib:.2f} MiB per call "
                         "of activations beyond its inputs")
            lines.append("  regrouped rows: " + (
                "gathered row by row (the LeanGRPO stage proved the saved tensors hold "
                "samples' rows apart)" if g["row_local"] else
                f"only whole kept calls serve an update call ({g['reason']})"))
            lines.append("  reweight: " + (
                f"one gradient per row of outputs {g['scalars']} "
                f"({g['grad_bytes'] / mib:.2f} MiB each; per sample with samples=), "
                f"{g['rows_per_backward']} row(s) per vectorised backward"
                if g["scalars"] else "no per-row scalar output (wrap the whole step)"))
            if g["random_ops"]:
                lines.append(f"  draws random numbers ({', '.join(g['random_ops'][:2])}): only "
                             "recompute")
            if g["kept_bytes"]:
                lines.append(f"  auto: about {self.budget_bytes // g['kept_bytes']} such calls "
                             "retained within the budget, then reweight or recompute")
        for report in self.reports:
            lines.append(str(report))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Which rollout calls are trained


class _Train:
    """``train`` of ``rollout()``: None (every call, every row), an int n (the first n calls),
    a container of call indices, a bool tensor ``[calls]`` or ``[calls, rows]``, or a callable
    ``f(call_index) -> bool | bool tensor [rows] | None``."""

    def __init__(self, spec):
        if not (spec is None or callable(spec) or isinstance(spec, (int, Tensor))
                or hasattr(spec, "__contains__")):
            raise TypeError(f"train={spec!r}: pass None, an int, call indices, a bool tensor "
                            "[calls] or [calls, rows], or a function of the call index")
        if isinstance(spec, Tensor) and (spec.dtype != torch.bool or spec.dim() not in (1, 2)):
            raise ValueError(f"train tensor must be bool [calls] or [calls, rows], got "
                             f"{spec.dtype} {tuple(spec.shape)}")
        self.spec = spec

    def rows(self, index: int, batch: int) -> list[int] | None:
        spec = self.spec
        if spec is None:
            value = True
        elif isinstance(spec, bool):
            value = spec
        elif isinstance(spec, int):
            value = index < spec
        elif isinstance(spec, Tensor):
            value = spec[index] if index < spec.shape[0] else False
        elif callable(spec):
            value = spec(index)
        else:
            value = index in spec
        if value is None or value is False:
            return None
        if value is True:
            return list(range(batch))
        if isinstance(value, Tensor) and value.dim() == 0:
            return list(range(batch)) if bool(value) else None
        mask = torch.as_tensor(value, dtype=torch.bool).flatten()
        if mask.numel() != batch:
            raise ValueError(f"train selects rows with a mask of {mask.numel()} entries for a "
                             f"call of {batch} rows (call {index})")
        rows = mask.nonzero().flatten().tolist()
        return rows or None


# ---------------------------------------------------------------------------------------------
# Kept state


@dataclass(eq=False, kw_only=True)
class _Kept:
    """One trained rollout call: its inputs, outputs and what the schedule kept."""

    runtime: "_GraphRuntime"
    mode: str
    args: list
    batch: int
    outputs: list
    saved: list | None
    grads: dict
    rows: list[int]
    used: set = field(default_factory=set)
    versions: dict = field(default_factory=dict)
    symbols: dict = field(default_factory=dict)
    nbytes: int = 0
    samples: list | None = None
    """Reweight: the sample of each row when the rollout named them (buffers per sample)."""
    watched: list = field(default_factory=list)
    """(tensor, version) of its outputs and tensor inputs (parameters aside) as the rollout
    left them: the saved tensors may be views of them."""
    keys: list = field(default_factory=list)
    """The keys its rows are indexed under (``_State.index``)."""

    def changed(self) -> bool:
        """Whether the caller changed an output or input of this call in place since."""
        return any(t._version != v for t, v in self.watched)


class _State:
    def __init__(self, config: StepConfig):
        self.config = config
        self.phase: str | None = None
        self.train = _Train(None)
        self.trajectory_steps: int | None = None
        """``rollout(trajectory_steps=T)``: ``train`` is asked about ``call_index % T``."""
        self.call_index = 0
        self.current: list[int] | None = None
        self.index: dict = {}
        self.kept: list[_Kept] = []
        self.kept_bytes = 0
        self.buffer_bytes = 0
        self.budget = 0
        self.reached = False
        self.grad_mode = False
        """Whether the caller had gradients enabled (the compiled entry always runs with them
        on: ``LeanStep.__call__``)."""
        self.schedule = config.schedule
        self.samples = None
        self.current_samples: list[int] | None = None
        self.sample_grads: dict = {}
        """Reweight with ``samples``: (sample, output) -> {parameter source: summed gradient}."""
        self.deferred: dict = {}
        """``defer_reductions``: id(parameter) -> (parameter, summed full-size gradient); kept
        across rollouts and updates until ``take_deferred_grads()``."""
        self.held_bytes = 0
        """Bytes of the ``deferred`` gradients."""
        self.sample_blocks: dict = {}
        """Reweight with ``samples``: (samples, output) -> {parameter source: [len(samples),
        *shape] block}, whose slices are those samples' ``sample_grads``."""
        self.sample_rows: Counter = Counter()
        """Reweight with ``samples``: trained rows kept per sample."""
        self.arrived: dict = {}
        """Reweight with ``samples``: sample -> the cotangents its rows brought so far."""
        self.claimed: dict = {}
        """Reweight with ``samples``: sample -> the kept (call, row) pairs update calls have
        served (a step served twice cannot be: the buffer holds each step once)."""
        self.graphs_called: list = []
        self.stats = StepStats()
        self.stale: str | None = None
        """Why nothing is kept any more, when the parameters changed after the rollout."""
        self._step_hook = None
        self.digest_ids: set[int] = set()
        self.digest: tuple | None = None
        """(trainable parameters, ``values_digest`` of them) at the first kept call of each graph
        that reads them:
        compared by each update call, for writes through ``.data`` (manual SGD, an EMA copied
        in) that neither version counters nor the optimizer hook see."""

    def watch_optimizers(self) -> None:
        """While something is kept: any ``optimizer.step()`` over a kept call's parameters
        makes it stale: fused and 8-bit optimizers change parameters without bumping the
        version counters ``_versions`` compares (writes through ``.data`` outside an optimizer:
        ``digest``)."""
        if self._step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            # (a weak reference: a step dropped between its rollout and update is freed with
            # what it kept; its hook then does nothing)
            this = weakref.ref(self)

            def after_step(optimizer, args, kwargs):
                state = this()
                if state is not None:
                    state._after_step(optimizer, args, kwargs)

            self._step_hook = register_optimizer_step_post_hook(after_step)

    def unwatch_optimizers(self) -> None:
        """(Never from inside the hook: torch iterates its hooks while calling them.)"""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not self.kept:
            return
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(kept.args[i]) in stepped for kept in self.kept for i in kept.runtime.params):
            self.clear()
            self.stale = (f"the parameters changed since the rollout ({type(optimizer).__name__}"
                          ".step() ran): kept state is stale")

    def add(self, kept: _Kept, keys: list) -> None:
        self.watch_optimizers()
        self.kept.append(kept)
        self.index_rows(kept, keys)
        if kept.mode == "retain":
            self.kept_bytes += kept.nbytes
            self.stats.peak_kept_bytes = max(self.stats.peak_kept_bytes, self.kept_bytes)
        else:
            self.buffer_bytes += kept.nbytes
            self.note_peak()
        self.stats.kept[kept.mode] += 1
        self.stats.kept_rows += len(kept.rows)

    def index_rows(self, kept: _Kept, keys: list) -> None:
        """Make ``kept``'s trained rows findable by their keys (one per row)."""
        for row in kept.rows:
            self.index.setdefault(keys[row], []).append((kept, row))
            kept.keys.append(keys[row])

    def note_peak(self) -> None:
        self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes,
                                           self.buffer_bytes + self.held_bytes)

    def release(self, kept: _Kept) -> None:
        """Forget ``kept`` (the backward closures of update calls may still hold its tensors
        until they run)."""
        if kept not in self.kept:
            return
        self.kept.remove(kept)
        for key in set(kept.keys):
            entries = [e for e in self.index.get(key, ()) if e[0] is not kept]
            if entries:
                self.index[key] = entries
            else:
                self.index.pop(key, None)
        if kept.mode == "retain":
            self.kept_bytes -= kept.nbytes
        else:
            self.buffer_bytes -= kept.nbytes

    def pending_samples(self) -> list:
        """Samples some of whose rows reached the update, not all (their merged gradient waits
        for the rest)."""
        return sorted(s for s, got in self.arrived.items() if 0 < len(got) < self.sample_rows[s])

    def clear(self) -> None:
        self.sample_grads.clear()
        self.sample_blocks.clear()
        self.sample_rows.clear()
        self.arrived.clear()
        for kept in list(self.kept):
            unused = [r for r in kept.rows if r not in kept.used]
            if unused:
                self.stats.unused_rows += len(unused)
                self.stats.unused_bytes += kept.nbytes * len(unused) // max(len(kept.rows), 1)
        self.kept.clear()
        self.index.clear()
        self.kept_bytes = self.buffer_bytes = 0
        self.digest = None
        self.digest_ids = set()
        self.claimed.clear()


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now (the CPU: available physical memory). On CUDA: the
    device's free memory and what PyTorch's caching allocator holds unused (freed tensors it
    keeps for reuse: what an earlier rollout kept is free again after its update)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


def _readable(source: str) -> str:
    """A Dynamo source as a user names it: ``L['self']._modules['fc']._parameters['weight']``
    -> ``self.fc.weight``."""
    text = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", source)
    text = re.sub(r"^G\['__import_[^']*'\]\.", "", text)
    text = re.sub(r"^[LG]\['([^']*)'\]", r"\1", text)
    # (the wrapper's own entry passes the user's function as fn, and keywords as kwargs)
    text = re.sub(r"^fn\.__closure__\[\d+\]\.cell_contents\.", "", text)
    return re.sub(r"^kwargs\['([^']*)'\]", r"\1", text)


def synchronize(device: torch.device | None = None) -> None:
    """Wait until ``device`` (None: the current CUDA device, if CUDA was used) has run the work
    queued on it, so that a host clock read next times that work: CUDA kernels run after
    the Python that launched them has returned; the host runs its own at once."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# One Dynamo graph at run time


class _GraphRuntime:
    """The compiled function Dynamo calls for one graph of the wrapped function."""

    def __init__(self, step: "LeanStep", graphs: StepGraphs):
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
        self._at_one: tuple | None = None
        self._vmap_backward: fx.GraphModule | None = None
        self._unbatchable_reason: str | None = None
        self._exchanges: list[str] | None = None
        self._row_backwards: dict = {}
        self._inplace_matmuls = 0
        self._deferred_outputs: set[int] = set()
        self._unreduced: fx.GraphModule | None = None
        """Reweight's compiled per-row backwards, by (number of rows, output, sizes)."""
        self._rows_like: dict[str, int] = {}
        """For a graph specialised to a batch of 1: the rows per sample of each input, from the
        kept graph with a symbolic batch that computes the same (``_fingerprint_for``)."""

    # -- entry -------------------------------------------------------------------------------
    def __call__(self, *args):
        state = self.step._state
        state.reached = True
        state.graphs_called.append(self.g)
        args = list(args)
        grad = state.grad_mode
        if state.phase == "plan":  # compiled, not run: outputs of the right metadata
            return self._finish(_empty_outputs(self.g), args)
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
        return self._plain(args, grad)

    # -- helpers -----------------------------------------------------------------------------
    def _check_frozen(self, args) -> None:
        """Refuse a call where an input that did not require grad when the graphs were traced
        now does: their backward has no gradient for it. Dynamo recompiles for such a change
        of an input's ``requires_grad``, but torch 2.11 does not for a parameter read from a
        module (plain ``torch.compile`` there leaves its ``.grad`` empty)."""
        changed = [_readable(self.g.roles[i].source) for i in self.g.traced_frozen
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

    def _batch(self, args) -> int:
        for i, role in enumerate(self.g.roles):
            if role.batch_rows:
                return args[i].shape[0] // role.batch_rows
        return self.step._state_batch or 1

    def _rows_of_input(self, i: int) -> int:
        role = self.g.roles[i]
        return role.batch_rows or self._rows_like.get(role.source, 0)

    def _finish(self, outputs, args) -> tuple:
        out = list(outputs)
        for j, kind in enumerate(self.g.output_types):
            if kind == "input":
                out[j] = args[self.g.output_bases[j]]
        return tuple(out)

    def _symbols(self, args) -> dict:
        return {sym: int(args[i]) for i, sym in self.symbol_inputs.items()}

    def _versions(self, args) -> dict:
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
            grads = self._backward([saved[k] for k in g.bw_saved], outputs, cotangents)
            return [grads[i] for i in inputs]

        results = Reused.apply(backward_fn, outputs, *[args[i] for i in inputs])
        return self._finish(results, args)

    def _tangents(self, outputs, cotangents) -> list:
        """The backward graph's tangent inputs: the differentiable outputs' cotangents
        (zeros where none)."""
        tangents = []
        for j in self.g.differentiable:
            c = cotangents[j] if j < len(cotangents) else None
            tangents.append(torch.zeros_like(outputs[j]) if c is None else c.contiguous())
        return tangents

    def _backward(self, bw_saved, outputs, cotangents) -> list:
        tangents = self._tangents(outputs, cotangents)
        self.step._state.stats.backward_graphs_run += 1
        with torch.no_grad():
            return list(self.g.run_backward(list(bw_saved) + tangents))

    # -- keys ------------------------------------------------------------------------------
    def keys(self, args, batch: int, fingerprint, inputs=None) -> list:
        """One key per row: what the computation is and what its inputs hold for that row."""
        parts = []
        for i in (self.g.key_inputs if inputs is None else inputs):
            if i == self.sample_input or i in self.batch_symint:
                continue
            role, value = self.g.roles[i], args[i]
            if self._rows_of_input(i):
                parts.append((role.source, row_hashes(value, batch)))
            elif isinstance(value, Tensor):
                parts.append((role.source, [whole_hash(value)] * batch))
            else:
                parts.append((role.source, [value] * batch))
        parts.sort(key=lambda p: p[0])
        return [hash((fingerprint, tuple((source, h[r]) for source, h in parts)))
                for r in range(batch)]

    def _same_row(self, args, row, kept: _Kept, kept_row) -> bool:
        """Confirm a fingerprint match value by value."""
        kroles = {r.source: i for i, r in enumerate(kept.runtime.g.roles)}
        for i in self.g.key_inputs:
            if i == self.sample_input or i in self.batch_symint:
                continue
            role = self.g.roles[i]
            k = kroles.get(role.source)
            if k is None:
                return False
            mine, theirs = args[i], kept.args[k]
            if self._rows_of_input(i):
                n = self._rows_of_input(i)
                if not torch.equal(mine[row * n:(row + 1) * n],
                                   theirs[kept_row * n:(kept_row + 1) * n]):
                    return False
            elif isinstance(mine, Tensor):
                if not (isinstance(theirs, Tensor) and mine.shape == theirs.shape
                        and mine.dtype == theirs.dtype and torch.equal(mine, theirs)):
                    return False
            elif mine != theirs:
                return False
        if self.sample_input is not None:
            j = kept.runtime.step.config.sample_output
            sample = kept.outputs[j]
            mine = args[self.sample_input]
            rows = mine.shape[0] // self._batch(args)
            if not torch.equal(mine[row * rows:(row + 1) * rows],
                               sample[kept_row * rows:(kept_row + 1) * rows]):
                return False
        return True

    # -- rollout ---------------------------------------------------------------------------
    def _rollout(self, args, train_rows: list[int], grad: bool):
        """A trained rollout call. Under ``torch.inference_mode()`` (or with inference tensors
        among its inputs) it runs with inference mode off, on copies of those inputs: what it
        keeps must be normal tensors, whose version counters show an in-place edit by the
        caller (inference tensors have none); the outputs are normal tensors."""
        if torch.is_inference_mode_enabled() or any(
                isinstance(a, Tensor) and a.is_inference() for a in args):
            with torch.inference_mode(False):
                args = [a.clone() if isinstance(a, Tensor) and a.is_inference() else a
                        for a in args]
                return self._rollout_kept(args, train_rows, grad)
        return self._rollout_kept(args, train_rows, grad)

    def _rollout_kept(self, args, train_rows: list[int], grad: bool):
        state, g = self.step._state, self.g
        if grad:
            raise ValueError("the rollout's trained calls must run under torch.no_grad() (their "
                             "outputs carry no autograd graph: the update gets the gradients)")
        schedule = state.schedule
        if g.random_ops and schedule != "recompute":
            raise RandomOpInGraphError(
                f"the wrapped step draws random numbers ({', '.join(g.random_ops[:3])}): an "
                "update's forward would not repeat the rollout's, so nothing can be reused. "
                "Call model.eval() (dropout), pass the noise in as an argument (a step that "
                "samples), or use schedule='recompute'")
        if g.sample_grad_outputs and schedule != "recompute":
            j = self.step.config.sample_output
            raise ValueError(
                f"the wrapped step's drawn sample (output {j}, sample_output={j}) carries "
                f"gradient into output(s) {g.sample_grad_outputs}: the rollout's backward "
                "differentiates through the sample, while the update, which passes it back in "
                f"{self.step.config.sample_arg}=, holds it constant, so reusing the rollout "
                "would give other gradients. Detach the drawn sample where the step reads it "
                "(FlowGRPO and DanceGRPO compute the log-prob from prev_sample.detach()), or use "
                "schedule='recompute'")
        batch = self._batch(args)
        train_rows = [r for r in train_rows if r < batch]
        state.stats.trained_calls += 1
        mode, why = self._choose(args, batch, train_rows)
        if mode is None:
            state.stats.kept[why] += 1
            return self._plain(args, False)
        with torch.no_grad():
            full = list(g.run_forward(args))
        outputs, saved = full[:g.num_outputs], full[g.num_outputs:]
        kept = _Kept(runtime=self, mode=mode, args=args, batch=batch, outputs=outputs,
                     saved=saved if mode == "retain" else None, grads={}, rows=train_rows,
                     versions=self._versions(args), symbols=self._symbols(args))
        params = [a for a in args if isinstance(a, Tensor)]
        if mode == "retain":
            kept.nbytes = storage_bytes(saved, exclude=params)
        else:
            kept.saved = saved  # read while the per-row gradients are taken, then dropped
            before = _buffer_bytes(state)
            kept.samples = state.current_samples
            self._row_gradients(kept, saved)
            kept.saved = None
            kept.nbytes = sum(t.numel() * t.element_size()
                              for key, grads in kept.grads.items() if isinstance(key, tuple)
                              for t in grads.values() if t is not None) + \
                _buffer_bytes(state) - before
        kept.watched = [(t, t._version) for i, t in enumerate(list(args) + outputs)
                        if isinstance(t, Tensor) and i not in self.params]
        trainable = [args[i] for i in self.params if args[i].requires_grad]
        new = [p for p in trainable if id(p) not in state.digest_ids]
        if new:  # (each graph's own: two experts chosen by step are two graphs)
            state.digest_ids.update(id(p) for p in new)
            params, digest = state.digest or ([], None)
            added = values_digest(new)
            state.digest = (params + new, added if digest is None else
                            torch.cat([digest, added.to(digest.device)]))
        keys = self.keys(args, batch, g.fingerprint)
        state.add(kept, keys)
        if g.sample_fingerprint:  # an update passing the drawn sample back matches these keys
            state.index_rows(kept, self.keys(args, batch, g.sample_fingerprint,
                                             g.sample_key_inputs))
        return self._finish(outputs, args)

    def scalar_outputs(self, outputs, batch: int) -> list[int]:
        """Differentiable outputs holding one value per row: what reweight keeps gradients of
        (by the traced shape: an output that does not depend on the batch is not one, even
        when its length equals this call's batch size)."""
        return [j for j in self.g.differentiable
                if isinstance(outputs[j], Tensor) and outputs[j].numel() == batch
                and outputs[j].dim() >= 1 and outputs[j].shape[0] == batch
                and _numel_per_row(self.g, j, batch) == 1]

    def _choose(self, args, batch, rows) -> tuple[str | None, str]:
        state, g = self.step._state, self.g
        schedule = state.schedule
        if schedule == "recompute":
            return None, "nothing (schedule='recompute')"
        fake_scalar = [j for j in g.differentiable
                       if g.forward is not None and _numel_per_row(g, j, batch) == 1]
        if schedule == "reweight":
            if not fake_scalar:
                raise ValueError(
                    "schedule='reweight' keeps one gradient per row of a per-row scalar output "
                    "(a log-prob), and the wrapped function returns none (outputs "
                    f"{[tuple(_shape(g, j)) for j in range(g.num_outputs)]}): wrap the whole "
                    "step (velocity + SDE + log-prob), or use schedule='retain'")
            return "reweight", ""
        if schedule == "retain":
            return "retain", ""
        # auto: retain while the kept activations fit, then reweight, else nothing.
        estimate = g.kept_bytes(batch)
        if state.kept_bytes + estimate <= state.budget:
            return "retain", ""
        grad_bytes = sum(args[i].numel() * args[i].element_size() for i in self.params
                         if args[i].requires_grad)
        if fake_scalar:
            samples = state.current_samples
            new = len(rows) if samples is None else len(
                {samples[r] for r in rows} - {s for s, _ in state.sample_grads})
            buffers = new * len(fake_scalar) * grad_bytes
            if state.buffer_bytes + buffers <= state.budget - state.kept_bytes:
                return "reweight", ""
        return None, (f"nothing (auto: {estimate} more bytes would exceed the memory budget of "
                      f"{state.budget} bytes)")

    def _row_gradients(self, kept: _Kept, saved: list) -> None:
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

    def _chunk_samples(self, kept: _Kept, rows: list[int]) -> tuple | None:
        """The samples of ``rows`` when the rollout named them, each once; else None."""
        if kept.samples is None:
            return None
        samples = tuple(kept.samples[r] for r in rows)
        return samples if len(set(samples)) == len(samples) else None

    def _new_block(self, kept: _Kept, rows: list[int], q: int, stacked: dict) -> bool:
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

    def _accumulate_rows(self, kept: _Kept, rows: list[int], q: int, trainable: list) -> bool:
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

    def _keep_row_grads(self, kept: _Kept, row: int, q: int, row_grads: dict) -> None:
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

    def rows_per_backward(self, kept: _Kept) -> int:
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
                if node.op == "call_function" and node.target in _SLICES:
                    args = list(node.args)
                    end = _SLICES[node.target]
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

    def _vmapped_row_gradients(self, kept: _Kept, rows: list[int], q: int,
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

    def _row_backward(self, kept: _Kept, q: int, trainable: list, inputs: list, *,
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
        sizes = {k: _saved_size(g, k, symbols) for k in g.bw_saved if layouts[k] == "symint"}
        tangent_shapes = [(_row_shape(kept.outputs[j], g.layouts["outputs"][j], kept.batch),
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

    # -- gathering -------------------------------------------------------------------------
    def _runs(self, assignment):
        """Consecutive rows from one kept call, as (kept, [rows])."""
        runs = []
        for kept, row in assignment:
            if runs and runs[-1][0] is kept:
                runs[-1][1].append(row)
            else:
                runs.append((kept, [row]))
        return runs

    def _gathered_saved(self, runs, total: int) -> list:
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
                values.append(_saved_size(g, k, symbols))
            elif layout is None:
                values.append(first.saved[k])
            else:
                tensor = gather_rows([(kept.saved[k], kept.batch, rows) for kept, rows in runs],
                                     layout.outer, layout.inner)
                tensor = _as_traced(tensor, g.saved_meta[k], symbols)
                self.step._state.stats.gathered_bytes += tensor.numel() * tensor.element_size()
                values.append(tensor)
        self.step._state.stats.gather_seconds += time.perf_counter() - start
        return values

    def _gather_output(self, j, runs):
        layout = self.g.layouts["outputs"][j]
        first = runs[0][0]
        if layout is None or layout == "symint":
            return first.outputs[j]
        return gather_rows([(kept.outputs[j], kept.batch, rows) for kept, rows in runs],
                           layout.outer, layout.inner)

    # -- update ------------------------------------------------------------------------------
    def _update(self, args):
        state = self.step._state
        state.stats.update_calls += 1
        assignment, reason = self._match(args)
        if assignment is None:
            if state.kept:  # (a parameter change frees everything: recomputed everywhere)
                return self._fallback(args, reason)
            return self._recompute(args, reason)
        return self._reuse(args, assignment)

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

    def _match(self, args):
        state, g = self.step._state, self.g
        if not state.kept:
            return None, state.stale or "nothing kept (not a trained rollout call, or already " \
                "freed)"
        if any(isinstance(a, Tensor) and a.requires_grad for i, a in enumerate(args)
               if g.roles[i].kind != "param"):
            return None, "an input of the update call requires grad"
        versions = self._versions(args)
        if state.digest is not None and not torch.equal(values_digest(state.digest[0]),
                                                        state.digest[1]):
            counted = any(k.versions.get(s, v) != v for k in state.kept
                          for s, v in versions.items())
            state.clear()
            state.stale = "the parameters changed since the rollout (" + (
                "an optimizer step, or an in-place change" if counted else
                "their values, not their version counters: written through .data outside an "
                "optimizer") + "): kept state is stale"
            return None, state.stale
        batch = self._batch(args)
        keys = self.keys(args, batch, self._fingerprint_for(args, batch))
        assignment = []
        for row, key in enumerate(keys):
            candidates = state.index.get(key, [])
            if not candidates:
                return None, self._why_not(args, row)
            # Rows not yet used first, by this call either (two samples with equal rows, as
            # DanceGRPO's shared initial noise makes at its first step, each get their own);
            # the first that is fresh, unedited and equal value by value serves.
            taken = {(id(k), r) for k, r in assignment}
            ordered = sorted(candidates,
                             key=lambda c: ((id(c[0]), c[1]) in taken, c[1] in c[0].used))
            found, stale, edited = None, 0, 0
            for c in ordered:
                if any(s in c[0].versions and c[0].versions[s] != v
                       for s, v in versions.items()):
                    stale += 1
                elif c[0].changed():
                    edited += 1
                elif self._same_row(args, row, *c):
                    found = c
                    break
            if found is None and stale == len(candidates):
                state.clear()
                return None, ("the parameters changed since the rollout (an optimizer step, an "
                              "in-place change, or requires_grad set or cleared): kept state is "
                              "stale")
            if found is None and edited and stale + edited == len(candidates):
                return None, ("an output or input of the kept rollout call was changed in place "
                              "after the rollout (what it kept may be views of them): clone "
                              "before editing, e.g. v = v * dt instead of v.mul_(dt)")
            if found is None:
                return None, f"row {row}: inputs not seen in the rollout (fingerprint collision)"
            assignment.append(found)
        return assignment, ""

    def _fingerprint_for(self, args, batch: int):
        """This graph's fingerprint; for a graph Dynamo specialised to a batch of 1, the
        fingerprint of the kept graph (with a symbolic batch) that computes the same at 1."""
        g, state = self.g, self.step._state
        if g.batch_symbol is not None or batch != 1:
            return g.fingerprint
        for kept in state.kept:
            runtime = kept.runtime
            if g.fingerprint in (runtime.g.fingerprint, runtime.g.sample_fingerprint):
                self._rows_like = {r.source: r.batch_rows for r in runtime.g.roles
                                   if r.batch_rows}
                return g.fingerprint
        for kept in state.kept:
            runtime = kept.runtime
            if runtime.g.batch_symbol is None:
                continue
            if runtime._at_one is None:
                runtime._at_one = runtime.g.fingerprints_at(runtime._one_row(kept))
            full, sample = runtime._at_one
            if g.fingerprint in (full, sample):
                self._rows_like = {r.source: r.batch_rows for r in runtime.g.roles
                                   if r.batch_rows}
                return runtime.g.fingerprint if g.fingerprint == full else \
                    runtime.g.sample_fingerprint
        return g.fingerprint

    def _one_row(self, kept: _Kept) -> list:
        """``kept``'s inputs cut to its first row (sizes of the batch set to 1)."""
        args = []
        for i, (role, value) in enumerate(zip(self.g.roles, kept.args)):
            if role.batch_rows:
                args.append(value[:role.batch_rows])
            elif i in self.batch_symint:
                args.append(1)
            else:
                args.append(value)
        return args

    def _why_not(self, args, row) -> str:
        state, g = self.step._state, self.g
        same_graph = [k for k in state.kept if k.runtime.g.fingerprint == g.fingerprint or (
            k.runtime.g.sample_fingerprint and k.runtime.g.sample_fingerprint == g.fingerprint)]
        if not same_graph:
            return ("no kept rollout call computes the same function (another graph: a changed "
                    "module state such as a disabled adapter, training mode, autocast, a hook added "
                    "or removed, or other "
                    "argument types)" + self._sample_hint())
        return f"row {row}: inputs not seen in the rollout"

    def _sample_hint(self) -> str:
        """Where the update's call takes a tensor argument no kept call took, and the kept
        ones one it does not (``prev_sample=`` where the rollout passed ``noise=``), and no
        sample is configured: how to name the sample."""
        if self.step.config.sample_arg is not None:
            return ""
        def keywords(roles):  # (a sample_arg is a keyword argument)
            names = {_readable(r.source) for r in roles if r.kind == "tensor"}
            return {n for n in names if n.isidentifier()}

        mine = keywords(self.g.roles)
        theirs = set().union(*[keywords(k.runtime.g.roles) for k in self.step._state.kept])
        new, gone = sorted(mine - theirs), sorted(theirs - mine)
        if len(new) != 1 or not gone:
            return ""
        return (f"; this call passes {_readable(new[0])}, the rollout's passed "
                f"{_readable(gone[0])}: for a step that draws its sample inside, name it with "
                "lean_compile(..., sample_output=<the sample's index among the outputs>, "
                f"sample_arg={_readable(new[0])!r})")

    def _reuse(self, args, assignment):
        state, g = self.step._state, self.g
        batch = len(assignment)
        runs = self._runs(assignment)
        kept_graph = runs[0][0].runtime
        layouts = kept_graph.g.layouts
        if any(k.runtime.g.bw_saved != kept_graph.g.bw_saved or k.runtime.g.layouts != layouts
               for k, _ in runs):
            return self._fallback(args, "rows kept by different graphs")
        whole = all(rows == list(range(k.batch)) for k, rows in runs) and \
            len({id(k) for k, _ in runs}) == len(runs)
        row_local = bool(layouts.get("row_local"))
        splittable = all(lay is None or lay == "symint" or hasattr(lay, "outer")
                         for lay in layouts.get("outputs", [object()] * g.num_outputs))
        if not (row_local or (whole and (len(runs) == 1 or splittable))):
            reason = layouts.get("reason") or "the LeanGRPO stage did not run"
            return self._fallback(args, f"rows regrouped, and {reason}")
        outputs = []
        kept_storages = {o.untyped_storage().data_ptr() for kept, _ in runs
                         for o in kept.outputs if isinstance(o, Tensor)}
        for j in range(g.num_outputs):
            if g.output_types[j] == "input":
                outputs.append(args[g.output_bases[j]])
                continue
            out = runs[0][0].outputs[j] if len(runs) == 1 and whole else \
                kept_graph._gather_output(j, runs)
            # A copy, never the kept tensor (or a view of it): an in-place edit of the served
            # output (v.mul_(dt)) would rewrite the rollout's output the caller holds and what
            # the backward reads.
            if isinstance(out, Tensor) and out.untyped_storage().data_ptr() in kept_storages:
                out = out.clone()
            outputs.append(out)
        for kept, row in assignment:
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
        for kept, rows in runs:
            kept.used.update(rows)
            if set(kept.rows) <= kept.used:
                state.release(kept)
        trainable = [i for i in self.params if args[i].requires_grad]
        sources = [g.roles[i].source for i in trainable]
        retain = [(i, a) for i, a in enumerate(assignment) if a[0].mode == "retain"]
        reweight = [(i, a) for i, a in enumerate(assignment) if a[0].mode == "reweight"]
        state.stats.mechanisms["per-row gradients" if not retain else
                               "whole kept calls" if whole else "gathered rows"] += 1
        state.stats.reused_calls += 1
        state.stats.reused_rows += batch
        out_layouts = layouts.get("outputs")

        differentiable = set(g.differentiable)

        def backward_fn(cotangents):
            # An output the update's own graph does not differentiate (the sample passed back
            # in: a constant there, differentiable in a rollout graph that drew it) brings no
            # gradient, whatever the kept graph would make of its cotangent.
            cotangents = [c if j in differentiable else None for j, c in enumerate(cotangents)]
            total: dict[str, Tensor] = {}

            def add(grads: dict):
                for source, gr in grads.items():
                    if gr is not None and source in sources:
                        total[source] = gr if source not in total else total[source] + gr

            if retain:
                retain_runs = self._runs([a for _, a in retain])
                update_rows = [i for i, _ in retain]
                if whole:
                    offset = 0
                    for n, (kept, rows) in enumerate(retain_runs):
                        mine = update_rows[offset:offset + len(rows)]
                        offset += len(rows)
                        # An output that does not depend on the batch is the same value in
                        # every kept call: its cotangent goes into one backward, not each.
                        cots = [None if n and _batch_independent(out_layouts, j) else
                                _rows_of(c, out_layouts, j, batch, mine)
                                for j, c in enumerate(cotangents)]
                        kg = kept.runtime
                        grads = kg._backward([kept.saved[k] for k in kg.g.bw_saved],
                                             kept.outputs, cots)
                        add({kg.g.roles[i].source: grads[i] for i in kg.params})
                else:
                    kg = retain_runs[0][0].runtime
                    bw_saved = kg._gathered_saved(retain_runs, len(update_rows))
                    outs = [kg._gather_output(j, retain_runs) for j in range(g.num_outputs)]
                    cots = [_rows_of(c, out_layouts, j, batch, update_rows)
                            for j, c in enumerate(cotangents)]
                    grads = kg._backward(bw_saved, outs, cots)
                    add({kg.g.roles[i].source: grads[i] for i in kg.params})
            if reweight:
                scalars = set()
                for _, (kept, _) in reweight:
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
                for i, (kept, row) in reweight:
                    weights = {q: (cotangents[q].reshape(batch, -1)[i].sum()
                                   if cotangents[q] is not None else None) for q in scalars}
                    if kept.samples is not None:
                        add(self._merged(kept.samples[row], weights))
                        continue
                    for q, weight in weights.items():
                        if weight is not None:
                            add({source: None if gr is None else gr * weight
                                 for source, gr in kept.grads[(row, q)].items()})
            deferred = kept_graph._deferred_outputs if reweight else set()
            for s, i in zip(sources, trainable):
                if i in deferred and s in total:
                    grad = total.pop(s)
                    held = state.deferred.get(id(args[i]))
                    # (the held sum is this runtime's own tensor: added to in place)
                    state.deferred[id(args[i])] = (args[i], grad if held is None
                                                   else held[1].add_(grad))
                    if held is None:
                        state.held_bytes += grad.numel() * grad.element_size()
                        state.note_peak()
            zero = self.step.config.zero_grads
            return [total[s] if s in total else torch.zeros_like(args[i]) if zero else None
                    for s, i in zip(sources, trainable)]

        results = Reused.apply(backward_fn, outputs, *[args[i] for i in trainable])
        return self._finish(results, args)

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

    def _recompute(self, args, reason: str):
        state = self.step._state
        state.stats.recomputed[reason] += 1
        state.stats.forwards_run += 1
        return self._plain(args, True)


class ReuseWarning(UserWarning):
    """An ``update()`` that reused less than half of its calls although the rollout kept
    rows for them: the kept memory and the rollout's grad-mode forwards were mostly wasted."""


def _warn_little_reuse(kept_rows: bool, stats: StepStats, calls: int, reused: int,
                       recomputed: Counter) -> None:
    """At ``update()`` exit: warn when the rollout kept rows and fewer than half of this
    update's calls reused them, naming the most frequent reason."""
    if stats is None or not kept_rows:
        return
    calls, reused = stats.update_calls - calls, stats.reused_calls - reused
    if not calls or 2 * reused >= calls:
        return
    reasons = Counter(stats.recomputed)
    reasons.subtract(recomputed)
    top = max(((n, r) for r, n in reasons.items() if n > 0), default=(0, "unknown"))
    warnings.warn(
        f"update(): {reused} of {calls} calls reused what the rollout kept; the most frequent "
        f"reason for the others ({top[0]} x): {top[1]}. If the rollout trains the wrong calls "
        "(several sampling batches of T steps: rollout(train=..., trajectory_steps=T)), or "
        "more than one optimizer step follows a rollout, the kept memory is wasted; see "
        "step.stats.summary()", ReuseWarning, stacklevel=4)


def _sample_ids(spec, index: int, batch: int) -> list[int] | None:
    if spec is None:
        return None
    ids = spec(index) if callable(spec) else spec[index]
    ids = torch.as_tensor(ids).flatten().tolist()
    if len(ids) != batch:
        raise ValueError(f"samples gives {len(ids)} sample ids for call {index} of {batch} rows")
    return [int(i) for i in ids]


def _buffer_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for grads in state.sample_grads.values()
               for t in grads.values() if t is not None)


def _empty_outputs(g: StepGraphs) -> list:
    graph = g.forward if g.forward is not None else g.inference
    outs = next(n for n in graph.graph.nodes if n.op == "output").args[0][:g.num_outputs]
    hint = {}
    if g.batch_symbol is not None:
        hint = {g.batch_symbol: None}

    def make(node):
        val = node.meta.get("val") if isinstance(node, fx.Node) else node
        if not isinstance(val, Tensor):
            return val
        shape = [int(d.node.hint) if isinstance(d, torch.SymInt) else d for d in val.shape]
        return torch.empty(shape, dtype=val.dtype, device=val.device)

    del hint
    return [make(o) for o in outs]


def _batch_independent(layouts, j) -> bool:
    """Output ``j`` does not depend on the batch (the LeanGRPO stage's layout ``None``)."""
    return layouts is not None and j < len(layouts) and layouts[j] is None


def _rows_of(c, layouts, j, batch, rows):
    """The cotangent of output ``j`` for ``rows`` of the update call (in that order)."""
    if c is None or layouts is None:
        return c
    layout = layouts[j] if j < len(layouts) else None
    if layout is None or layout == "symint" or rows == list(range(batch)):
        return c
    return gather_rows([(c, batch, rows)], layout.outer, layout.inner)


def _saved_size(g: StepGraphs, k: int, symbols: dict) -> int:
    """Saved value ``k`` (a size) for the sizes ``symbols`` (symbol -> int)."""
    expr = g.saved_meta[k]
    return int(expr.node.expr.subs(symbols) if isinstance(expr, torch.SymInt) else expr)


def _as_traced(tensor: Tensor, meta, symbols: dict) -> Tensor:
    """``tensor`` (gathered rows: contiguous) laid out with the strides the forward graph gave
    the saved value ``meta`` (a fake tensor with symbolic sizes) at the sizes ``symbols``: a
    compiled backward (Inductor's) assumes its inputs have the strides it was traced with
    (attention's ``[B, H, S, D]`` views of ``[B, S, H, D]`` buffers, its logsumexp) and asserts
    them."""
    if not isinstance(meta, Tensor):
        return tensor
    stride = tuple(_concrete(d, symbols) for d in meta.stride())
    if stride == tensor.stride():
        return tensor
    out = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def _concrete(size, symbols: dict) -> int:
    """A traced size at the sizes ``symbols`` (symbol -> int; other symbols at their hint)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    free = {s: symbols[s] for s in expr.free_symbols if s in symbols}
    value = expr.subs(free)
    if value.is_number:
        return int(value)
    hints = size.node.shape_env.backed_var_to_val
    return int(value.subs({s: hints[s] for s in value.free_symbols if s in hints}))


_SLICES = {torch.ops.aten.slice.Tensor: 3, torch.ops.aten.slice_scatter.default: 4}
"""Slicing ops and the position of their ``end`` argument."""


def _row_shape(output: Tensor, layout, batch: int) -> tuple:
    """The shape of one row's share of ``output`` (all of it when it holds no rows)."""
    if layout is None or layout == "symint" or not hasattr(layout, "outer"):
        return tuple(output.shape)
    return (layout.outer * layout.inner, *output.shape[1:])


def _val_of_output(g: StepGraphs, j: int):
    graph = g.forward if g.forward is not None else g.inference
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0][j]
    return out.meta.get("val") if isinstance(out, fx.Node) else out


def _shape(g: StepGraphs, j: int):
    val = _val_of_output(g, j)
    return tuple(val.shape) if isinstance(val, Tensor) else ()


def _numel_per_row(g: StepGraphs, j: int, batch: int):
    """1 when output ``j`` holds one value per sample (``[s]`` or ``[s, 1]``; for a graph with
    a static batch, ``[batch]`` or ``[batch, 1]``)."""
    val = _val_of_output(g, j)
    if not isinstance(val, Tensor) or val.dim() == 0:
        return None
    first = val.shape[0]
    if g.batch_symbol is None:
        if first != batch:
            return None
    elif not (isinstance(first, torch.SymInt) and first.node.expr == g.batch_symbol):
        return None
    rest = 1
    for d in val.shape[1:]:
        if not isinstance(d, int):
            return None
        rest *= d
    return rest


# ---------------------------------------------------------------------------------------------
# The wrapper


class _Backend:
    """The Dynamo backend of one ``LeanStep``: captures each graph, returns its runtime."""

    def __init__(self, step: "LeanStep"):
        self.step = step
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        step = self.step
        report = Report(options=step.options.cache_key())
        graph_pass = LeanGraphPass(step.options, report=report, graph_index=self.graphs)
        self.graphs += 1
        _rename_sample(gm, step.config.sample_arg)
        graphs = capture_graph(gm, example_inputs, graph_pass=graph_pass,
                               compiler=step.options.compiler,
                               sample_output=step.config.sample_output,
                               memory_budget=step.config.partitioner_budget,
                               reshard_after_forward=step.config.reshard_after_forward)
        graphs.report = report
        record_report(report)
        step.reports.append(report)
        step.graphs.append(graphs)
        return _GraphRuntime(step, graphs)


def _tensors_of(args, kwargs) -> list[Tensor]:
    """The tensors among a call's arguments, also inside lists, tuples and dicts (what
    ``tree_flatten`` finds there, without its registry lookups: this runs on every call)."""
    found = []
    stack = list(kwargs.values())[::-1] + list(args)[::-1]
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return found


_GLOBAL_HOOKS = [0]
"""Which set of global module hooks is registered now (``_note_global_hooks``), read by every
step's entry so that Dynamo guards on it: ``register_module_forward_pre_hook`` and its kin
change what a module call computes, and Dynamo guards no global hook."""
_HOOK_SETS: dict = {((), (), (), ()): 0}


def _note_global_hooks() -> None:
    module = torch.nn.modules.module
    key = (tuple(module._global_forward_pre_hooks), tuple(module._global_forward_hooks),
           tuple(module._global_backward_pre_hooks), tuple(module._global_backward_hooks))
    _GLOBAL_HOOKS[0] = _HOOK_SETS.setdefault(key, len(_HOOK_SETS))


def _entry(fn: Callable) -> Callable:
    """A function that calls ``fn``, with a code object of its own: Dynamo keeps its compiled
    graphs (and counts recompiles against its limit) per code object, so each ``LeanStep`` gets
    its own, whatever else compiles ``fn``. It reads ``_GLOBAL_HOOKS``: a global hook added or
    removed recompiles."""
    def call(*args, **kwargs):
        if _GLOBAL_HOOKS[0] < 0:  # (never: the read is what Dynamo guards)
            raise AssertionError(_GLOBAL_HOOKS)
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    call.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return call


def _rename_sample(gm: fx.GraphModule, sample_arg: str | None) -> None:
    """Hash the update's sample argument under the name the rollout's drawn sample gets."""
    if sample_arg is None:
        return
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        source = getattr(arg, "source", None)
        if source is not None and source.name in (f"L['{sample_arg}']",
                                                  f"L['kwargs']['{sample_arg}']"):
            node.meta["leancompile_sample"] = True


class LeanStep:
    """A function compiled with LeanGRPO schedules; see the module docstring. Made by
    ``leancompile.lean_compile(fn, schedule=...)``; calls go to ``fn``'s compiled graphs."""

    def __init__(self, fn: Callable, *, options: CompileOptions, config: StepConfig,
                 compile_kwargs: dict | None = None):
        if not callable(fn):
            raise TypeError(f"lean_compile needs a function or module, got {type(fn).__name__}")
        self.fn = fn
        self.options = options
        self.config = config
        self.reports: list[Report] = []
        self.graphs: list[StepGraphs] = []
        self._state = _State(config)
        self._state_batch = None
        self.compile_kwargs = dict(compile_kwargs or {})
        kwargs = dict(self.compile_kwargs)
        kwargs.setdefault("dynamic", False)
        self._compiled = torch.compile(_entry(fn), backend=_Backend(self), **kwargs)
        try:
            self.__wrapped__ = fn
            self.__doc__ = getattr(fn, "__doc__", None)
        except AttributeError:  # pragma: no cover - objects without a writable __doc__
            pass

    @property
    def stats(self) -> StepStats:
        return self._state.stats

    def __call__(self, *args, **kwargs):
        state = self._state
        tensors = _tensors_of(args, kwargs)
        batch = next((t.shape[0] for t in tensors if t.dim() >= 1), 1)
        if batch > 1:
            for t in tensors:
                if t.dim() >= 1 and t.shape[0] == batch:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        self._state_batch = batch
        if state.phase == "rollout":
            state.stats.rollout_calls += 1
            per = state.trajectory_steps
            state.current = state.train.rows(
                state.call_index if per is None else state.call_index % per, batch)
            state.current_samples = _sample_ids(state.samples, state.call_index, batch)
            state.call_index += 1
        state.reached = False
        # Dynamo traces the step with gradients on whatever the caller's mode: under no_grad it
        # would inline a custom autograd.Function's forward, and the graphs captured from that
        # trace would differentiate the forward's ops instead of using the Function's backward
        # (Retain and Reweight would silently get other gradients than Recompute). The runtime
        # reads the caller's mode from the state; a no-grad call still runs no autograd.
        state.grad_mode = torch.is_grad_enabled()
        # Hooks guarded: Dynamo by default skips the guards on modules' hook dicts
        # (skip_nnmodule_hook_guards), so a hook added between the rollout and the update
        # would run the graph traced without it, under every schedule. Plain torch.compile
        # hides this only because its update call, with gradients on, recompiles anyway.
        _note_global_hooks()
        dynamo_config = torch._dynamo.config
        skip_hook_guards = dynamo_config.skip_nnmodule_hook_guards
        dynamo_config.skip_nnmodule_hook_guards = False
        try:
            with torch.enable_grad():
                out = self._compiled(*args, **kwargs)
        finally:
            dynamo_config.skip_nnmodule_hook_guards = skip_hook_guards
            state.current = None
            state.current_samples = None
        if state.phase is not None and not state.reached:
            # Dynamo ran the call without a compiled graph (its recompile limit, a frame it
            # skips): nothing was kept or reused. Counted, never silent.
            key = "rollout" if state.phase == "rollout" else "update"
            reason = ("Dynamo ran the call in Python without a compiled graph (recompile limit "
                      "reached, or a skipped frame); see TORCH_LOGS=recompiles")
            (state.stats.kept if key == "rollout" else state.stats.recomputed)[reason] += 1
            if key == "update":
                state.stats.update_calls += 1
                state.stats.forwards_run += 1
        return out

    @contextlib.contextmanager
    def rollout(self, train=None, *, trajectory_steps: int | None = None, samples=None,
                schedule: str | None = None, budget_bytes: int | None = None):
        """The sampling loop: calls chosen by ``train`` keep what the schedule needs (see
        ``_Train`` for the forms ``train`` takes; default: every call, every row). Starting a
        rollout frees what an earlier one kept.

        ``trajectory_steps``: the calls one trajectory makes (T denoising steps), for a loop
        that samples several batches of T steps each (FlowGRPO's ``num_batches_per_epoch``):
        ``train`` is then asked about the step within the trajectory (``call_index % T``), so
        ``train=range(n)`` trains the first n steps of every batch, not the first n calls of
        the whole rollout. ``samples`` still takes the call index.

        ``samples``: the sample (trajectory) each row of a call belongs to, as a LongTensor
        ``[calls, rows]`` or a function ``f(call_index) -> LongTensor [rows]``. With it,
        reweight keeps one gradient buffer per sample (the sum over its trained steps) instead
        of one per row, and requires the update to bring the same cotangent to every trained
        step of a sample (on-policy: ``-A_i / (B |S|)``); an optimizer step before all of a
        sample's steps arrived raises. ``schedule`` overrides the wrapper's for this rollout,
        ``budget_bytes`` its memory budget (what ``auto`` and reweight's rows per backward go
        by)."""
        state = self._state
        if state.phase is not None:
            raise RuntimeError(f"rollout() inside {state.phase}(): the phases do not nest")
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULES}")
        if schedule == "auto" and self.config.defer_reductions:
            raise ValueError("rollout(schedule='auto') with defer_reductions=True: ranks could "
                             "pick different schedules per call; pass retain or reweight")
        if trajectory_steps is not None and (isinstance(trajectory_steps, bool) or not
                                             isinstance(trajectory_steps, int)
                                             or trajectory_steps < 1):
            raise ValueError(f"trajectory_steps={trajectory_steps!r}: the number of calls one "
                             "trajectory makes (its denoising steps), an int >= 1, or None")
        state.unwatch_optimizers()
        state.clear()
        state.stale = None
        state.schedule = schedule or self.config.schedule
        state.samples = samples
        state.train = _Train(train)
        state.trajectory_steps = trajectory_steps
        state.call_index = 0
        state.phase = "rollout"
        if budget_bytes is not None:
            state.budget = budget_bytes
        elif self.config.memory_budget_bytes is not None:
            state.budget = self.config.memory_budget_bytes
        else:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            state.budget = int(free_memory_bytes(device) * self.config.memory_fraction)
        start = time.perf_counter()
        try:
            yield self
        finally:
            state.phase = None
            state.stats.rollout_seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def update(self):
        """The training loop: calls that repeat a kept rollout call reuse it; what was kept and
        not used is freed at exit (and counted in ``stats``)."""
        state = self._state
        if state.phase is not None:
            raise RuntimeError(f"update() inside {state.phase}(): the phases do not nest")
        state.phase = "update"
        start = time.perf_counter()

        def before_step(optimizer, args, kwargs):
            pending = state.pending_samples()
            if pending:
                raise RuntimeError(
                    f"optimizer.step() before every trained step of samples {pending} reached "
                    "the update: reweight keeps one gradient per sample (samples=) and applies "
                    "it when the sample's last step arrives; step the optimizer after them, or "
                    "rollout without samples= (one buffer per row)")

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hook = register_optimizer_step_pre_hook(before_step)
        stats = state.stats
        calls, reused = stats.update_calls, stats.reused_calls
        recomputed = Counter(stats.recomputed)
        kept_rows = bool(state.kept)
        try:
            yield self
            _warn_little_reuse(kept_rows, state.stats, calls, reused, recomputed)
            pending = state.pending_samples()
            if pending:
                raise RuntimeError(
                    f"update() ended with samples {pending} only partly updated: their "
                    "merged reweight gradients were never applied (every trained step of a "
                    "sample must reach the update)")
        finally:
            hook.remove()
            state.unwatch_optimizers()
            state.phase = None
            state.clear()
            state.stats.update_seconds += time.perf_counter() - start

    def plan(self, *args, **kwargs) -> list[StepGraphs]:
        """Compile the graphs a call with these arguments runs, without running them (the
        outputs are uninitialised), and return them: what ``explain`` and a trainer's plans
        read (saved bytes, row layouts, FLOPs)."""
        state = self._state
        if state.phase is not None:
            raise RuntimeError(f"plan() inside {state.phase}()")
        state.phase = "plan"
        state.graphs_called = []
        try:
            with torch.no_grad():
                self(*args, **kwargs)
        finally:
            state.phase = None
        return list(state.graphs_called)

    def discard_kept(self) -> None:
        """Free everything the last rollout kept (activations, per-sample buffers), so that
        the next update calls recompute; what ``take_deferred_grads`` holds stays."""
        if self._state.phase is not None:
            raise RuntimeError(f"discard_kept() inside {self._state.phase}()")
        self._state.unwatch_optimizers()
        self._state.clear()

    def take_deferred_grads(self) -> list[tuple[Tensor, Tensor]]:
        """``defer_reductions``: (parameter, full-size gradient not yet reduced over the ranks)
        for every parameter Reweight held back since the last call; the caller reduces them
        and adds the result to the parameters' gradients."""
        out = list(self._state.deferred.values())
        self._state.deferred.clear()
        self._state.held_bytes = 0
        return out

    def reset_stats(self) -> StepStats:
        """Return the stats so far and start counting anew."""
        old = self._state.stats
        self._state.stats = StepStats()
        return old

    def explain_schedules(self, *args, **kwargs) -> StepReport:
        """What ``leancompile.explain(step, *args)`` returns: the graphs a call with these
        arguments runs (compiled, not run) and what each schedule keeps for it."""
        graphs = self.plan(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        batch = next((t.shape[0] for t in tensors if t.dim() >= 1), 1)
        device = tensors[0].device if tensors else torch.device("cpu")
        budget = self.config.memory_budget_bytes or int(
            free_memory_bytes(device) * self.config.memory_fraction)
        rows = []
        for g in graphs:
            params = [r.source for r in g.roles if r.kind == "param"]
            grad_bytes = 0
            if g.forward is not None:
                placeholders = [n for n in g.forward.graph.nodes if n.op == "placeholder"]
                for role, node in zip(g.roles, placeholders):
                    val = node.meta.get("val")
                    if role.kind == "param" and isinstance(val, Tensor):
                        grad_bytes += val.numel() * val.element_size()
            rows.append({
                "kept_bytes": g.kept_bytes(batch) if g.forward is not None else 0,
                "row_local": bool(g.layouts.get("row_local")),
                "reason": g.layouts.get("reason") or "the LeanGRPO stage found no batch",
                "scalars": [j for j in g.differentiable if _numel_per_row(g, j, batch) == 1],
                "grad_bytes": grad_bytes, "params": len(params),
                "rows_per_backward": reweight_rows_per_backward(
                    rows=batch, grad_bytes=grad_bytes, requested=self.config.reweight_rows,
                    row_saved_bytes=g.kept_bytes(1) if g.forward is not None else 0,
                    room_bytes=budget) if g.layouts.get("row_local") else 1,
                "random_ops": g.random_ops})
        return StepReport(schedule=self.config.schedule, batch=batch, budget_bytes=budget,
                          graphs=rows, reports=[g.report for g in graphs if g.report])

    def __repr__(self) -> str:
        return (f"LeanStep({getattr(self.fn, '__name__', type(self.fn).__name__)}, "
                f"schedule={self.config.schedule!r}, {self.options})")


class LeanModule(torch.nn.Module):
    """``lean_compile(module, schedule=...)``: the module as the loop holds it, its calls
    through a ``LeanStep``. Like ``torch.compile``'s ``OptimizedModule``, everything but the
    call passes through to the wrapped module: attributes (``.config``, ``.dtype``,
    ``disable_adapter()``), ``train()``/``eval()``, ``parameters()`` and ``state_dict()``
    (the wrapped module's names, no prefix); ``.module`` is the wrapped module itself (what
    FlowGRPO reaches through its DDP wrapper: ``transformer.module.disable_adapter()``). The
    phases and stats are the step's: ``rollout()``, ``update()``, ``stats``, ``plan()``,
    ``explain_schedules()``, ``discard_kept()``. So a diffusers pipeline takes it in place of
    its transformer::

        pipeline.transformer = leancompile.lean_compile(pipeline.transformer, schedule="retain")
    """

    _STEP_ATTRIBUTES = ("rollout", "update", "stats", "plan", "explain_schedules",
                        "discard_kept", "take_deferred_grads", "reset_stats", "graphs",
                        "reports", "_state")

    def __init__(self, module: torch.nn.Module, step: LeanStep):
        super().__init__()
        self.module = module
        object.__setattr__(self, "lean_step", step)
        object.__setattr__(self, "_signature", _keyword_signature(module))

    def forward(self, *args, **kwargs):
        # Arguments by keyword, whichever way the caller passed them: the sampler calls
        # transformer(x, t, ...) where the training code calls transformer(hidden_states=x,
        # ...), and Dynamo names (and hashes) an input by how it was passed.
        names = self._signature
        if args and names is not None and len(args) <= len(names) and \
                not kwargs.keys() & names[:len(args)]:
            kwargs = {**dict(zip(names, args)), **kwargs}
            args = ()
        return self.lean_step(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy of the module under a step of its own (``copy.deepcopy(transformer)`` for a
        reference or EMA model: a copied step would still call the original module)."""
        module = copy.deepcopy(self.module, memo)
        step = self.lean_step
        return LeanModule(module, LeanStep(module, options=step.options, config=step.config,
                                           compile_kwargs=step.compile_kwargs))

    def __getattr__(self, name: str):
        if name in LeanModule._STEP_ATTRIBUTES:
            return getattr(self.__dict__["lean_step"], name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self.module)))

    def __repr__(self) -> str:
        return f"LeanModule(schedule={self.lean_step.config.schedule!r}, {self.module!r})"


def _keyword_signature(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The names of ``module.forward``'s parameters that a call may pass by position, when
    every one of them can also be passed by keyword (no ``*args``, no positional-only one),
    else None."""
    import inspect

    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
        return None
    return tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)


# ---------------------------------------------------------------------------------------------
# The entry point


_TORCH_COMPILE_KWARGS = ("fullgraph", "dynamic")
_STEP_KWARGS = tuple(f.name for f in dataclasses.fields(StepConfig) if f.name != "schedule")


def lean_compile(fn=None, *, backend: str = "inductor", **options):
    """Compile a function or module with leancompile's passes; usable as ``@lean_compile`` or
    ``@lean_compile(backend="aot_eager", overlap="flash", ...)``.

    ``backend`` is what compiles the graphs after our passes (``"inductor"`` or
    ``"aot_eager"``). The leancompile options (``overlap``, ``variant``, ``chunks_per_rank``,
    ``chunks``, ``on_error``, ``disable``) are those of ``leancompile.backend``; ``fullgraph``
    and ``dynamic`` go to ``torch.compile``.

    With ``schedule=`` (``"auto"``, ``"retain"``, ``"reweight"``, ``"recompute"``) the result is
    a ``leancompile.step.LeanStep``: the function as compiled, plus ``rollout()`` and
    ``update()`` phases in which an update call reuses the rollout's forward (LeanGRPO); for a
    module, a ``LeanModule`` (the module as before, its calls through such a step). It
    also takes ``sample_output`` and ``sample_arg`` (a step that draws its sample inside),
    ``memory_budget_bytes`` and ``memory_fraction`` (``auto``'s budget), ``partitioner_budget``,
    ``reshard_after_forward`` and ``reweight_rows``; see ``StepConfig``. Any other keyword
    raises ``TypeError``.
    """
    compile_kwargs = {k: options.pop(k) for k in _TORCH_COMPILE_KWARGS if k in options}
    step_kwargs = {k: options.pop(k) for k in _STEP_KWARGS if k in options}
    if "compiler" in options:
        raise TypeError("lean_compile takes backend=..., not compiler=...")
    try:
        compile_options = CompileOptions.from_kwargs(compiler=backend, **options)
    except TypeError as err:
        raise TypeError(f"lean_compile: {err}; it also takes backend, the torch.compile "
                        f"options {list(_TORCH_COMPILE_KWARGS)} and, with schedule=, "
                        f"{list(_STEP_KWARGS)}") from None
    if step_kwargs and compile_options.schedule is None:
        raise TypeError(f"lean_compile: {sorted(step_kwargs)} go with schedule=...")
    if compile_options.schedule is not None:
        config = StepConfig(schedule=compile_options.schedule, **step_kwargs)

        def wrap_step(target):
            step = LeanStep(target, options=compile_options, config=config,
                            compile_kwargs=compile_kwargs)
            return LeanModule(target, step) if isinstance(target, torch.nn.Module) else step

        return wrap_step if fn is None else wrap_step(fn)
    lean_backend = LeanBackend(compile_options)

    def wrap(target):
        if not callable(target):
            raise TypeError(f"lean_compile needs a function or module, got "
                            f"{type(target).__name__}")
        return torch.compile(target, backend=lean_backend, **compile_kwargs)

    return wrap if fn is None else wrap(fn)
