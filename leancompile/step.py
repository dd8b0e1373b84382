"""The import path ``leancompile.step`` of earlier releases: LeanGRPO's wrapper now lives in
``leancompile/lean/`` (``api.py``: ``lean_compile``, ``LeanStep``, ``LeanModule``)."""

from .lean import (SCHEDULES, LeanModule, LeanStep, ReuseWarning, StepConfig, StepReport,
                   StepStats, free_memory_bytes, lean_compile, synchronize)

__all__ = ["lean_compile", "LeanStep", "LeanModule", "ReuseWarning", "StepConfig", "StepStats",
           "StepReport", "SCHEDULES", "free_memory_bytes", "synchronize"]
