"""The policy step LeanGRPO captures: model velocity plus the SDE transition and its log-prob.

``PolicyStep`` is a module whose forward is one denoising step of a whole batch:

    sample mode: (x_t, step_index, noise, *conditions) -> (x_{t+1}, log_prob[, mean, kl_std])
    score mode:  (x_t, step_index, x_{t+1}, *conditions) -> (log_prob[, mean, kl_std])

Noise is an argument, never drawn inside, so the captured graph has no random op and the same
inputs give the same forward: what lets a schedule reuse the rollout's forward for the update.
``mean`` (and the std FlowGRPO's KL divides by) are outputs only when a KL term needs them.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .sde import SDE_KINDS, sde_step

__all__ = ["PolicyStep"]


class PolicyStep(nn.Module):
    """One batched denoising step of ``policy`` as a capturable module (see module docstring).

    ``policy`` must provide ``velocity(latents, step_index, conditions)`` and ``sigmas``
    (``[T + 1]``); ``step_index`` is a LongTensor ``[B]``.
    """

    def __init__(self, policy: nn.Module, *, sde: str, eta: float,
                 condition_keys: Sequence[str], mode: str = "sample", with_mean: bool = False):
        super().__init__()
        if sde not in SDE_KINDS:
            raise ValueError(f"sde={sde!r} is not one of {SDE_KINDS}")
        if mode not in ("sample", "score"):
            raise ValueError(f"mode={mode!r}; use 'sample' or 'score'")
        self.policy = policy
        self.sde = sde
        self.eta = float(eta)
        self.condition_keys = tuple(condition_keys)
        self.mode = mode
        self.with_mean = with_mean

    def forward(self, latents, step_index, noise_or_next, *conditions):
        cond = dict(zip(self.condition_keys, conditions))
        velocity = self.policy.velocity(latents, step_index, cond)
        sigmas = self.policy.sigmas.to(latents.device)
        given = {"noise": noise_or_next} if self.mode == "sample" else {
            "prev_sample": noise_or_next}
        out = sde_step(self.sde, latents=latents, velocity=velocity, sigma=sigmas[step_index],
                       sigma_next=sigmas[step_index + 1], eta=self.eta, sigma_max=sigmas[1],
                       **given)
        extra = ()
        if self.with_mean:
            per_sample = (latents.shape[0],) + (1,) * (latents.dim() - 1)
            extra = (out.mean, torch.broadcast_to(out.kl_std, per_sample).clone())
        if self.mode == "sample":
            return (out.prev_sample, out.log_prob) + extra
        return (out.log_prob,) + extra
