"""What ``lean_compile(fn, schedule=...)`` is configured with and reports: ``StepConfig``,
``StepStats``, ``StepReport``, ``ReuseWarning``; ``SCHEDULE_CHOICES``, the schedules a user
may pass (``SCHEDULES``, its earlier name)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..passes.lean_grpo import SCHEDULES as CONCRETE_SCHEDULES

__all__ = ["SCHEDULE_CHOICES", "SCHEDULES", "StepConfig", "StepStats", "StepReport",
           "ReuseWarning"]

SCHEDULE_CHOICES = ("auto", *CONCRETE_SCHEDULES)
"""What ``lean_compile(schedule=...)`` takes: ``auto`` first (the default, which picks retain,
reweight or nothing per call), then the concrete schedules of ``passes/lean_grpo.py``."""

SCHEDULES = SCHEDULE_CHOICES
"""The earlier name of ``SCHEDULE_CHOICES`` (``leancompile.lean.SCHEDULES``)."""


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
    auto_measured: bool = True
    """``auto`` also weighs what keeping cost against what it saved, measured on the CPU in
    one process (``leancompile/lean/costs.py``), and keeps nothing once a rollout and its
    update lost by keeping. False: by memory alone (a choice that does not depend on the
    machine's timings, and so neither do the results' rounding)."""
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
        if self.schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"schedule={self.schedule!r}; use one of {SCHEDULE_CHOICES}")
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


class ReuseWarning(UserWarning):
    """An ``update()`` that reused less than half of its calls although the rollout kept
    rows for them: the kept memory and the rollout's grad-mode forwards were mostly wasted."""
