"""What the trainer hands back: ``Rollout`` (one scored rollout), ``GradResult`` (one update's
gradients and what it measured) and ``OffPolicyWarning``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..passes.lean_grpo import SchedulePlan

__all__ = ["Rollout", "GradResult", "OffPolicyWarning"]


class OffPolicyWarning(UserWarning):
    """The parameters changed between rollout and update: that update was recomputed."""


@dataclass(kw_only=True)
class Rollout:
    """One rollout: ``B`` = prompts x group_size rows, ``T`` denoising steps."""

    latents: torch.Tensor
    """``[B, T+1, ...]``; ``latents[:, k]`` is in the layout ``policy.velocity`` takes."""
    selected: torch.Tensor
    """``[B, S]`` trained step indices, drawn before the rollout."""
    log_probs: torch.Tensor
    """``[B, T]`` rollout log-probs."""
    rewards: torch.Tensor
    advantages: torch.Tensor
    conditions: dict
    """One row per sample."""
    noise: torch.Tensor = field(repr=False)
    """``[T, B, ...]`` the SDE noise used."""
    rows: torch.Tensor | None = None
    """Data parallel: the rows this rank generated (``latents`` and ``noise`` hold only those;
    ``log_probs``, ``rewards`` and ``advantages`` hold every row). None: all rows."""
    seed: int = 0
    """The step's base seed: sample ``(p, m)`` drew from
    ``leancompile.grpo.layout.sample_seed(seed, p, m)``."""


@dataclass(kw_only=True)
class GradResult:
    grads: dict[str, torch.Tensor]
    """Trainable parameters of the policy by name (``policy.named_parameters()``)."""
    rollout: Rollout
    schedule: str
    """The schedule the update used (after ``auto`` and guards)."""
    reason: str
    plans: dict[str, SchedulePlan]
    retained_bytes: int
    """Peak activation bytes kept (measured on the saved tensors; Retain)."""
    buffer_bytes: int
    """Peak bytes of per-sample gradient buffers (Reweight)."""
    kl: float
    rollout_seconds: float
    update_seconds: float
    ratio_error: float | None = None
    """max |ratio - 1| over the update's on-policy rows (0 exactly when the update reused the
    rollout's forward: retain, reweight); None when none was on-policy (later chunks, or the
    parameters changed)."""
    sync_collectives: int = 0
    """Gradient reductions this update issued (data parallel; one flat all-reduce or
    reduce-scatter per dtype, per update or, Reweight with ``GRPOConfig.grad_sync="group"``,
    per round of prompt groups; under fsdp Retain's and Recompute's backward graphs reduce in
    every backward)."""
    sync_bytes: int = 0
    """Bytes those reductions carried (per rank)."""

