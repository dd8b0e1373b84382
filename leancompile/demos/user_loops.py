"""Diffusion-RL training loops as their users write them, FlowGRPO-style and DanceGRPO-style, with
LeanGRPO added by wrapping one function and marking the two phases.

The loops own everything: sampling under ``no_grad``, rewards, group advantages, the shuffle,
the minibatches, the PPO loss, gradient accumulation, clipping and the optimizer. The only
LeanGRPO lines are the wrapper and the two ``with`` lines (``_phase`` is a no-op for the plain
function, so one loop body runs both ways and they can be compared)::

    velocity = leancompile.lean_compile(policy.velocity, schedule="auto")   # 1
    with phase(velocity, "rollout", train=range(n_train), trajectory_steps=T), \
            torch.no_grad():                                                    # 2
        ... sample T steps, keep latents and log-probs ...
    with phase(velocity, "update"):                                         # 3
        ... shuffle, minibatch, PPO, backward, clip, step ...

``level="model"`` wraps the velocity (the robust default: the loop's own SDE code runs as it
is); ``level="step"`` wraps a whole step, velocity + SDE transition + log-prob, which draws its
sample from ``noise`` in the rollout and scores the ``prev_sample`` the update passes back
(``lean_compile(..., sample_output=0, sample_arg="prev_sample")``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..grpo.advantages import AdvantageConfig, group_advantages, group_ids_for
from ..grpo.sde import kl_to_reference, sde_step
from ..grpo.timesteps import same_noise_latents
from ..lean import synchronize

__all__ = ["LoopConfig", "LoopResult", "flow_grpo_loop", "flow_grpo_iterations",
           "dance_grpo_loop", "make_step", "phase"]


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """Settings of both loops (their defaults follow the repos' configs, shrunk)."""

    prompts: int = 2
    """Prompts per rollout; each gets ``group_size`` samples."""
    group_size: int = 2
    sample_batch: int = 4
    """Samples per sampling call (FlowGRPO's ``sample.batch_size``)."""
    train_batch: int = 2
    """Samples per training call (FlowGRPO's ``train.batch_size``; may differ)."""
    timestep_fraction: float = 0.75
    """FlowGRPO: the first ``int(T * fraction)`` steps are trained. DanceGRPO: a random subset
    of that size of the first ``T - 1`` steps, per sample."""
    optimizer_steps: int = 1
    """Optimizer steps per rollout (FlowGRPO configs take two; only the first is on-policy)."""
    iterations: int = 1
    sde: str = "flow_grpo"
    eta: float = 0.9
    beta: float = 0.0
    """KL weight (FlowGRPO's ``beta``); the reference is a frozen copy of the initial policy."""
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    level: str = "model"
    init_same_noise: bool = False
    """DanceGRPO: one initial latent per prompt group."""
    shuffle: bool = True
    """FlowGRPO: samples shuffled and each sample's timesteps permuted before training. False:
    the update repeats the rollout's batches in order (with ``train_batch == sample_batch``,
    every update call is one rollout call)."""


@dataclass(kw_only=True)
class LoopResult:
    params: dict[str, torch.Tensor]
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """The gradients each optimizer step applied (after clipping)."""
    history: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """The parameters after each iteration."""
    rewards: list[float] = field(default_factory=list)
    """The mean reward of each iteration's rollout."""
    rollout_seconds: float = 0.0
    update_seconds: float = 0.0
    rollout_times: list[float] = field(default_factory=list)
    """Seconds of each iteration's rollout (sampling and scoring; FlowGRPO's loop only)."""
    update_times: list[float] = field(default_factory=list)
    """Seconds of each iteration's update (FlowGRPO's loop only)."""


def phase(fn, name: str, **kwargs):
    """``fn.rollout(**kwargs)`` / ``fn.update()`` for a wrapped step, nothing for a plain one."""
    method = getattr(fn, name, None)
    return method(**kwargs) if method is not None else contextlib.nullcontext()


def make_step(policy, config: LoopConfig):
    """The step-level function: velocity + SDE transition + log-prob (+ the mean for a KL),
    sampling from ``noise`` or scoring ``prev_sample``."""
    def step(latents, step_index, conditions, noise=None, prev_sample=None):
        v = policy.velocity(latents, step_index, conditions)
        return _sde(policy, config, latents, v, step_index, noise=noise, prev_sample=prev_sample)
    return step


def _sde(policy, config, latents, v, k, *, noise, prev_sample):
    """(prev_sample, log_prob, mean, kl_std) of the SDE transition from ``latents`` with
    velocity ``v`` at step ``k``."""
    sigmas = policy.sigmas.to(latents.device)
    out = sde_step(config.sde, latents=latents, velocity=v, sigma=sigmas[k],
                   sigma_next=sigmas[k + 1], eta=config.eta, sigma_max=sigmas[1], noise=noise,
                   prev_sample=prev_sample)
    return out.prev_sample, out.log_prob, out.mean, out.kl_std


def _transition(policy, fn, config, latents, k, conditions, *, noise=None, prev_sample=None):
    """(prev_sample, log_prob, mean, kl_std) of one step, through the velocity (model level)
    or the whole step (step level)."""
    if config.level == "step":
        return fn(latents, k, conditions, noise=noise, prev_sample=prev_sample)
    return _sde(policy, config, latents, fn(latents, k, conditions), k, noise=noise,
                prev_sample=prev_sample)


def _sample(policy, fn, config, x, conditions, steps: int, gen):
    """One sampling call's trajectories from the initial latents ``x``: every step's latents
    ``[B, steps + 1, ...]`` and log-probs ``[B, steps]``, the SDE's noise drawn from ``gen``."""
    traj, lps = [x], []
    for k in range(steps):
        index = torch.full((x.shape[0],), k, dtype=torch.long, device=x.device)
        noise = torch.randn(x.shape, generator=gen).to(x.device)
        x, lp, _, _ = _transition(policy, fn, config, x, index, conditions, noise=noise)
        traj.append(x)
        lps.append(lp)
    return torch.stack(traj, 1), torch.stack(lps, 1)


def _rows(conditions, index):
    return {k: v[index] for k, v in conditions.items()}


def _reward(latents):
    return -(latents.float() - 0.5).square().flatten(1).mean(1)


def _advantages(trajectories, reward, config: LoopConfig, result: LoopResult):
    """Both repos' scoring: the reward of each trajectory's last latent, group advantages (on
    the latents' device: a reward may score on the host); the mean reward is recorded."""
    rewards = reward(trajectories[:, -1])
    advantages = group_advantages(rewards, group_ids_for(config.prompts, config.group_size),
                                  AdvantageConfig(adv_clip_max=config.adv_clip_max))
    result.rewards.append(rewards.mean().item())
    return advantages.to(trajectories.device)


def _ppo_loss(log_prob, old_log_prob, advantages, clip_range: float):
    """Both repos' clipped PPO loss."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.maximum(-advantages * ratio, -advantages * clipped).mean()


class _Accumulation:
    """The optimizer and gradient accumulation as both repos have them: each update makes
    ``calls`` backward calls, in windows of ``ceil(calls / optimizer_steps)``; when a window
    completes (or the update's last call is done): clip, step, zero (and here: record the
    gradients the step applied)."""

    def __init__(self, policy, config: LoopConfig, result: LoopResult, calls: int):
        self.policy, self.config, self.result, self.calls = policy, config, result, calls
        self.optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=config.lr)
        self.every = -(-calls // config.optimizer_steps)
        self.done = 0

    def start_update(self) -> None:
        self.done = 0

    def backward(self, loss) -> None:
        (loss / self.every).backward()
        self.done += 1
        if self.done % self.every == 0 or self.done == self.calls:
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
            self.result.grads.append(_grads(self.policy))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _grads(policy):
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters()
            if p.grad is not None}


def _state(policy):
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def flow_grpo_loop(policy, fn, config: LoopConfig, *, reference=None, seed: int = 0,
                   reward=_reward) -> LoopResult:
    """FlowGRPO's ``train_sd3.py`` shape: sample ``prompts * group_size`` trajectories in
    sampling batches, score them, then shuffle the samples, permute each sample's trained
    timesteps, re-batch with ``train_batch`` and train with PPO and gradient accumulation.
    ``fn`` is the velocity (``level="model"``) or the step (``level="step"``), plain or
    wrapped; ``reference``: the frozen policy for the KL (``beta > 0``)."""
    result = LoopResult(params={})
    for result in flow_grpo_iterations(policy, fn, config, reference=reference, seed=seed,
                                       reward=reward):
        pass
    if not result.history:  # no iteration: the parameters as they are
        result.params = _state(policy)
    return result


def flow_grpo_iterations(policy, fn, config: LoopConfig, *, reference=None, seed: int = 0,
                         reward=_reward):
    """``flow_grpo_loop`` one iteration at a time: yields its ``LoopResult`` after each
    iteration (the same object, grown by one entry of ``rewards``, ``history``,
    ``rollout_times`` and ``update_times``), so that two loops can be run in alternation."""
    gen = torch.Generator().manual_seed(seed)
    steps = len(policy.sigmas) - 1
    n_train = max(1, int(steps * config.timestep_fraction))
    total = config.prompts * config.group_size
    result = LoopResult(params={})
    accumulation = _Accumulation(policy, config, result,
                                 calls=-(-total // config.train_batch) * n_train)
    prompts = policy.example_conditions(config.prompts, gen)
    for _ in range(config.iterations):
        conditions = {k: v.repeat_interleave(config.group_size, 0) for k, v in prompts.items()}
        start = time.perf_counter()
        trajectories, log_probs = [], []
        # The first n_train steps of every sampling batch's trajectories are trained.
        with phase(fn, "rollout", train=range(n_train), trajectory_steps=steps), \
                torch.no_grad():
            for b in range(0, total, config.sample_batch):
                cond = _rows(conditions, slice(b, b + config.sample_batch))
                rows = next(iter(cond.values())).shape[0]
                x = policy.initial_latents(rows, gen).float()
                traj, lps = _sample(policy, fn, config, x, cond, steps, gen)
                trajectories.append(traj)
                log_probs.append(lps)
        trajectories, log_probs = torch.cat(trajectories), torch.cat(log_probs)
        advantages = _advantages(trajectories, reward, config, result)
        synchronize(trajectories.device)
        result.rollout_times.append(time.perf_counter() - start)
        result.rollout_seconds += result.rollout_times[-1]

        start = time.perf_counter()
        if config.shuffle:
            perm = torch.randperm(total, generator=gen)
            timesteps = torch.stack([torch.randperm(n_train, generator=gen)
                                     for _ in range(total)])
        else:
            perm = torch.arange(total)
            timesteps = torch.arange(n_train).expand(total, n_train)
        accumulation.start_update()
        with phase(fn, "update"):
            for b in range(0, total, config.train_batch):
                rows = perm[b:b + config.train_batch]
                cond = _rows(conditions, rows)
                for j in range(n_train):
                    k = timesteps[rows, j].to(trajectories.device)
                    x, x_next = trajectories[rows, k], trajectories[rows, k + 1]
                    _, lp, mean, kl_std = _transition(policy, fn, config, x, k, cond,
                                                      prev_sample=x_next)
                    loss = _ppo_loss(lp, log_probs[rows, k], advantages[rows], config.clip_range)
                    if config.beta > 0:
                        with torch.no_grad():
                            _, _, mean_ref, _ = _transition(
                                reference, reference.velocity,
                                dataclasses.replace(config, level="model"), x, k, cond,
                                prev_sample=x_next)
                        loss = loss + config.beta * kl_to_reference(mean, mean_ref,
                                                                    kl_std).mean()
                    accumulation.backward(loss)
        synchronize(trajectories.device)
        result.update_times.append(time.perf_counter() - start)
        result.update_seconds += result.update_times[-1]
        result.history.append(_state(policy))
        result.params = result.history[-1]
        yield result


def dance_grpo_loop(policy, fn, config: LoopConfig, *, seed: int = 0,
                    reward=_reward) -> LoopResult:
    """DanceGRPO's ``train_grpo_flux.py`` shape: every prompt's group sampled from one initial
    latent (``init_same_noise``), DanceGRPO's SDE; then each sample trained alone (batch 1)
    over its own random subset of the first ``T - 1`` steps, gradients accumulated over the
    rollout, ``optimizer_steps`` steps (DanceGRPO's default takes several)."""
    gen = torch.Generator().manual_seed(seed)
    steps = len(policy.sigmas) - 1
    n_train = max(1, int((steps - 1) * config.timestep_fraction))
    total = config.prompts * config.group_size
    result = LoopResult(params={})
    accumulation = _Accumulation(policy, config, result, calls=total * n_train)
    prompts = policy.example_conditions(config.prompts, gen)
    for _ in range(config.iterations):
        conditions = {k: v.repeat_interleave(config.group_size, 0) for k, v in prompts.items()}
        chosen = torch.stack([torch.randperm(steps - 1, generator=gen)[:n_train]
                              for _ in range(total)])
        train = torch.zeros(steps, total, dtype=torch.bool)
        train[chosen.T, torch.arange(total)] = True
        start = time.perf_counter()
        with phase(fn, "rollout", train=train), torch.no_grad():
            x = policy.initial_latents(config.prompts, gen).float()
            x = same_noise_latents(x, config.group_size) if config.init_same_noise else \
                policy.initial_latents(total, gen).float()
            trajectories, log_probs = _sample(policy, fn, config, x, conditions, steps, gen)
        advantages = _advantages(trajectories, reward, config, result)
        synchronize(trajectories.device)
        result.rollout_seconds += time.perf_counter() - start

        start = time.perf_counter()
        accumulation.start_update()
        with phase(fn, "update"):
            for i in range(total):
                cond = _rows(conditions, slice(i, i + 1))
                for k in chosen[i].tolist():
                    index = torch.full((1,), k, dtype=torch.long, device=trajectories.device)
                    x, x_next = trajectories[i:i + 1, k], trajectories[i:i + 1, k + 1]
                    _, lp, _, _ = _transition(policy, fn, config, x, index, cond,
                                              prev_sample=x_next)
                    accumulation.backward(_ppo_loss(lp, log_probs[i:i + 1, k],
                                                    advantages[i:i + 1], config.clip_range))
        synchronize(trajectories.device)
        result.update_seconds += time.perf_counter() - start
        result.history.append(_state(policy))
    result.params = _state(policy)
    return result
