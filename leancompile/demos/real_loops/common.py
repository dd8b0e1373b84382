"""What both loops share: the result of a run (started, each update call recorded, finished),
the phase lines, compiling the transformer one of three ways, the trainable state,
accelerate's marks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["COMPILES", "LoopRun", "phase", "compiled_as", "unwrapped", "trainable_state",
           "load_trainable_state", "grad_snapshot", "start_run", "finish_run", "reset_accelerate",
           "unprepare"]

COMPILES = ("eager", "torch", "lean")


@dataclass(kw_only=True)
class LoopRun:
    """What one run of a loop leaves for comparison."""

    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per optimizer step: the trainable parameters' gradients as ``optimizer.step()`` saw them
    (after ``clip_grad_norm_``)."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """The trainable parameters after the run."""
    log_probs: torch.Tensor | None = None
    """The rollout's log-probs, ``[samples, steps]`` (the last epoch's, in sampling order)."""
    rewards: list[float] = field(default_factory=list)
    clipfrac: list[float] = field(default_factory=list)
    """Per update call: the fraction of rows whose PPO ratio left ``1 +- clip_range`` (FlowGRPO
    logs it as ``clipfrac``): such rows get no policy gradient, so rounding that moves a
    ratio across the bound changes the gradient by a whole row's share."""
    log_ratio: list[float] = field(default_factory=list)
    """Per update call: the largest ``|log_prob - old_log_prob|`` over its rows (0 on-policy
    in exact arithmetic; what rounding leaves of it, before the first optimizer step)."""
    update_steps: list[int] = field(default_factory=list)
    """Per update call: the denoising step it trains (DanceGRPO's permuted steps)."""
    update_samples: list[int] = field(default_factory=list)
    """Per update call: the samples it trains (FlowGRPO: fewer than a sampling batch when the
    zero-advantage filter dropped some)."""
    kl_loss: list[float] = field(default_factory=list)
    """FlowGRPO with ``beta > 0``: per update call, the KL term to the reference (the
    script's ``info["kl_loss"]``; 0 if the reference's pass returned the policy's output)."""
    stats: object | None = None
    """``compile="lean"``: the wrapper's ``StepStats`` at the end."""
    rollout_seconds: float = 0.0
    update_seconds: float = 0.0

    def record_call(self, ratio, log_prob, old_log_prob, *, clip_range: float, step: int,
                    samples: int) -> None:
        """One update call's PPO statistics (``clipfrac``, ``log_ratio``), the denoising step it
        trains and how many samples."""
        self.clipfrac.append(torch.mean((torch.abs(ratio - 1.0) > clip_range).float()).item())
        self.log_ratio.append((log_prob - old_log_prob).abs().max().item())
        self.update_steps.append(step)
        self.update_samples.append(samples)


def phase(transformer, name: str, **kwargs):
    """``transformer.rollout(**kwargs)`` / ``transformer.update()`` when the transformer is a
    LeanGRPO wrapper, nothing for the eager module and ``torch.compile``'s (asked by type: a
    diffusers model answers a missing ``update`` attribute with a ``KeyError``), so one loop
    body serves all three."""
    from ...lean import LeanModule, LeanStep

    if not isinstance(transformer, (LeanModule, LeanStep)):
        return contextlib.nullcontext()
    return getattr(transformer, name)(**kwargs)


def compiled_as(module, compile: str, backend: str, schedule: str):
    """The one line a user adds where the transformer is set up."""
    if compile not in COMPILES:
        raise ValueError(f"compile={compile!r}; use one of {COMPILES}")
    if compile == "torch":
        return torch.compile(module, backend=backend)
    if compile == "lean":
        import leancompile

        return leancompile.lean_compile(module, backend=backend, schedule=schedule)
    return module


def unwrapped(transformer):
    """The module under a LeanGRPO or ``torch.compile`` wrapper (the module itself otherwise):
    its parameter names are the same whichever way the loop ran."""
    from ...lean import LeanModule

    if isinstance(transformer, LeanModule):
        return transformer.module
    if isinstance(transformer, torch._dynamo.eval_frame.OptimizedModule):
        return transformer._orig_mod
    return transformer


def trainable_state(transformer) -> dict[str, torch.Tensor]:
    """Copies of the trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in unwrapped(transformer).named_parameters()
            if p.requires_grad}


def load_trainable_state(transformer, state: dict[str, torch.Tensor]) -> None:
    """Put ``state`` (``trainable_state``) back into the same parameters, in place, and drop
    their gradients: the prepared model is as ``prepare_*`` left it."""
    params = dict(unwrapped(transformer).named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
            params[name].grad = None


def grad_snapshot(transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in unwrapped(transformer).named_parameters()
            if p.requires_grad and p.grad is not None}


def _lean(transformer):
    from ...lean import LeanModule, LeanStep

    return transformer if isinstance(transformer, (LeanModule, LeanStep)) else None


def start_run(transformer) -> LoopRun:
    """A new run's record; a LeanGRPO wrapper's counts start from zero (this run's counts)."""
    lean = _lean(transformer)
    if lean is not None:
        lean.reset_stats()
    return LoopRun()


def finish_run(run: LoopRun, transformer) -> LoopRun:
    """``run`` with the trainable parameters after it and, wrapped, the wrapper's ``stats``."""
    run.params = trainable_state(transformer)
    lean = _lean(transformer)
    if lean is not None:
        run.stats = lean.stats
    return run


def reset_accelerate() -> None:
    """``Accelerator`` keeps its state in process-wide singletons and refuses a second one with
    another ``mixed_precision``: every run starts from a fresh state, as every script launch
    does."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def unprepare(model) -> None:
    """Take off what ``accelerator.prepare`` put on the model (its mixed-precision ``forward``
    and the mark that makes a later ``prepare`` return the model untouched), so that a later
    run of the loop on the same model prepares it afresh, for its own Accelerator.
    ``torch.compile``'s module sets the attributes ``prepare`` adds on the module it compiled
    (``forward`` stays its own), so both are looked at; not a forward saved there that is the
    compiled module's own (prepared itself before it was compiled: the wrapper then inherited
    its mark and was left as it was)."""
    holders = [model]
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        inner = model._orig_mod
        if getattr(inner.__dict__.get("_original_forward"), "__self__", None) is not inner:
            holders.append(inner)
    original = None
    for holder in holders:
        original = holder.__dict__.pop("_original_forward", None) or original
        holder.__dict__.pop("_is_accelerate_prepared", None)
    if original is not None:
        model.forward = original


