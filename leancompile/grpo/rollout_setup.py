"""What is drawn and decided before a rollout (``prepare_rollout`` -> ``RolloutSetup``): the
conditions repeated per sample, the step's seed and every sample's draws (trained steps,
initial latents, SDE noise; ``layout.draw_samples``), which rank generates which rows
(``layout``), the compiled step, the plans and the schedule every rank runs, and under
``parallel="fsdp"`` the padded calls every rank makes (``fsdp_padding.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..lean import LeanStep
from ..passes.lean_grpo import SCHEDULES
from .fsdp_padding import check_fsdp_calls, fsdp_padding
from .layout import assign, draw_samples, row_owner, step_seed
from .parts import TrainerParts
from .planning import agree_schedule, plan_schedules, regathers, step_graph
from .policy_step import call_args
from .sync import group_sync, per_group, sync_rounds

__all__ = ["RolloutSetup", "prepare_rollout"]


@dataclass(kw_only=True)
class RolloutSetup:
    """What is drawn and planned before a rollout."""

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
    lean: LeanStep
    schedule: str
    reason: str
    plans: dict
    partitioner_budget: float | None
    budget_bytes: int
    seed: int
    layout: str
    """The layout in effect (``conventional`` in one process)."""
    local: torch.Tensor
    """Rows this rank generates (all rows in one process)."""
    owned: torch.Tensor
    """``[B]`` bool: ``local`` as a mask."""
    units: list
    """``leancompile.grpo.layout.Unit``: this rank's work, in order."""
    padding: list | None = None
    """``parallel="fsdp"``: per unit index (every rank's longest list of units), per
    denoising step, the (untrained, trained) rollout calls every rank makes at that step:
    a rank without rows for one of them calls the step on a stand-in row instead
    (``fsdp_padding.fsdp_padding``)."""
    sync_rounds: int = 0
    """Reweight with ``grad_sync="group"``: the number of rounds of prompt groups every rank
    reduces after (the most units any rank has; 0: one reduction for the whole update)."""



