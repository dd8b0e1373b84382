"""Demos run by ``leancompile demo NAME``."""

from __future__ import annotations

__all__ = ["run_demo", "DEMOS"]

DEMOS = ("grpo", "explain")


def run_demo(name: str, *, out: str) -> int:
    if name == "explain":
        from .explain_demo import main

        return main(out=out)
    if name == "grpo":
        from .grpo_demo import main

        return main(out=out)
    raise ValueError(f"unknown demo {name!r}; the demos are {DEMOS}")
