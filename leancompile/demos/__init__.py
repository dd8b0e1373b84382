"""Demos run by ``leancompile demo NAME``."""

from __future__ import annotations

__all__ = ["run_demo", "DEMOS"]

DEMOS = ("grpo", "loop", "race", "explain", "overlap")


def run_demo(name: str, *, out: str, sp: int | None = None) -> int:
    """``sp``: ranks per sequence-parallel group (grpo: a ``(dp, sp)`` mesh under torchrun;
    overlap: the Ulysses FLUX on 2 ranks instead of the TP+SP block)."""
    if name == "explain":
        from .explain_demo import main

        return main(out=out)
    if name == "grpo":
        from .grpo_demo import main

        return main(out=out, sp=sp)
    if name == "loop":
        from .loop_demo import main

        return main(out=out)
    if name == "race":
        from .race import main

        return main(out=out)
    if name == "overlap":
        from .overlap_demo import main

        return main(sp=bool(sp))
    raise ValueError(f"unknown demo {name!r}; the demos are {DEMOS}")
