"""``auto``'s measured choice: whether keeping for Retain paid in the last rollout and update.

Retain keeps a trained rollout call's saved tensors so that the update's call runs no forward.
That pays only when the forwards it saves cost more than keeping them did: a kept call runs the
forward that saves (not the inference graph) plus the wrapper's bookkeeping, and a served
update call is matched and gathers its rows. On a small model, or where a second optimizer
step per rollout makes half of the kept calls stale, keeping costs more than it saves
(FlowGRPO's ``train_sd3.py`` loop at ``bench realloop``'s tiny size: Retain's epoch about 13 ms
longer than recompute's 100 ms).

``Ledger`` adds up one cycle (a rollout and the update after it) in host seconds, counting
only calls whose graphs were compiled before they ran, and judging no cycle in which the step
captured or compiled a graph::

    infer:   the rollout's untrained calls (inference graph)          -> F0 per row
    keep:    the calls kept for Retain, whole, and their forward alone -> F per row
    serve:   the update calls they served (matching, outputs)
    gather:  the gathers in those calls' backwards

    cost  = keep - kept rows x F0          (beyond inference calls of the same rows)
    saved = served rows x F - serve - gather

``verdict`` at the next rollout's entry: where ``cost - saved`` is at least 1 ms and a quarter
of ``saved``, auto keeps nothing from then on (sticky, the measured figures as its reason;
``rollout(schedule="retain")`` still keeps). Measured only where the host's clock is the
device's (CPU tensors) and in one process: ranks timing apart could choose apart, and a
collective forward on one rank against a reused call on another would hang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Ledger", "verdict", "host_timed"]

MIN_LOSS_SECONDS = 1e-3
"""Keeping must lose at least this much in a cycle (and a quarter of what it saved) before
auto stops it: below, host timing noise could decide."""


@dataclass
class Ledger:
    """One cycle's measured seconds and rows (module docstring)."""

    infer_seconds: float = 0.0
    infer_rows: int = 0
    keep_seconds: float = 0.0
    forward_seconds: float = 0.0
    kept_rows: int = 0
    """Rows of the kept calls' batches (the forward runs them all, trained or not)."""
    serve_seconds: float = 0.0
    served_rows: int = 0
    update_calls: int = 0
    """Trained update calls (served or not): a rollout no update followed is not judged."""
    gather_seconds: float = 0.0
    timed: bool | None = None
    """Whether host time is the device's (``host_timed``), from the cycle's first timed call."""
    graphs: tuple = ()
    """The step's graphs and compiled phases when the cycle began (``LeanStep``): a cycle that
    captured or compiled a graph is not judged (its calls' times hold the compile)."""

    def note(self, args) -> bool:
        """Whether a call with these arguments is timed (works out ``timed`` on the first)."""
        if self.timed is None:
            self.timed = host_timed(args)
        return self.timed


def host_timed(tensors) -> bool:
    """Whether host seconds measure these tensors' work: all on the CPU, one process."""
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors):
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def verdict(ledger: Ledger, graphs: tuple = ()) -> str | None:
    """Why auto should keep nothing from now on, or None (keeping paid, or too little was
    measured: no inference call to give F0, no kept call, no update call after the rollout (a
    rollout sampled for evaluation), a device clock, a graph captured or compiled in the
    cycle: ``graphs`` is now's count, against ``Ledger.graphs``)."""
    if not (ledger.timed and ledger.infer_rows and ledger.kept_rows and ledger.update_calls) \
            or graphs != ledger.graphs:
        return None
    f0 = ledger.infer_seconds / ledger.infer_rows
    f = ledger.forward_seconds / ledger.kept_rows
    cost = ledger.keep_seconds - ledger.kept_rows * f0
    saved = ledger.served_rows * f - ledger.serve_seconds - ledger.gather_seconds
    if cost - saved < max(MIN_LOSS_SECONDS, 0.25 * abs(saved)):
        return None
    return (f"nothing (auto: in the last rollout and update, keeping for Retain cost "
            f"{cost * 1e3:.1f} ms more than inference calls and saved {saved * 1e3:.1f} ms of "
            f"forwards, measured on this machine: recompute from here; "
            f"rollout(schedule='retain') keeps anyway)")
