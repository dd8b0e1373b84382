"""LeanGRPO in the loops users own: ``lean_compile(fn, schedule=...)`` and its phases.

One job per module, lowest first: ``config`` (what a step is configured with and reports),
``state`` (what it holds between the phases), ``graphs`` (facts about its captured graphs),
``keys`` (matching an update row to a kept one), ``retain`` (gathering kept rows),
``row_backward`` (Reweight's vectorised backward), ``reweight`` (per-row gradients),
``serve`` (an update call served from kept calls), ``runtime`` (one graph at run time,
dispatching by phase), ``api`` (``lean_compile``, ``LeanStep``, ``LeanModule``)."""

from .api import LeanModule, LeanStep, lean_compile
from .config import SCHEDULES, ReuseWarning, StepConfig, StepReport, StepStats
from .state import free_memory_bytes, synchronize

__all__ = ["lean_compile", "LeanStep", "LeanModule", "ReuseWarning", "StepConfig", "StepStats",
           "StepReport", "SCHEDULES", "free_memory_bytes", "synchronize"]
