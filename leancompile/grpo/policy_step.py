"""The policy step LeanGRPO trains: model velocity plus the SDE transition and its log-prob.

``PolicyStep`` is a module whose forward is one denoising step of a whole batch::

    (x_t, step_index, *conditions[, mean_ref], noise=...)       -> (x_{t+1}, log_prob[, kl])
    (x_t, step_index, *conditions[, mean_ref], prev_sample=...) -> (x_{t+1}, log_prob[, kl])

The first draws the sample ``x_{t+1} = mean + std * noise`` (the rollout); the second scores a
given one (the update; ``x_{t+1}`` is then ``prev_sample`` itself). Both compute the log-prob by
the same formula from the sample, so a rollout call and the update call that passes its sample
back compute the same thing: what lets ``lean_compile(..., sample_output=0,
sample_arg="prev_sample")`` reuse the rollout's forward for the update. The noise is an
argument, never drawn inside: the traced graph has no random op.

With ``with_kl`` the step also takes the reference policy's transition mean ``mean_ref`` (last
positional argument) and returns FlowGRPO's KL to it per sample (``kl_to_reference`` with
``kl_std``): a per-row scalar like the log-prob, so that Reweight keeps its gradient too.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .sde import SDE_KINDS, kl_to_reference, sde_step

__all__ = ["PolicyStep", "Velocity", "call_args"]


class PolicyStep(nn.Module):
    """One batched denoising step of ``policy`` as a module (see the module docstring).

    ``policy`` must provide ``velocity(latents, step_index, conditions)`` and ``sigmas``
    (``[T + 1]``); ``step_index`` is a LongTensor ``[B]``.
    """

    def __init__(self, policy: nn.Module, *, sde: str, eta: float,
                 condition_keys: Sequence[str], with_kl: bool = False):
        super().__init__()
        if sde not in SDE_KINDS:
            raise ValueError(f"sde={sde!r} is not one of {SDE_KINDS}")
        self.policy = policy
        self.sde = sde
        self.eta = float(eta)
        self.condition_keys = tuple(condition_keys)
        self.with_kl = with_kl

    def forward(self, latents, step_index, *conditions, noise=None, prev_sample=None):
        mean_ref = None
        if self.with_kl:
            conditions, mean_ref = conditions[:-1], conditions[-1]
        cond = dict(zip(self.condition_keys, conditions))
        velocity = self.policy.velocity(latents, step_index, cond)
        sigmas = self.policy.sigmas.to(latents.device)
        out = sde_step(self.sde, latents=latents, velocity=velocity, sigma=sigmas[step_index],
                       sigma_next=sigmas[step_index + 1], eta=self.eta, sigma_max=sigmas[1],
                       noise=noise, prev_sample=prev_sample)
        if self.with_kl:
            return out.prev_sample, out.log_prob, kl_to_reference(out.mean, mean_ref,
                                                                  out.kl_std)
        return out.prev_sample, out.log_prob


def call_args(x: torch.Tensor, k: int, cond_list, local: torch.Tensor, *,
              with_kl: bool) -> list:
    """The positional arguments of a ``PolicyStep`` call on the rows ``local`` of ``x`` at step
    ``k`` (``with_kl``: a placeholder reference mean last, filled in for trained calls)."""
    step = torch.full((local.numel(),), k, dtype=torch.long, device=x.device)
    args = [x[local], step] + [c[local] for c in cond_list]
    if with_kl:
        args.append(torch.zeros_like(args[0]))
    return args


class Velocity(nn.Module):
    """``policy.velocity`` as a module's forward, for ``torch.func.functional_call`` with other
    weights (the KL's reference; the gathered parameters under ``parallel="fsdp"``)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, latents, step_index, conditions):
        return self.policy.velocity(latents, step_index, conditions)
