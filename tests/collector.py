"""Python's cyclic garbage collector as the suite's processes run it.

Most of the suite's CPU is Python: Dynamo's and AOTAutograd's tracing make and drop millions of
small objects, and with Python's default thresholds (700, 10, 10) the collector ran 6,000 times
in ``tests/test_lean_step.py`` alone, each full pass walking torch's, diffusers' and the
tests' module objects: 7.8-9.0 s of a 52-58 s process. ``tune()`` raises the first threshold
and ``freeze()`` moves what exists (the imported modules) out of the collector's reach, so it
walks only what the tests make: 1.9-2.1 s, the process 46-48 s (docs/measured.md, "The suite's
Python").

What a test asserts does not depend on when a cycle is collected: every count of kept bytes,
buffers and graphs is the library's own bookkeeping. ``LEANCOMPILE_TEST_GC=default`` keeps
Python's defaults (to check exactly that)."""

from __future__ import annotations

import gc
import os

THRESHOLDS = (50_000, 20, 10)


def _tuned() -> bool:
    return os.environ.get("LEANCOMPILE_TEST_GC", "tuned") != "default"


def tune() -> None:
    """Raise the collector's first threshold (a process's start)."""
    if _tuned():
        gc.set_threshold(*THRESHOLDS)


def freeze() -> None:
    """Leave every object that exists now to reference counting alone (after the imports)."""
    if _tuned():
        gc.freeze()


def settle() -> None:
    """A process the tests start (a rank, a pool worker), its modules imported: ``tune`` and
    ``freeze`` (conftest's own are not inherited across a spawn or a fork server)."""
    tune()
    freeze()
