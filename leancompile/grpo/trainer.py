"""GRPO on a diffusion policy with compiler-produced schedules (LeanGRPO).

``GRPOTrainer(policy, reward_fn, optimizer, config)``: ``compute_gradients(conditions)`` runs
one rollout and its update under the schedule ``config.schedule`` (``auto`` picks one) and
returns the gradients without touching the optimizer; ``step(conditions)`` also applies them.

The trainer is a user of ``leancompile.lean_compile(schedule=...)`` like any other loop: its
policy step (``PolicyStep``: velocity + SDE transition + log-prob [+ KL]) is a ``LeanStep``;
the rollout calls it under ``rollout()`` (trained rows chosen by the timestep selection, rows
named by their sample), the update calls it again under ``update()`` with the same inputs and
backpropagates the PPO loss through what it returns. What runs where (the kept activations,
the per-sample gradient buffers, or a recomputed forward) is the ``LeanStep``'s business. The
trainer composes the rest: timestep selection, the plans and ``auto``'s choice
(``leancompile.passes.lean_grpo``) from the graphs the step compiles to, rewards, group
advantages.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn
from torch.profiler import record_function

from ..lean import LeanStep, free_memory_bytes
from ..passes.gather_at_use import peak_gathered_bytes
from ..passes.lean_grpo import ScheduleReport
from .config import GRAD_SYNCS, GRPOConfig
from .fsdp import ParameterSharding, shard_trainable, sharding_of
from .parallel import AllRanks, DataParallel
from .parts import TrainerParts
from .planning import compile_policy_step, regathers, step_graph
from .policy_step import call_args
from .reference import make_reference
from .results import GradResult, OffPolicyWarning, Rollout
from .rollout import run_rollout
from .rollout_setup import RolloutSetup, prepare_rollout
from .sequence import check_mesh, score_rows, sequence_parallel_of
from .sync import sync_plan
from .update import PendingUpdate

__all__ = ["GRPOConfig", "GRPOTrainer", "GradResult", "Rollout", "PendingUpdate",
           "OffPolicyWarning", "GRAD_SYNCS"]


class GRPOTrainer:
    """See the module docstring. ``optimizer`` may be None for gradient-only use.

    The trainer coordinates; the jobs live beside it in ``leancompile/grpo/``: the set-up of a
    rollout (``rollout_setup.py``) with the plans and ``auto`` (``planning.py``), the rollout
    loop (``rollout.py``), the update (``update.py``: ``PendingUpdate``), the gradient
    reductions (``sync.py``), the KL's reference (``reference.py``), sharding and the padded
    calls under ``parallel="fsdp"`` (``fsdp.py``, ``fsdp_padding.py``), a sequence-parallel
    policy (``sequence.py``) and checkpoints (``checkpoint.py``)."""

    def __init__(self, policy: nn.Module, reward_fn: Callable, optimizer, config: GRPOConfig,
                 *, parallel: str | None = None, process_group=None,
                 timeout_s: float | None = 600.0):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        self.policy = policy
        self.reward_fn = reward_fn
        self.optimizer = optimizer
        self.config = config
        self.trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the policy has no parameter with requires_grad=True")
        self.parallel = DataParallel(parallel, process_group, group_size=config.group_size,
                                     timeout_s=timeout_s)
        self.sequence_parallel = sequence_parallel_of(policy)
        """The ``SequenceParallel`` of a transformer in ``policy`` made sequence parallel with
        ``leancompile.integrations.diffusers.parallelize_ulysses`` (None if not): every rank of
        its group runs the same rows on its part of the tokens, and the update sums the
        parameter gradients over the group."""
        self.sequence_sync = None
        """``DataParallel`` over the sequence-parallel group: the update's gradient sum (its
        all-reduce, counts and peer-failure errors are data parallelism's)."""
        if self.sequence_parallel is not None:
            self.sequence_sync = DataParallel("ddp", self.sequence_parallel.group,
                                              timeout_s=timeout_s,
                                              label="sequence-parallel group")
        self.ranks = AllRanks(self.parallel, self.sequence_sync)
        """Every rank of the trainer (data parallel x sequence parallel): what they must agree
        on (config, conditions, schedule, memory budget) is checked and agreed over all."""
        if self.sequence_parallel is not None:
            check_mesh(self.ranks, self.parallel, self.sequence_sync, parallel)
        self.step_count = 0
        """Optimizer steps taken by ``step`` (saved and restored by checkpoints)."""
        if self.ranks.distributed:
            shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in policy.named_parameters()
                      if p.requires_grad]
            self.ranks.check_same("the GRPOConfig and trainable parameters",
                                  f"{config!r} {shapes}")
            if sharding_of(policy) is None:
                self.ranks.broadcast_module(policy)
            elif self.parallel.parallel != "fsdp":
                raise ValueError(f"the policy's parameters were sharded by a "
                                 f"parallel='fsdp' trainer; parallel={parallel!r} needs whole "
                                 "parameters: build it on an unsharded policy")
        fsdp = self.parallel.parallel == "fsdp" and self.parallel.distributed
        # Before sharding: the KL's reference keeps full-size weights on every rank.
        self.reference = make_reference(policy, mode=config.reference, trainable=self.trainable,
                                        fsdp=fsdp) if config.beta > 0 else None
        """The KL's reference policy (``GRPOConfig.beta > 0``; ``leancompile.grpo.reference``)."""
        self.sharding: ParameterSharding | None = None
        """``parallel="fsdp"``: the trainable parameters' shards (``leancompile.grpo.fsdp``)."""
        if fsdp:
            self.sharding = shard_trainable(policy, optimizer, self.parallel)
        self.parts = TrainerParts(policy=policy, trainable=tuple(self.trainable),
                                  parallel=self.parallel, ranks=self.ranks,
                                  sharding=self.sharding, sequence_sync=self.sequence_sync,
                                  reference=self.reference)
        """What the rollout and ``PendingUpdate`` are handed of the trainer."""
        self._steps: dict = {}
        self._cost_cache: dict = {}
        self.last_rollout: Rollout | None = None

    # -- set-up -------------------------------------------------------------------------------
    def _score(self, latents: torch.Tensor, cond: dict) -> torch.Tensor:
        """``reward_fn`` on these rows' final latents (``sequence.score_rows``)."""
        return score_rows(self.reward_fn, latents, cond, sequence=self.sequence_sync,
                          split=self.config.split_rewards)

    def _regathers(self, schedule: str) -> bool:
        """Whether ``schedule``'s step graphs gather the parameters again in the backward
        (``planning.regathers``)."""
        return regathers(self.config, self.sharding, schedule)

    def lean_step(self, keys, partitioner_budget: float | None = None,
                  regather: bool = False) -> LeanStep:
        """The policy step compiled with LeanGRPO schedules (one per condition keys,
        partitioner budget and ``regather``: the parameters gathered again in the backward,
        ``_regathers``; ``planning.compile_policy_step``)."""
        key = (tuple(keys), partitioner_budget, regather)
        if key not in self._steps:
            self._steps[key] = compile_policy_step(
                self.policy, self.config, keys, sharding=self.sharding,
                partitioner_budget=partitioner_budget, regather=regather)
        return self._steps[key]

    def _budget_bytes(self, device) -> int:
        cfg = self.config
        if cfg.memory_budget_bytes is not None:
            return cfg.memory_budget_bytes
        return int(free_memory_bytes(device) * cfg.memory_fraction)

    def _setup(self, conditions, generator, *, schedule, chunks) -> RolloutSetup:
        """Everything drawn before the rollout, the plans and the chosen schedule
        (``rollout_setup.prepare_rollout``)."""
        return prepare_rollout(self.parts, self.config, conditions, generator,
                               schedule=schedule, chunks=chunks, lean_step=self.lean_step,
                               budget_bytes=self._budget_bytes, cost_cache=self._cost_cache)

    def explain_schedules(self, conditions, generator=None, *, schedule=None) -> ScheduleReport:
        """What ``leancompile.explain(trainer, conditions)`` returns: ``explain``."""
        return self.explain(conditions, generator, schedule=schedule)

    def explain(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                schedule: str | None = None) -> ScheduleReport:
        """Compile the step graphs and build the plans for this batch without running the
        rollout: the three schedules with memory and time estimates, the choice, and what the
        pipeline's LeanGRPO stage found in the step's forward graph."""
        st = self._setup(conditions, generator, schedule=schedule, chunks=1)
        graph = step_graph(st.lean, (call_args(st.latents0, 0, st.cond_list,
                                               torch.arange(st.batch),
                                               with_kl=self.config.beta > 0),
                                     {"noise": st.noise[0]}))
        nodes = {name: len(gm.graph.nodes) for name, gm in (
            ("forward", graph.forward), ("backward", graph.backward),
            ("inference", graph.inference))}
        sync, sync_note = sync_plan(self.parts, self.config, st, graph)
        return ScheduleReport(
            plans=st.plans, chosen=st.schedule, reason=st.reason, batch=st.batch,
            num_steps=st.noise.shape[0], selected_per_sample=st.chunk_steps[0].shape[1],
            saved_bytes_per_call=graph.kept_bytes(st.batch),
            memory_budget_bytes=st.budget_bytes, graph_nodes=nodes, pipeline=graph.report,
            gradient_sync=sync, gradient_sync_note=sync_note,
            gathered_peak={} if self.sharding is None else {
                name: peak_gathered_bytes(gm) for name, gm in (
                    ("forward", graph.forward), ("inference", graph.inference),
                    ("backward", graph.backward)) if gm is not None},
            regather="" if graph.regather is None else
            f"{st.schedule}: {graph.regather.summary()} (GRPOConfig(reshard_after_forward="
            "False) keeps them)")

    # -- the main entry ----------------------------------------------------------------------
    def compute_gradients(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                          schedule: str | None = None) -> GradResult:
        """Rollout + gradients (no optimizer step). ``conditions``: one row per prompt; each
        row is repeated ``group_size`` times (rows are prompt-major). ``schedule`` overrides
        ``config.schedule`` for this call (the compiled graphs are shared)."""
        return self.rollout(conditions, generator, schedule=schedule).update()

    def rollout(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                chunks: int = 1, schedule: str | None = None) -> PendingUpdate:
        """Run the rollout (with the schedule's forward/backward work) and score it; the
        returned ``PendingUpdate.update()`` computes the gradients. Changing the parameters in
        between (an optimizer step) is detected and that update is recomputed.
        ``chunks > 1`` splits each sample's selected steps into that many chunks; only the first
        goes through the schedule (``pending.update(chunk=c)`` recomputes chunk ``c``)."""
        with self.parallel.graph_collectives():
            start = time.perf_counter()  # planning counts: a user's step pays for it
            st = self._setup(conditions, generator, schedule=schedule, chunks=chunks)
            pending = run_rollout(self.parts, self.config, st, score=self._score, start=start)
        self.last_rollout = pending.rollout
        return pending

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
            if chunk == 0:
                metrics["ratio_error"] = result.ratio_error
            norms.append(self._apply(result.grads))
            schedules.append(result.schedule)
            update_s += result.update_seconds
            kls.append(result.kl)
            if chunk == 0:
                metrics["retained_bytes"] = result.retained_bytes
                metrics["buffer_bytes"] = result.buffer_bytes
            metrics["sync_collectives"] = metrics.get("sync_collectives", 0) + \
                result.sync_collectives
            metrics["sync_bytes"] = metrics.get("sync_bytes", 0) + result.sync_bytes
        metrics.update(schedule=schedules[0], schedules=schedules, grad_norm=norms[0],
                       grad_norms=norms, kl=sum(kls) / len(kls), update_s=update_s)
        self.step_count += 1
        metrics["step"] = self.step_count
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, run_dir) -> Path:
        """Save parameters (trainable ones; peft adapters also in peft's format), optimizer
        state, random states, step count and config as ``run_dir/step_K``, atomically, and point
        ``run_dir/latest`` at it (``leancompile.grpo.checkpoint``). Collective when data
        parallel: under ``ddp`` rank 0 writes; under ``fsdp`` every rank writes its parameter
        parts and optimizer state into one folder all ranks must see, and rank 0 the rest."""
        from .checkpoint import save

        return save(self, run_dir)

    @classmethod
    def load(cls, path, policy: nn.Module, reward_fn: Callable, optimizer,
             config: GRPOConfig | None = None, **kwargs) -> "GRPOTrainer":
        """A trainer resumed from ``path`` (a run directory: its latest checkpoint; or one
        checkpoint folder). ``policy`` and ``optimizer`` are built as for the original run
        (same model, LoRA config, optimizer class and parameter groups); their state is loaded.
        ``config``: None takes the saved one. ``kwargs``: ``parallel``, ``process_group``,
        ``timeout_s``."""
        import json

        from .checkpoint import latest_checkpoint, load_into

        if config is None:
            saved = json.loads((latest_checkpoint(path) / "trainer.json").read_text())["config"]
            fields = {f.name for f in dataclasses.fields(GRPOConfig)}
            config = GRPOConfig(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in saved.items() if k in fields})
        trainer = cls(policy, reward_fn, optimizer, config, **kwargs)
        load_into(trainer, path)
        return trainer

    def _apply(self, grads: dict[str, torch.Tensor]) -> float:
        with record_function("leancompile.optimizer"):
            return self._apply_grads(grads)

    def _apply_grads(self, grads: dict[str, torch.Tensor]) -> float:
        params = dict(self.policy.named_parameters())
        for name, g in grads.items():
            params[name].grad = g.clone()
        trainable = [params[n] for n in grads]
        if self.sharding is not None:
            # Sharded gradients: the norm is over every rank's parts (padding rows are 0).
            local = sum(float(p.grad.double().square().sum()) for p in trainable)
            norm = torch.tensor(self.parallel.all_sum([local])[0]).sqrt()
            if self.config.max_grad_norm is not None:
                scale = self.config.max_grad_norm / (float(norm) + 1e-6)
                if scale < 1:
                    for p in trainable:
                        p.grad.mul_(scale)
        elif self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(trainable, self.config.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in trainable]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