def prepare_rollout(parts: TrainerParts, config, conditions, generator, *, schedule, chunks,
                    lean_step: Callable[..., LeanStep], budget_bytes: Callable[..., int],
                    cost_cache: dict) -> RolloutSetup:
    """Everything drawn before the rollout, the plans and the chosen schedule. ``config``:
    the trainer's ``GRPOConfig`` now; ``lean_step(keys, partitioner_budget, regather)``: its
    compiled steps; ``budget_bytes(device)``: this rank's memory budget; ``cost_cache``: the
    graphs' costs already counted (``planning.step_costs``)."""
    cfg, par, ranks = config, parts.parallel, parts.ranks
    sharding = parts.sharding
    keys = list(conditions)
    num_prompts = next(iter(conditions.values())).shape[0]
    batch = num_prompts * cfg.group_size
    cond = {k: v.repeat_interleave(cfg.group_size, dim=0) for k, v in conditions.items()}
    cond_list = [cond[k] for k in keys]
    num_steps = len(parts.policy.sigmas) - 1
    schedule = cfg.schedule if schedule is None else schedule
    if schedule not in SCHEDULES + ("auto",):
        raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULES + ('auto',)}")

    # One base seed per step; every sample draws from its own generator seeded by
    # (seed, prompt, generation), so where a sample runs does not change what it draws.
    seed = step_seed(generator)
    if ranks.distributed:
        fingerprint = [(k, tuple(v.shape), str(v.dtype),
                        float(v.detach().double().sum()),
                        float((v.detach().double().flatten() ** 2).sum()))
                       for k, v in conditions.items()]
        ranks.check_same("the step's conditions and generator seed",
                         f"seed {seed} schedule {schedule} chunks {chunks} {fingerprint}")
    # One process: every layout is "all rows here, one prompt group after another".
    layout = cfg.layout if par.distributed else "conventional"
    owner = row_owner(layout, num_prompts=num_prompts, group_size=cfg.group_size,
                      world_size=par.world_size, seed=seed)
    owned = owner == par.rank
    local = owned.nonzero().flatten()
    draws = draw_samples(parts.policy, selection=cfg.selection, num_prompts=num_prompts,
                         group_size=cfg.group_size, num_steps=num_steps, seed=seed,
                         init_same_noise=cfg.init_same_noise, rows=local.tolist())
    selected, latents0, noise = draws.selected, draws.latents0, draws.noise
    if not 1 <= chunks <= selected.shape[1]:
        raise ValueError(f"chunks={chunks} must be between 1 and the {selected.shape[1]} "
                         "selected steps per sample")
    chunk_steps = list(torch.tensor_split(selected, chunks, dim=1))
    mask = torch.zeros(batch, num_steps, dtype=torch.bool)
    mask.scatter_(1, chunk_steps[0], True)
    example = (call_args(latents0, 0, cond_list, torch.arange(batch), with_kl=cfg.beta > 0),
               {"noise": noise[0]})
    units = assign(layout, num_prompts=num_prompts, group_size=cfg.group_size,
                   world_size=par.world_size, rank=par.rank, seed=seed)
    plan_mask = mask[local] if local.numel() else mask
    if sharding is not None and local.numel():
        # fsdp: Retain also keeps a stand-in row at every step another rank trains and
        # this one does not (fsdp_padding.py)
        extra = mask.any(0) & ~plan_mask.any(0)
        if bool(extra.any()):
            plan_mask = torch.cat([plan_mask, extra[None]])
    # Reweight's gradient buffers in flight: a group's rows on this rank (the whole local
    # batch when advantages wait for everyone: global_std, or groups scattered over ranks).
    in_flight = (plan_mask.shape[0] if layout == "scattered"
                 else max([len(u.rows) for u in units] + [1]))
    # fsdp Reweight reducing once per update holds a group's corrected full-size gradient
    # beside the next group's buffers (grad_sync)
    held = int(sharding is not None and per_group(cfg, "reweight", layout)
               and not group_sync(cfg, sharding is not None) and len(units) > 1)
    # Data (and sequence) parallel: every rank plans with the smallest budget of them all.
    budget = int(ranks.all_min(budget_bytes(example[0][0].device)))
    choice = plan_schedules(
        keys, example, plan_mask, schedule, config=cfg, policy=parts.policy,
        lean_step=lean_step, cost_cache=cost_cache, budget_bytes=budget,
        regather=regathers(cfg, sharding, "retain"), in_flight=in_flight, held_grads=held)
    if ranks.distributed:
        choice = agree_schedule(ranks, choice)
    schedule, budget_at = choice.schedule, choice.partitioner_budget
    lean = lean_step(keys, budget_at, regathers(cfg, sharding, schedule))
    padding = None
    if sharding is not None:
        padding = fsdp_padding(layout, group_size=cfg.group_size, world_size=par.world_size,
                               num_prompts=num_prompts, seed=seed, mask=mask,
                               schedule=schedule,
                               per_group=per_group(cfg, schedule, layout))
        check_fsdp_calls(step_graph(lean, example), padding, chunk_steps, schedule, par)
    rounds = sync_rounds(cfg, par, schedule, layout, sharded=sharding is not None,
                         num_prompts=num_prompts, seed=seed)
    return RolloutSetup(keys=keys, num_prompts=num_prompts, batch=batch, cond=cond,
                        cond_list=cond_list, selected=selected, latents0=latents0,
                        noise=noise, chunk_steps=chunk_steps, mask=mask, lean=lean,
                        schedule=schedule, reason=choice.reason, plans=choice.plans,
                        partitioner_budget=budget_at, budget_bytes=budget, seed=seed,
                        layout=layout, local=local, owned=owned, units=units,
                        padding=padding, sync_rounds=rounds)
