"""Captured step graphs, compiled once per (mode, batch rows, partitioner budget).

``StepGraphCache.get(module, args)`` captures ``module`` through AOTAutograd
(``leancompile.capture``) the first time it sees a key and compiles the forward,
backward and inference graphs with ``aot_eager`` (the graphs run as they are) or Inductor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..capture import CapturedStep, capture_step

__all__ = ["CompiledStep", "StepGraphCache", "compile_captured"]

log = logging.getLogger("leancompile")


@dataclass(kw_only=True)
class CompiledStep:
    """A ``CapturedStep`` with runnable graphs: ``forward(*inputs) -> list``,
    ``backward(*saved, *cotangents) -> list``, ``inference(*inputs) -> list``."""

    captured: CapturedStep
    forward: Callable
    backward: Callable
    inference: Callable
    capture_seconds: float = 0.0
    costs: object = None
    """``StepCosts`` (bytes and FLOPs), filled in once by whoever needs them."""

    # The graphs compute gradients explicitly (the backward graph), so eager autograd must not
    # record them: AOTAutograd calls its compiled graphs under no_grad too.
    @torch.no_grad()
    def run_forward(self, module_inputs, args):
        outs = self.forward(*module_inputs, *args)
        n = self.captured.num_outputs
        return tuple(outs[:n]), tuple(outs[n:])

    @torch.no_grad()
    def run_inference(self, module_inputs, args):
        return tuple(self.inference(*module_inputs, *args))

    @torch.no_grad()
    def run_backward(self, saved, cotangents):
        return self.backward(*saved, *cotangents)


def _fake_inputs(gm):
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def compile_captured(captured: CapturedStep, compiler: str) -> CompiledStep:
    if compiler == "aot_eager":
        return CompiledStep(captured=captured, forward=captured.forward,
                            backward=captured.backward, inference=captured.inference)
    if compiler != "inductor":
        raise ValueError(f"compiler={compiler!r}; use 'aot_eager' or 'inductor'")
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    def build(gm, **kwargs):
        inputs = _fake_inputs(gm)
        fake_mode = next(v.fake_mode for v in inputs if hasattr(v, "fake_mode"))
        with V.set_fake_mode(fake_mode):
            compiled = compile_fx_inner(gm, inputs, **kwargs)
        return lambda *args: compiled(list(args))

    return CompiledStep(captured=captured, forward=build(captured.forward),
                        backward=build(captured.backward, is_backward=True),
                        inference=build(captured.inference, is_inference=True))


class StepGraphCache:
    """Captures and compiles each step variant once; ``get`` returns the cached one. Keys are
    the module (which must stay alive with the cache), a name, the argument shapes and dtypes,
    and the partitioner budget."""

    def __init__(self, *, compiler: str = "aot_eager"):
        self.compiler = compiler
        self._cache: dict = {}

    def get(self, module: torch.nn.Module, args, *, key, memory_budget: float | None = None,
            allow_random: bool = False) -> CompiledStep:
        full_key = (id(module), key, tuple(tuple(a.shape) for a in args),
                    tuple(a.dtype for a in args), memory_budget)
        step = self._cache.get(full_key)
        if step is None:
            start = time.perf_counter()
            captured = capture_step(module, args, memory_budget=memory_budget,
                                    allow_random=allow_random)
            step = compile_captured(captured, self.compiler)
            step.capture_seconds = time.perf_counter() - start
            log.info("leancompile: captured %s in %.2f s (saves %d bytes per call)", full_key,
                     step.capture_seconds, captured.saved_bytes)
            self._cache[full_key] = step
        return step

    def clear(self) -> None:
        self._cache.clear()
