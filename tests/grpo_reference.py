"""An independent eager-autograd GRPO gradient: the loop FlowGRPO / DanceGRPO run in their
update phase (re-forward each selected step with grad, PPO-clipped loss, backward)."""

from __future__ import annotations

import torch

from leancompile.grpo.sde import kl_to_reference, sde_step


def eager_grpo_gradients(policy, rollout, *, sde, eta, clip_range=1e-4, beta=0.0,
                         reference=None, steps=None):
    """Gradients of the GRPO loss of ``rollout`` (a ``leancompile.grpo.trainer.Rollout``) by
    plain eager autograd. ``reference``: a policy for the KL term. ``steps``: ``[B, S]`` steps
    to train (default: ``rollout.selected``)."""
    steps = rollout.selected if steps is None else steps
    batch, num_selected = steps.shape
    norm = batch * num_selected
    sigmas = policy.sigmas
    params = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    for k in range(rollout.log_probs.shape[1]):
        rows = (steps == k).any(dim=1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        x, x_next = rollout.latents[rows, k], rollout.latents[rows, k + 1]
        cond = {key: value[rows] for key, value in rollout.conditions.items()}
        velocity = policy.velocity(x, k, cond)
        out = sde_step(sde, latents=x, velocity=velocity, sigma=sigmas[k], sigma_next=sigmas[k + 1],
                       eta=eta, prev_sample=x_next, sigma_max=sigmas[1])
        ratio = torch.exp(out.log_prob - rollout.log_probs[rows, k])
        adv = rollout.advantages[rows]
        loss = torch.maximum(-adv * ratio,
                             -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)).sum()
        if beta > 0:
            with torch.no_grad():
                ref = sde_step(sde, latents=x, velocity=reference.velocity(x, k, cond),
                               sigma=sigmas[k], sigma_next=sigmas[k + 1], eta=eta,
                               prev_sample=x_next, sigma_max=sigmas[1])
            loss = loss + beta * kl_to_reference(out.mean, ref.mean, out.kl_std).sum()
        (loss / norm).backward()
    return {n: p.grad.detach().clone() for n, p in params.items()}


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def agreement(grads, reference) -> tuple[float, float]:
    """(cosine similarity, relative L2 error) of two gradient dicts, in float64."""
    a, b = flat(grads).double(), flat(reference).double()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    return cosine, ((a - b).norm() / b.norm()).item()


def expected_syncs(cfg, schedule: str, num_prompts: int, world: int, *, parallel: str) -> int:
    """Gradient reductions of one data-parallel update, counted from the layout's definition:
    Reweight with per-group sync reduces after every round of prompt groups (``shared``: the
    ``max(1, R // M)`` worker groups take one prompt each per round; ``conventional``: each
    rank one of its own), everything else once per update."""
    per_group = schedule == "reweight" and not cfg.global_std and cfg.layout != "scattered"
    group_sync = cfg.grad_sync == "group" or (cfg.grad_sync == "auto" and parallel == "fsdp")
    if not (per_group and group_sync):
        return 1
    at_once = max(1, world // cfg.group_size) if cfg.layout == "shared" else world
    return -(-num_prompts // at_once)
