"""The rollout loop: each prompt group's rows denoised through every step (``PendingUpdate.
sample``), scored, their advantages computed within the group; Reweight with per-group
statistics trains a group (``PendingUpdate.train``) as soon as it is scored, freeing its
gradient buffers, and with ``grad_sync="group"`` reduces after every round of prompt groups.
Everything else scores the whole batch first. Under ``parallel="fsdp"`` a rank makes the calls
of prompt groups it does not have (``fsdp_padding.py``); every rank's record ends up holding
every row's reward, advantage and log-probs."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.profiler import record_function

from ..lean import synchronize
from .advantages import AdvantageConfig, group_advantages, group_ids_for
from .layout import Unit
from .parts import TrainerParts
from .results import Rollout
from .rollout_setup import RolloutSetup
from .sync import per_group as trains_per_group
from .update import PendingUpdate, parameter_versions

__all__ = ["run_rollout"]


def run_rollout(parts: TrainerParts, config, st: RolloutSetup, *, score: Callable,
                start: float) -> PendingUpdate:
    """Run the rollout ``st`` set up and score it (``score(latents, conditions)``: the rows'
    rewards on the host); ``start``: when the step began (``time.perf_counter``; the
    rollout's seconds count the planning). Returns the update waiting for it."""
    cfg = config
    st.lean.reset_stats()
    st.lean.take_deferred_grads()  # nothing an earlier, abandoned rollout held back
    pending = PendingUpdate(parts=parts, config=config, setup=st,
                            versions=parameter_versions(parts.policy))
    adv_config = AdvantageConfig(global_std=cfg.global_std, adv_clip_max=cfg.adv_clip_max)
    group_ids = group_ids_for(st.num_prompts, cfg.group_size)
    par = parts.parallel
    # Rewards and advantages on the host (the reward function's scores come back there);
    # the trajectory and its log-probs where the policy runs.
    rewards = torch.zeros(st.batch)
    advantages = torch.zeros(st.batch)
    device = st.latents0.device
    trajectory = torch.zeros((st.batch, st.noise.shape[0] + 1) + tuple(st.latents0.shape[1:]),
                             device=device)
    log_probs = torch.zeros(st.batch, st.noise.shape[0], device=device)
    # Reweight with per-group statistics updates a group as soon as it is scored, freeing
    # its gradient buffers; everything else scores the whole batch first (so do groups
    # scattered over the ranks: their rewards are gathered from everyone at once).
    per_group = trains_per_group(cfg, st.schedule, st.layout)
    units = st.units if per_group else [
        Unit(prompts=tuple(range(st.num_prompts)), rows=tuple(st.local.tolist()),
             ranks=tuple(range(par.world_size)))]
    pending.stash_grads()
    for u, unit in enumerate(units):
        rows = torch.tensor(unit.rows, dtype=torch.long)
        padding = None if st.padding is None else st.padding[u]
        if rows.numel() or padding is not None:
            traj, lps = pending.sample(rows, padding)
            trajectory[rows], log_probs[rows] = traj, lps
        if rows.numel():
            group_cond = {k: v[rows] for k, v in st.cond.items()}
            with record_function("leancompile.reward"):
                rewards[rows] = score(traj[:, -1], group_cond)
        if per_group:
            group = torch.cat([torch.arange(p * cfg.group_size, (p + 1) * cfg.group_size)
                               for p in unit.prompts])
            rewards[group] = par.gather_rows(rewards[group], st.owned[group], unit.ranks)
            advantages[group] = group_advantages(rewards[group], group_ids[group],
                                                 adv_config)
            if rows.numel():
                pending.train(rows, advantages, trajectory, log_probs, chunk=0)
            if st.sync_rounds:
                pending.reduce_round()
    for padding in ([] if st.padding is None else st.padding[len(units):]):
        # fsdp: another rank has more prompt groups; this one makes their calls too.
        pending.sample(torch.zeros(0, dtype=torch.long), padding)
        if st.sync_rounds:
            pending.reduce_round()
    for _ in range(st.sync_rounds - max(len(units), len(st.padding or ()))):
        pending.reduce_round()  # ddp: another rank has more prompt groups
    if not per_group:
        rewards = par.gather_rows(rewards, st.owned)
        advantages = group_advantages(rewards, group_ids, adv_config)
    else:
        pending.keep_rollout_grads()
        # Every rank's record holds every row's reward and advantage.
        rewards = par.gather_rows(rewards, st.owned)
        advantages = par.gather_rows(advantages, st.owned)
    log_probs = par.gather_rows(log_probs, st.owned)
    pending.restore_grads()
    synchronize(device)  # (the seconds include the device's queued work)
    pending.rollout_seconds = time.perf_counter() - start
    pending.rollout = Rollout(latents=trajectory, selected=st.selected, log_probs=log_probs,
                              rewards=rewards, advantages=advantages, conditions=st.cond,
                              noise=st.noise, rows=st.local if par.distributed else None,
                              seed=st.seed)
    pending.trained_in_rollout = per_group
    return pending
