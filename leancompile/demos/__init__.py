"""Demos run by ``leancompile demo NAME``."""

from __future__ import annotations

__all__ = ["run_demo", "DEMOS"]

DEMOS = ("grpo", "loop", "explain", "overlap")


def run_demo(name: str, *, out: str, sp: bool = False) -> int:
    if name == "explain":
        from .explain_demo import main

        return main(out=out)
    if name == "grpo":
        from .grpo_demo import main

        return main(out=out)
    if name == "loop":
        from .loop_demo import main

        return main(out=out)
    if name == "overlap":
        from .overlap_demo import main

        return main(sp=sp)
    raise ValueError(f"unknown demo {name!r}; the demos are {DEMOS}")
