"""GRPO on a diffusion policy with compiler-produced schedules (LeanGRPO).

``GRPOTrainer(policy, reward_fn, optimizer, config)``: ``compute_gradients(conditions)`` runs
one rollout and its update under the schedule ``config.schedule`` (``auto`` picks one) and
returns the gradients without touching the optimizer; ``step(conditions)`` also applies them.
The trainer only composes pieces: timestep selection, the captured ``PolicyStep`` graphs, the
schedule plans (``leancompile.passes.lean_grpo``), the ``ScheduleRunner``, rewards, group
advantages.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn as nn

from ..capture import RandomOpInGraphError, module_input_names, module_inputs
from ..passes.lean_grpo import (SCHEDULES, SchedulePlan, ScheduleReport, build_schedule_plans,
                                choose_schedule, graph_flops)
from .advantages import AdvantageConfig, group_advantages, group_ids_for
from .graphs_cache import StepGraphCache
from .rewards import check_rewards
from .runner import ScheduleRunner
from .sde import SDE_KINDS
from .step import PolicyStep
from .timesteps import TimestepSelection, same_noise_latents, select_timesteps

__all__ = ["GRPOConfig", "GRPOTrainer", "GradResult", "Rollout", "PendingUpdate",
           "OffPolicyWarning"]

log = logging.getLogger("leancompile")


class OffPolicyWarning(UserWarning):
    """The parameters changed between rollout and update: that update was recomputed."""


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """Configuration of one GRPO trainer."""

    schedule: str = "auto"
    """``recompute`` (baseline), ``retain``, ``reweight`` or ``auto`` (chosen per rollout from
    the bytes the captured graphs save; see ``memory_budget_bytes``)."""
    sde: str = "flow_grpo"
    """Transition: ``flow_grpo``, ``flow_grpo_cps`` or ``dance_grpo``."""
    eta: float = 0.7
    """Noise level of the SDE (FlowGRPO ``noise_level``: 0.7, 0.9 for FLUX; DanceGRPO 0.3)."""
    group_size: int = 4
    """Samples per prompt; advantages are relative within a group."""
    timestep_fraction: float = 1.0
    """Fraction of denoising steps trained per sample."""
    timestep_strategy: str | None = None
    """``first`` (FlowGRPO), ``window`` (FlowGRPO Fast) or ``dance_grpo``; None follows
    ``sde``."""
    beta: float = 0.0
    """Weight of the KL to the reference policy (0: no reference forward)."""
    reference: str = "auto"
    """KL reference: ``copy`` (frozen copy of the initial trainable weights), ``adapter``
    (peft LoRA with ``lora_B`` zeroed, i.e. adapters disabled) or ``auto`` (adapter when the
    policy has LoRA weights)."""
    clip_range: float = 1e-4
    """PPO ratio clip (FlowGRPO default); inactive on-policy where the ratio is 1."""
    adv_clip_max: float = 5.0
    global_std: bool = False
    """Normalise advantages by the std of the whole batch (FlowGRPO ``global_std``)."""
    init_same_noise: bool = False
    """DanceGRPO: one initial latent per prompt group; only the SDE noise differs."""
    memory_budget_bytes: int | None = None
    """Extra memory a schedule may use; None: ``memory_fraction`` of free memory now."""
    memory_fraction: float = 0.5
    partitioner_budgets: tuple[float, ...] = (0.5, 0.2, 0.0)
    """Activation budgets tried, in order, when Retain does not fit (save less, recompute
    cheap ops in the backward) before falling back to Reweight or Recompute."""
    compiler: str = "aot_eager"
    """What runs the captured graphs: ``aot_eager`` or ``inductor``."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping in ``step`` (None: no clipping)."""
    updates_per_rollout: int = 1
    """Optimizer steps per rollout in ``step``; the selected steps are split in this many
    chunks. Only the first is on-policy; the rest are recomputed."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES + ("auto",):
            raise ValueError(f"schedule={self.schedule!r}; use one of {SCHEDULES + ('auto',)}")
        if self.sde not in SDE_KINDS:
            raise ValueError(f"sde={self.sde!r}; use one of {SDE_KINDS}")
        if self.eta < 0:
            raise ValueError(f"eta={self.eta} must be >= 0")
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: advantages need at least 2 "
                             "samples per prompt")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction={self.timestep_fraction} must be in (0, 1]")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0")
        if self.reference not in ("auto", "copy", "adapter"):
            raise ValueError(f"reference={self.reference!r}; use 'auto', 'copy' or 'adapter'")
        if self.compiler not in ("aot_eager", "inductor"):
            raise ValueError(f"compiler={self.compiler!r}; use 'aot_eager' or 'inductor'")
        if self.updates_per_rollout < 1:
            raise ValueError(f"updates_per_rollout={self.updates_per_rollout} must be >= 1")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")

    @property
    def strategy(self) -> str:
        if self.timestep_strategy is not None:
            return self.timestep_strategy
        return "dance_grpo" if self.sde == "dance_grpo" else "first"


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


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


class GRPOTrainer:
    """See the module docstring. ``optimizer`` may be None for gradient-only use."""

    def __init__(self, policy: nn.Module, reward_fn: Callable, optimizer, config: GRPOConfig):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        self.policy = policy
        self.reward_fn = reward_fn
        self.optimizer = optimizer
        self.config = config
        self.graphs = StepGraphCache(compiler=config.compiler)
        self._modules: dict = {}
        self.trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the policy has no parameter with requires_grad=True")
        self._reference = self._make_reference() if config.beta > 0 else None
        self.last_rollout: Rollout | None = None

    # -- set-up -------------------------------------------------------------------------------
    def _make_reference(self) -> dict[str, torch.Tensor]:
        mode = self.config.reference
        has_lora = any("lora_B" in n for n in self.trainable)
        if mode == "auto":
            mode = "adapter" if has_lora else "copy"
        if mode == "adapter":
            if not has_lora:
                raise ValueError("reference='adapter' needs a peft LoRA policy (parameters named"
                                 " ...lora_B...); use reference='copy'")
            # lora_B = 0 makes every adapter add exactly zero: the base model.
            return {f"policy.{n}": torch.zeros_like(p) for n, p in self.policy.named_parameters()
                    if "lora_B" in n}
        return {f"policy.{n}": p.detach().clone() for n, p in self.policy.named_parameters()
                if p.requires_grad}

    def _step_module(self, mode: str, keys) -> PolicyStep:
        cfg = self.config
        key = (mode, tuple(keys), cfg.sde, cfg.eta, cfg.beta > 0)
        if key not in self._modules:
            self._modules[key] = PolicyStep(
                self.policy, sde=self.config.sde, eta=self.config.eta, condition_keys=keys,
                mode=mode, with_mean=self.config.beta > 0)
        return self._modules[key]

    def _grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for n, p in self.policy.named_parameters()
                   if p.requires_grad)

    def _versions(self) -> dict[str, int]:
        return {n: p._version for n, p in self.policy.named_parameters() if p.requires_grad}

    # -- schedule choice ---------------------------------------------------------------------
    def _plans(self, sample_module, example, mask, schedule, allow_random):
        """Capture the sample graphs, build the three plans, pick one (auto, with smaller
        partitioner budgets for retain when it does not fit)."""
        cfg = self.config
        device = example[0].device
        budget_bytes = self._budget_bytes(device)
        rows_per_step = mask.sum(0).tolist()
        num_rows, num_steps = mask.shape
        samples_in_flight = num_rows if cfg.global_std else cfg.group_size

        def args_for(n):
            return [a[:n] for a in example]

        def plans_for(partitioner_budget):
            full = self.graphs.get(sample_module, args_for(num_rows), key="sample",
                                   memory_budget=partitioner_budget, allow_random=allow_random)
            retain_bytes = 0
            for n in rows_per_step:
                if n:
                    retain_bytes += self.graphs.get(
                        sample_module, args_for(n), key="sample", memory_budget=partitioner_budget,
                        allow_random=allow_random).captured.saved_bytes
            if schedule in ("auto", "reweight"):
                one = self.graphs.get(sample_module, args_for(1), key="sample",
                                      memory_budget=partitioner_budget,
                                      allow_random=allow_random).captured.saved_bytes
            else:  # not run: an estimate is enough for the report
                one = full.captured.saved_bytes // num_rows
            if full.costs is None:
                full.costs = graph_flops(full.captured)
            return build_schedule_plans(
                costs=full.costs, selected_calls=sum(1 for n in rows_per_step if n),
                total_calls=num_steps, retain_bytes=retain_bytes,
                reweight_call_bytes=one,
                samples_in_flight=samples_in_flight, grad_bytes=self._grad_bytes(),
                with_kl=cfg.beta > 0, memory_budget_bytes=budget_bytes,
                partitioner_budget=partitioner_budget)

        plans = plans_for(None)
        if schedule != "auto":
            return schedule, f"schedule={schedule!r} requested", plans, None
        name, reason = choose_schedule(plans)
        if name == "retain":
            return name, reason, plans, None
        for partitioner_budget in cfg.partitioner_budgets:
            smaller = plans_for(partitioner_budget)
            if smaller["retain"].fits:
                plans["retain"] = smaller["retain"]
                return "retain", (f"retain with the partitioner's activation budget "
                                  f"{partitioner_budget}: keeps "
                                  f"{smaller['retain'].peak_bytes} bytes, within "
                                  f"{budget_bytes}"), plans, partitioner_budget
        return name, reason + f" (also at partitioner budgets {cfg.partitioner_budgets})", \
            plans, None

    def _setup(self, conditions, generator, *, schedule, chunks) -> "_Setup":
        """Everything drawn and captured before the rollout, and the chosen plan."""
        cfg = self.config
        keys = list(conditions)
        num_prompts = next(iter(conditions.values())).shape[0]
        batch = num_prompts * cfg.group_size
        cond = {k: v.repeat_interleave(cfg.group_size, dim=0) for k, v in conditions.items()}
        cond_list = [cond[k] for k in keys]
        num_steps = len(self.policy.sigmas) - 1

        # Drawn before the rollout: the trained steps, the initial latents, all SDE noise.
        selected = select_timesteps(
            TimestepSelection(strategy=cfg.strategy, fraction=None if cfg.strategy == "window"
                              else cfg.timestep_fraction),
            batch=batch, num_steps=num_steps, generator=generator)
        if not 1 <= chunks <= selected.shape[1]:
            raise ValueError(f"chunks={chunks} must be between 1 and the {selected.shape[1]} "
                             "selected steps per sample")
        if cfg.init_same_noise:
            latents0 = same_noise_latents(
                self.policy.initial_latents(num_prompts, generator), cfg.group_size)
        else:
            latents0 = self.policy.initial_latents(batch, generator)
        latents0 = latents0.float()
        noise = torch.randn((num_steps,) + tuple(latents0.shape), generator=generator,
                            dtype=torch.float32, device=latents0.device)
        chunk_steps = list(torch.tensor_split(selected, chunks, dim=1))
        mask = torch.zeros(batch, num_steps, dtype=torch.bool)
        mask.scatter_(1, chunk_steps[0], True)

        sample_module = self._step_module("sample", keys)
        score_module = self._step_module("score", keys)
        example = [latents0, torch.zeros(batch, dtype=torch.long), noise[0]] + cond_list
        schedule = cfg.schedule if schedule is None else schedule
        if schedule not in SCHEDULES + ("auto",):
            raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULES + ('auto',)}")
        allow_random = schedule == "recompute"
        try:
            schedule, reason, plans, partitioner_budget = self._plans(
                sample_module, example, mask, schedule, allow_random)
        except RandomOpInGraphError as err:
            raise RandomOpInGraphError(f"schedule={schedule!r}: {err}") from None

        return _Setup(keys=keys, num_prompts=num_prompts, batch=batch, cond=cond,
                      cond_list=cond_list, selected=selected, latents0=latents0, noise=noise,
                      chunk_steps=chunk_steps, mask=mask, sample_module=sample_module,
                      score_module=score_module, schedule=schedule, allow_random=allow_random,
                      reason=reason, plans=plans, partitioner_budget=partitioner_budget,
                      budget_bytes=self._budget_bytes(latents0.device))

    def explain(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                schedule: str | None = None) -> ScheduleReport:
        """Capture the step graphs and build the plans for this batch without running the
        rollout: the three schedules with memory and time estimates, and the choice."""
        st = self._setup(conditions, generator, schedule=schedule, chunks=1)
        graph = self.graphs.get(st.sample_module, [
            st.latents0, torch.zeros(st.batch, dtype=torch.long), st.noise[0]] + st.cond_list,
            key="sample", memory_budget=st.partitioner_budget, allow_random=st.allow_random)
        nodes = {name: len(gm.graph.nodes) for name, gm in (
            ("forward", graph.captured.forward), ("backward", graph.captured.backward),
            ("inference", graph.captured.inference))}
        return ScheduleReport(
            plans=st.plans, chosen=st.schedule, reason=st.reason, batch=st.batch,
            num_steps=st.noise.shape[0], selected_per_sample=st.chunk_steps[0].shape[1],
            saved_bytes_per_call=graph.captured.saved_bytes,
            memory_budget_bytes=st.budget_bytes, graph_nodes=nodes)

    def _budget_bytes(self, device) -> int:
        cfg = self.config
        if cfg.memory_budget_bytes is not None:
            return cfg.memory_budget_bytes
        return int(_free_memory_bytes(device) * cfg.memory_fraction)

    # -- the main entry ----------------------------------------------------------------------
    def compute_gradients(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                          schedule: str | None = None) -> GradResult:
        """Rollout + gradients (no optimizer step). ``conditions``: one row per prompt; each
        row is repeated ``group_size`` times (rows are prompt-major). ``schedule`` overrides
        ``config.schedule`` for this call (the captured graphs are shared)."""
        return self.rollout(conditions, generator, schedule=schedule).update()

    def rollout(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                chunks: int = 1, schedule: str | None = None) -> "PendingUpdate":
        """Run the rollout (with the schedule's forward/backward work) and score it; the
        returned ``PendingUpdate.update()`` computes the gradients. Changing the parameters in
        between (an optimizer step) is detected and that update is recomputed.
        ``chunks > 1`` splits each sample's selected steps into that many chunks; only the first
        goes through the schedule (``pending.update(chunk=c)`` recomputes chunk ``c``)."""
        cfg = self.config
        st = self._setup(conditions, generator, schedule=schedule, chunks=chunks)
        batch, cond, cond_list, mask, plans = st.batch, st.cond, st.cond_list, st.mask, st.plans
        sample_module, score_module, schedule = st.sample_module, st.score_module, st.schedule
        latents0, noise, chunk_steps = st.latents0, st.noise, st.chunk_steps
        inputs = module_inputs(sample_module)
        ref_inputs = module_inputs(sample_module, self._reference) if self._reference else None
        names = module_input_names(sample_module)
        trainable_idx = [names.index(f"policy.{n}") for n in self.trainable]

        def runner_for(name, norm, budget=None):
            return ScheduleRunner(
                plan=plans[name], graphs=self.graphs, sample_module=sample_module,
                score_module=score_module, module_inputs=inputs, ref_inputs=ref_inputs,
                trainable=trainable_idx, beta=cfg.beta, clip_range=cfg.clip_range, norm=norm,
                partitioner_budget=budget, allow_random=st.allow_random or name == "recompute")

        runner = runner_for(schedule, batch * chunk_steps[0].shape[1], st.partitioner_budget)
        versions = self._versions()
        adv_config = AdvantageConfig(global_std=cfg.global_std, adv_clip_max=cfg.adv_clip_max)
        group_ids = group_ids_for(st.num_prompts, cfg.group_size)

        start = time.perf_counter()
        rewards = torch.zeros(batch)
        if schedule == "reweight":
            trajectory, log_probs = self._reweight_rollout(
                runner, latents0, noise, cond_list, cond, mask, rewards, adv_config, group_ids)
        else:
            trajectory, log_probs = runner.rollout(
                latents=latents0, noise=noise, conditions=cond_list, selected=mask,
                rows=torch.arange(batch))
            rewards = check_rewards(self.reward_fn(trajectory[:, -1], cond), batch)
        advantages = group_advantages(rewards, group_ids, adv_config)
        rollout_seconds = time.perf_counter() - start
        record = Rollout(latents=trajectory, selected=st.selected, log_probs=log_probs,
                         rewards=rewards, advantages=advantages, conditions=cond, noise=noise)
        self.last_rollout = record
        return PendingUpdate(trainer=self, runner=runner, runner_for=runner_for,
                             schedule=schedule, reason=st.reason, plans=plans, rollout=record,
                             chunk_steps=chunk_steps, versions=versions,
                             cond_list=cond_list, rollout_seconds=rollout_seconds)

    def _reweight_rollout(self, runner, latents0, noise, cond_list, cond, mask, rewards,
                          adv_config, group_ids):
        """Reweight, one prompt group at a time: with per-group advantage statistics a group
        is corrected (``grad += A_i G_i``) as soon as it is scored, freeing its buffers; with
        ``global_std`` the correction waits until every group is scored."""
        g = self.config.group_size
        batch = latents0.shape[0]
        trajectories, log_probs = [], []
        for start in range(0, batch, g):
            rows = torch.arange(start, start + g)
            traj, lp = runner.rollout(latents=latents0[rows], noise=noise[:, rows],
                                      conditions=[c[rows] for c in cond_list],
                                      selected=mask[rows], rows=rows)
            trajectories.append(traj)
            log_probs.append(lp)
            group_cond = {k: v[rows] for k, v in cond.items()}
            rewards[rows] = check_rewards(self.reward_fn(traj[:, -1], group_cond), g)
            if not adv_config.global_std:
                group_adv = group_advantages(rewards[rows], group_ids[rows] * 0, adv_config)
                full = torch.zeros(batch)
                full[rows] = group_adv
                runner.scale_buffers(full, samples=rows.tolist())
        return torch.cat(trajectories), torch.cat(log_probs)

    # -- training step -----------------------------------------------------------------------
    def step(self, conditions: Mapping[str, torch.Tensor], generator=None) -> dict:
        """One GRPO step: rollout, gradients, ``updates_per_rollout`` optimizer steps.
        Returns metrics (reward mean/std, kl, grad norm, seconds, retained bytes, schedule)."""
        if self.optimizer is None:
            raise ValueError("step() needs an optimizer; use compute_gradients() without one")
        chunks = self.config.updates_per_rollout
        pending = self.rollout(conditions, generator, chunks=chunks)
        metrics = {"reward_mean": pending.rollout.rewards.mean().item(),
                   "reward_std": pending.rollout.rewards.std().item(),
                   "rollout_s": pending.rollout_seconds}
        schedules, norms, update_s, kls = [], [], 0.0, []
        for chunk in range(chunks):
            result = pending.update(chunk=chunk)
            norms.append(self._apply(result.grads))
            schedules.append(result.schedule)
            update_s += result.update_seconds
            kls.append(result.kl)
            if chunk == 0:
                metrics["retained_bytes"] = result.retained_bytes
                metrics["buffer_bytes"] = result.buffer_bytes
        metrics.update(schedule=schedules[0], schedules=schedules, grad_norm=norms[0],
                       grad_norms=norms, kl=sum(kls) / len(kls), update_s=update_s)
        return metrics

    def _apply(self, grads: dict[str, torch.Tensor]) -> float:
        params = dict(self.policy.named_parameters())
        for name, g in grads.items():
            params[name].grad = g.clone()
        trainable = [params[n] for n in grads]
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(trainable, self.config.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in trainable]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


@dataclass(kw_only=True)
class _Setup:
    """What is drawn and captured before a rollout, and the chosen plan."""

    keys: list
    num_prompts: int
    batch: int
    cond: dict
    cond_list: list
    selected: torch.Tensor
    latents0: torch.Tensor
    noise: torch.Tensor
    chunk_steps: list
    mask: torch.Tensor
    sample_module: PolicyStep
    score_module: PolicyStep
    schedule: str
    allow_random: bool
    reason: str
    plans: dict
    partitioner_budget: float | None
    budget_bytes: int


class PendingUpdate:
    """A scored rollout waiting for its update; see ``GRPOTrainer.rollout``."""

    def __init__(self, *, trainer, runner, runner_for, schedule, reason, plans, rollout,
                 chunk_steps, versions, cond_list, rollout_seconds):
        self.trainer = trainer
        self.runner = runner
        self.runner_for = runner_for
        self.schedule = schedule
        self.reason = reason
        self.plans = plans
        self.rollout = rollout
        self.chunk_steps = chunk_steps
        self.versions = versions
        self.cond_list = cond_list
        self.rollout_seconds = rollout_seconds
        self._done: set[int] = set()

    def update(self, chunk: int = 0) -> GradResult:
        """Gradients of chunk ``chunk`` of the selected steps (0: the schedule's; later
        chunks and any update after a parameter change: recomputed)."""
        if chunk in self._done:
            raise ValueError(f"chunk {chunk} of this rollout was already updated")
        if not 0 <= chunk < len(self.chunk_steps):
            raise ValueError(f"chunk={chunk}; this rollout has {len(self.chunk_steps)} chunks")
        self._done.add(chunk)
        trainer, record = self.trainer, self.rollout
        batch = record.latents.shape[0]
        steps = self.chunk_steps[chunk]
        norm = batch * steps.shape[1]
        start = time.perf_counter()
        runner, used = self.runner, self.schedule
        stale = trainer._versions() != self.versions
        if chunk > 0 or (stale and used != "recompute"):
            if chunk == 0:
                warnings.warn(
                    "the policy's parameters changed between rollout and update (an optimizer "
                    "step or an in-place change): the kept activations / gradient buffers are "
                    "stale, so this update is recomputed", OffPolicyWarning, stacklevel=2)
            runner, used = self.runner_for("recompute", norm), "recompute"
            self.runner.retained.clear()
            self.runner.buffers.clear()
        rows = torch.arange(batch)
        if used == "recompute":
            runner.recompute(trajectory=record.latents, old_log_probs=record.log_probs,
                             selected_steps=steps, conditions=self.cond_list,
                             advantages=record.advantages, rows=rows)
        elif used == "retain":
            runner.backward_retained(record.advantages)
        else:
            runner.scale_buffers(record.advantages)
            runner.finish_kl()
        runner.sync()
        update_seconds = time.perf_counter() - start
        grads = {}
        params = dict(trainer.policy.named_parameters())
        for name, g in zip(trainer.trainable, runner.grads):
            p = params[name]
            grads[name] = torch.zeros_like(p) if g is None else g.to(p.dtype)
        kl_values = runner.kl_values
        kl = torch.cat(kl_values).mean().item() if kl_values else 0.0
        return GradResult(grads=grads, rollout=record, schedule=used, reason=self.reason,
                          plans=self.plans, retained_bytes=self.runner.peak_retained_bytes,
                          buffer_bytes=self.runner.peak_buffer_bytes, kl=kl,
                          rollout_seconds=self.rollout_seconds, update_seconds=update_seconds)
