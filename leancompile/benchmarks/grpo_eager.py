"""The benchmark's ``eager`` row (``leancompile bench grpo``, ``benchmarks/grpo.py``): one
FlowGRPO iteration in plain eager PyTorch, as FlowGRPO's ``scripts/train_flux.py`` runs it, with
the trainer's draws, so that its gradient is comparable to ``GRPOTrainer.compute_gradients``'."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

__all__ = ["EagerResult", "eager_flow_grpo_gradients"]


@dataclass(kw_only=True)
class EagerResult:
    """One plain eager FlowGRPO iteration's gradients and its two timed phases."""

    grads: dict[str, torch.Tensor]
    """Trainable parameters by name, in ``policy.named_parameters()`` order."""
    rewards: torch.Tensor
    advantages: torch.Tensor
    rollout_seconds: float
    """Sampling under ``no_grad`` (velocity + SDE step + log-prob per step), rewards and group
    advantages."""
    update_seconds: float
    """Forward with grad + log-prob + PPO loss + backward per selected step."""
    ratio_error: float = 0.0
    """max |ratio - 1| over the update's rows (on-policy: 1 up to the rounding of the grad
    forward against the no-grad one)."""


def eager_flow_grpo_gradients(policy, config, conditions: Mapping[str, torch.Tensor],
                              reward_fn: Callable, generator: torch.Generator) -> EagerResult:
    """One FlowGRPO iteration in plain eager PyTorch (no compile, no leancompile), without the
    optimizer step: the gradient that ``GRPOTrainer(policy, reward_fn, None, config)
    .compute_gradients(conditions, generator)`` computes, by FlowGRPO's loop.

    ``config`` is the trainer's ``GRPOConfig`` (``sde``, ``eta``, ``group_size``, timestep
    selection, clipping; ``beta`` must be 0). The draws from ``generator`` are the trainer's (a
    base seed, then per-sample generators: ``leancompile.grpo.layout.draw_samples``); so with
    the same generator state both see the same trajectory noise. Gradients accumulate in
    ``.grad`` (which must be empty on entry) and are handed back, leaving ``.grad`` empty.
    """
    from ..grpo.advantages import AdvantageConfig, group_advantages, group_ids_for
    from ..grpo.rewards import check_rewards
    from ..grpo.sde import sde_step
    from ..grpo.layout import draw_samples, step_seed
    from ..lean import synchronize

    if config.beta > 0:
        raise ValueError("the eager FlowGRPO row has no KL term; use beta=0")
    params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    if any(p.grad is not None for _, p in params):
        raise ValueError("the policy's parameters already hold gradients; clear them first")
    keys = list(conditions)
    num_prompts = next(iter(conditions.values())).shape[0]
    batch = num_prompts * config.group_size
    cond = {k: v.repeat_interleave(config.group_size, dim=0) for k, v in conditions.items()}
    sigmas = policy.sigmas
    num_steps = len(sigmas) - 1

    # The same draws as the trainer: one base seed from the generator, then each sample's own
    # generator (trained steps, initial latent, SDE noise).
    draws = draw_samples(policy, selection=config.selection, num_prompts=num_prompts,
                         group_size=config.group_size, num_steps=num_steps,
                         seed=step_seed(generator), init_same_noise=config.init_same_noise)
    selected, latents, noise = draws.selected, draws.latents0, draws.noise
    device = latents.device
    sigmas = sigmas.to(device)

    def transition(x, step, **sample):
        velocity = policy.velocity(x, step, {k: cond[k] for k in keys})
        return sde_step(config.sde, latents=x, velocity=velocity, sigma=sigmas[step],
                        sigma_next=sigmas[step + 1], eta=config.eta, sigma_max=sigmas[1],
                        **sample)

    # Sampling: every step of every sample, no autograd graph.
    start = time.perf_counter()
    with torch.no_grad():
        x = latents
        trajectory, log_probs = [x], torch.zeros(batch, num_steps, device=device)
        for k in range(num_steps):
            out = transition(x, torch.full((batch,), k, dtype=torch.long, device=device),
                             noise=noise[k])
            x = out.prev_sample
            trajectory.append(x)
            log_probs[:, k] = out.log_prob
        trajectory = torch.stack(trajectory, dim=1)
        rewards = check_rewards(reward_fn(x, cond), batch).to("cpu")  # (as the trainer's)
        advantages = group_advantages(
            rewards, group_ids_for(num_prompts, config.group_size),
            AdvantageConfig(global_std=config.global_std, adv_clip_max=config.adv_clip_max))
    synchronize(device)
    rollout_seconds = time.perf_counter() - start

    # FlowGRPO's update: for the j-th selected step of every sample, a forward with grad, the
    # log-prob of the recorded transition, the PPO clipped loss (mean over the batch), and a
    # backward; accelerate's gradient accumulation over the selected steps divides each loss
    # by their number.
    start = time.perf_counter()
    rows = torch.arange(batch, device=device)
    selected = selected.to(device)
    num_selected = selected.shape[1]
    adv = torch.clamp(advantages, -config.adv_clip_max, config.adv_clip_max).to(device)
    errors = []  # (read once at the end: no sync per step)
    for j in range(num_selected):
        step = selected[:, j]
        out = transition(trajectory[rows, step], step, prev_sample=trajectory[rows, step + 1])
        ratio = torch.exp(out.log_prob - log_probs[rows, step])
        errors.append((ratio.detach() - 1).abs().max())
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)
        loss = torch.mean(torch.maximum(unclipped, clipped)) / num_selected
        loss.backward()
    ratio_error = torch.stack(errors).max().item() if errors else 0.0
    grads = {}
    for name, p in params:
        grads[name] = torch.zeros_like(p) if p.grad is None else p.grad
        p.grad = None
    synchronize(device)
    update_seconds = time.perf_counter() - start
    return EagerResult(grads=grads, rewards=rewards, advantages=advantages,
                       rollout_seconds=rollout_seconds, update_seconds=update_seconds,
                       ratio_error=ratio_error)
