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
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn
from torch.profiler import record_function

from ..capture import RandomOpInGraphError
from ..options import CompileOptions, check_bucket_cap_mb
from ..passes.bucket_collectives import NAME as BUCKETS, merged_counts
from ..passes.gather_at_use import peak_gathered_bytes
from ..passes.result import COMMUNICATION_NAMESPACES
from ..passes.lean_grpo import (SCHEDULES, SchedulePlan, ScheduleReport, StepCosts,
                                build_schedule_plans, choose_schedule, graph_flops,
                                reweight_rows_per_backward)
from ..passes.result import format_bytes
from ..lean import LeanStep, StepConfig, free_memory_bytes, synchronize
from .advantages import AdvantageConfig, group_advantages, group_ids_for
from .rewards import check_rewards
from .sde import SDE_KINDS, sde_step
from .step import PolicyStep
from .layout import LAYOUTS, Unit, assign, draw_samples, row_owner, step_seed
from .fsdp import GatheredPolicy, ParameterSharding
from .parallel import AllRanks, DataParallel
from .timesteps import TimestepSelection

__all__ = ["GRPOConfig", "GRPOTrainer", "GradResult", "Rollout", "PendingUpdate",
           "OffPolicyWarning", "GRAD_SYNCS"]

GRAD_SYNCS = ("auto", "group", "update")

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
    device: str | None = None
    """``schedule="auto"`` on a device model (``leancompile/sim``: a built-in profile name or
    a JSON file): the plans carry each schedule's predicted seconds, simulated from the step's
    own graphs, and auto takes the fastest that fits (None: Retain whenever it fits)."""
    overlap: str | None = None
    """The step's communication/compute overlap (``CompileOptions.overlap``): with
    ``parallel="fsdp"``, ``"flash"`` rewrites the parameter gathers feeding matmuls and the
    weight-gradient matmuls feeding reduce-scatters into decomposed P2P schedules."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping in ``step`` (None: no clipping)."""
    updates_per_rollout: int = 1
    """Optimizer steps per rollout in ``step``; the selected steps are split in this many
    chunks. Only the first is on-policy; the rest are recomputed."""
    layout: str = "shared"
    """Which rank generates which sample under ``parallel="ddp"`` (``leancompile.grpo.layout``):
    ``shared`` (LeanGRPO: all ranks on one prompt; ``M < R`` makes ``R // M`` worker groups),
    ``conventional`` (whole prompt groups per rank, as DanceGRPO) or ``scattered`` (group
    members spread over the ranks, as FlowGRPO). No effect in one process; the gradients do
    not depend on it."""
    bucket_cap_mb: float | None = 25.0
    """``parallel="fsdp"``: the step graphs' per-parameter all-gathers and gradient
    reduce-scatters are merged into buckets of at most this many MiB
    (``CompileOptions.bucket_cap_mb``, ``passes/bucket_collectives.py``), as
    ``DistributedDataParallel`` buckets its all-reduces (same default); None: one collective per
    parameter. No effect otherwise."""
    reshard_after_forward: bool = True
    """``parallel="fsdp"``, Retain: the kept calls hold this rank's parameter parts, not the
    gathered weights; the update's backward gathers them again (``StepConfig.
    reshard_after_forward``, ``passes/regather_params.py``), as ``fully_shard``'s default.
    False: every kept call holds a full copy of the weights (no gather in the backward).
    Recompute and Reweight run their backward right after the forward and keep the gathered
    weights for it either way. No effect otherwise."""
    grad_sync: str = "auto"
    """When data-parallel Reweight reduces its corrected gradients over the ranks (once a
    group's advantages are in them; the gradients are the same either way): ``group`` (one
    reduction per round of prompt groups, as each is scored: under ``parallel="fsdp"`` the
    rank's full-size gradient is reduce-scattered to its part and freed before the next group's
    buffers fill), ``update`` (one reduction for the whole update: the least traffic, the
    full-size gradient held until the end) or ``auto`` (``group`` under fsdp, ``update``
    otherwise: with replicated gradients a reduction per group only adds traffic). Layouts whose
    advantages wait for the whole batch (``scattered``, ``global_std``) reduce once per update
    whatever this says."""
    split_rewards: bool = True
    """With a sequence-parallel policy (every rank of the group holds the same samples): each
    rank of the group calls ``reward_fn`` on its share of the rows (rows ``i`` with
    ``i % N == rank``; no call when it has none), and the scores are gathered over the group,
    so decoding and the reward model run once per sample instead of once per rank. False:
    every rank scores every row (a ``reward_fn`` that needs all the rows of a call at once, or
    runs collectives of its own). No effect otherwise."""

    def __post_init__(self):
        if self.device is not None:
            from ..sim import device_profile

            device_profile(self.device)  # a name or file it can read, or the error says so
        if self.schedule not in SCHEDULES + ("auto",):
            raise ValueError(f"schedule={self.schedule!r}; use one of {SCHEDULES + ('auto',)}")
        if self.sde not in SDE_KINDS:
            raise ValueError(f"sde={self.sde!r}; use one of {SDE_KINDS}")
        if self.eta <= 0:
            raise ValueError(
                f"eta={self.eta}: GRPO trains the log-prob of a stochastic transition, and with "
                "eta == 0 the SDE is the deterministic Euler step (a point mass, log-prob 0, no "
                "policy gradient). Use eta > 0 (FlowGRPO 0.7, 0.9 for FLUX; DanceGRPO 0.3); "
                "sample deterministically outside the trainer with leancompile.grpo.sde_step")
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
        if self.overlap not in (None, "flash", "slice"):
            raise ValueError(f"overlap={self.overlap!r}; use None, 'flash' or 'slice' "
                             "(CompileOptions.overlap)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; use one of {LAYOUTS}")
        check_bucket_cap_mb(self.bucket_cap_mb)
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r} must be "
                             "True or False")
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync={self.grad_sync!r}; use one of {GRAD_SYNCS}")

    @property
    def selection(self) -> TimestepSelection:
        """The trained-step selection this config describes."""
        return TimestepSelection(strategy=self.strategy, fraction=None
                                 if self.strategy == "window" else self.timestep_fraction)

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


class _Velocity(nn.Module):
    """``policy.velocity`` as a module's forward, for ``torch.func.functional_call`` with the
    reference weights (the KL term)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, latents, step_index, conditions):
        return self.policy.velocity(latents, step_index, conditions)


@dataclass(kw_only=True)
class _Setup:
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
    (``_fsdp_padding``)."""
    sync_rounds: int = 0
    """Reweight with ``grad_sync="group"``: the number of rounds of prompt groups every rank
    reduces after (the most units any rank has; 0: one reduction for the whole update)."""


class GRPOTrainer:
    """See the module docstring. ``optimizer`` may be None for gradient-only use."""

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
        self.sequence_parallel = _sequence_parallel_of(policy)
        """The ``SequenceParallel`` of a transformer in ``policy`` made sequence parallel with
        ``leancompile.integrations.diffusers.parallelize_ulysses`` (None if not): every rank of
        its group runs the same rows on its part of the tokens, and the update sums the
        parameter gradients over the group."""
        self._sequence_sync = None
        """``DataParallel`` over the sequence-parallel group: the update's gradient sum (its
        all-reduce, counts and peer-failure errors are data parallelism's)."""
        if self.sequence_parallel is not None:
            self._sequence_sync = DataParallel("ddp", self.sequence_parallel.group,
                                               timeout_s=timeout_s,
                                               label="sequence-parallel group")
        self.ranks = AllRanks(self.parallel, self._sequence_sync)
        """Every rank of the trainer (data parallel x sequence parallel): what they must agree
        on (config, conditions, schedule, memory budget) is checked and agreed over all."""
        if self.sequence_parallel is not None:
            self._check_mesh(parallel)
        self.step_count = 0
        """Optimizer steps taken by ``step`` (saved and restored by checkpoints)."""
        if self.ranks.distributed:
            shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in policy.named_parameters()
                      if p.requires_grad]
            self.ranks.check_same("the GRPOConfig and trainable parameters",
                                  f"{config!r} {shapes}")
            held = getattr(policy, "_leancompile_sharding", None)
            if held is None:
                self.ranks.broadcast_module(policy)
            elif self.parallel.parallel != "fsdp":
                raise ValueError(f"the policy's parameters were sharded by a "
                                 f"parallel='fsdp' trainer; parallel={parallel!r} needs whole "
                                 "parameters: build it on an unsharded policy")
        self._velocity = _Velocity(policy)
        # Before sharding: the KL's reference keeps full-size weights on every rank.
        self._reference = self._make_reference() if config.beta > 0 else None
        self.sharding: ParameterSharding | None = None
        """``parallel="fsdp"``: the trainable parameters' shards (``leancompile.grpo.fsdp``)."""
        if self.parallel.parallel == "fsdp" and self.parallel.distributed:
            self._shard(optimizer)
        self._steps: dict = {}
        self._cost_cache: dict = {}
        self.last_rollout: Rollout | None = None

    # -- set-up -------------------------------------------------------------------------------
    def _score(self, latents: torch.Tensor, cond: dict) -> torch.Tensor:
        """``reward_fn`` on these rows' final latents; with a sequence-parallel policy and
        ``split_rewards``, each rank of the group scores every N-th row and the group sums
        the scores (the others' zeros: exact)."""
        n = latents.shape[0]
        sp = self._sequence_sync
        if sp is None or not sp.distributed or not self.config.split_rewards:
            return check_rewards(self.reward_fn(latents, cond), n).to("cpu")
        mine = torch.arange(sp.rank, n, sp.world_size)
        # One collective: the scores and, last, how many ranks failed (a rank whose share
        # raised must not leave its peers waiting for its scores).
        scores = torch.zeros(n + 1)
        error = None
        if mine.numel():
            try:
                scores[mine] = check_rewards(
                    self.reward_fn(latents[mine], {k: v[mine] for k, v in cond.items()}),
                    mine.numel()).to("cpu")
            except Exception as err:  # raised below, after the peers know
                error = err
                scores[n] = 1
        owned = torch.zeros(n + 1, dtype=torch.bool)
        owned[mine] = owned[n] = True
        gathered = sp.gather_rows(scores, owned)
        if error is not None:
            raise error
        if gathered[n] > 0:
            raise RuntimeError(
                f"{int(gathered[n])} other rank(s) of the sequence-parallel group raised in "
                "reward_fn on their share of the rows (GRPOConfig.split_rewards: each rank "
                "scores every N-th row); their error is raised on those ranks.")
        return gathered[:n]

    def _check_mesh(self, parallel) -> None:
        """A sequence-parallel policy with data parallelism: the ranks of a sequence-parallel
        group run the same rows (and, under fsdp, hold the same parts), so they must share one
        data-parallel rank, and the ranks of ``process_group`` one position in their
        sequence-parallel groups (the two groups are the dimensions of one mesh, ``(dp, sp)``;
        checkpoints under fsdp are written by the data-parallel group at position 0). Raised
        on every rank."""
        if not self.parallel.distributed:
            return
        sp = self._sequence_sync
        mesh_fix = ("Build both groups from one mesh: mesh = init_device_mesh(device, (dp, sp), "
                    "mesh_dim_names=('dp', 'sp')); parallelize_ulysses(transformer, "
                    "mesh.get_group('sp')); GRPOTrainer(..., parallel='ddp' (or 'fsdp'), "
                    "process_group=mesh.get_group('dp')).")
        fix = (f"parallel={parallel!r} with a sequence-parallel policy: the ranks of a "
               "sequence-parallel group run the same rows, so each must hold the same "
               "data-parallel rank, and the ranks of process_group must hold the same "
               "position in their sequence-parallel groups. " + mesh_fix)
        self.ranks.check_each([
            (sp, "the data-parallel rank (in process_group) of the sequence-parallel group's "
             "ranks", f"data-parallel rank {self.parallel.rank} of {self.parallel.world_size}"),
            (self.parallel, "the position in their sequence-parallel groups of "
             "process_group's ranks", f"sequence-parallel rank {sp.rank} of {sp.world_size}")],
            fix=fix)

    def _shard(self, optimizer) -> None:
        """``parallel="fsdp"``: replace the trainable parameters by this rank's shards, and
        point a fresh optimizer at them (it must not have taken a step yet: its state would
        be for the full parameters)."""
        before = dict(self.policy.named_parameters())
        if optimizer is not None and len(optimizer.state):
            raise ValueError(
                "parallel='fsdp' shards the policy's parameters when the trainer is built, but "
                "the optimizer already holds state for the full parameters; build the trainer "
                "with a fresh optimizer (or load a checkpoint after building it)")
        par = self.parallel
        held = getattr(self.policy, "_leancompile_sharding", None)
        if held is not None:  # a second trainer on a policy an earlier one sharded
            if (held.group, held.world_size) != (par.group, par.world_size):
                raise ValueError("the policy is already sharded over another process group; "
                                 "build the trainer with that group (process_group=...)")
            self.sharding = held
            return
        self.sharding = ParameterSharding(self.policy, par.group, rank=par.rank,
                                          world_size=par.world_size)
        self.policy._leancompile_sharding = self.sharding
        after = dict(self.policy.named_parameters())
        swap = {id(before[n]): after[n] for n in self.sharding.shapes}
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [swap.get(id(p), p) for p in group["params"]]

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
            shapes = self._full_shapes()
            if not (self.parallel.parallel == "fsdp" and self.parallel.distributed):
                return {f"policy.{n}": p.new_zeros(shapes[n])
                        for n, p in self.policy.named_parameters() if "lora_B" in n}
            # parallel="fsdp": the policy's trainable parameters are (or are about to be)
            # parts, so the reference names every one of them at full size. Zero lora_B
            # cancels an adapter whatever its lora_A; any other trainable parameter (a
            # weight outside the adapters, DoRA's magnitude vectors) would have to be gathered
            # for every reference call.
            zeroed = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
            other = [n for n in self.trainable if not any(z in n for z in zeroed)]
            if other:
                raise ValueError(
                    f"reference='adapter' with parallel='fsdp': {other[:4]}"
                    f"{' ...' if len(other) > 4 else ''} are trainable parameters that zero "
                    "lora_B does not cancel (weights outside the LoRA adapters, DoRA's "
                    "magnitude vectors); they are sharded and the reference would need them "
                    "gathered on every reference call: use reference='copy' (a full copy on "
                    "every rank) or freeze them")
            params = dict(self.policy.named_parameters())
            return {f"policy.{n}": params[n].new_zeros(shapes[n]) for n in self.trainable}
        held = getattr(self.policy, "_leancompile_sharding", None)
        if held is not None:  # a policy an earlier fsdp trainer sharded: gather it
            return {f"policy.{n}": t for n, t in held.full_parameters(self.policy).items()}
        return {f"policy.{n}": p.detach().clone() for n, p in self.policy.named_parameters()
                if p.requires_grad}

    def _full_shapes(self) -> dict[str, torch.Size]:
        held = getattr(self.policy, "_leancompile_sharding", None)
        return {n: held.shapes[n] if held is not None and n in held.shapes else p.shape
                for n, p in self.policy.named_parameters()}

    def _regathers(self, schedule: str) -> bool:
        """Whether ``schedule``'s step graphs gather the parameters again in the backward
        (``GRPOConfig.reshard_after_forward``: Retain under ``fsdp``)."""
        return self.sharding is not None and self.config.reshard_after_forward and \
            schedule == "retain"

    def lean_step(self, keys, partitioner_budget: float | None = None,
                  regather: bool = False) -> LeanStep:
        """The policy step compiled with LeanGRPO schedules (one per condition keys,
        partitioner budget and ``regather``: the parameters gathered again in the backward,
        ``_regathers``)."""
        cfg = self.config
        key = (tuple(keys), partitioner_budget, regather)
        if key not in self._steps:
            policy = self.policy if self.sharding is None else \
                GatheredPolicy(self.policy, self.sharding)
            module = PolicyStep(policy, sde=cfg.sde, eta=cfg.eta, condition_keys=keys,
                                with_kl=cfg.beta > 0)
            # Reweight's update calls before a sample's last hand autograd no zeros (.grad is
            # read after the last), unless a DistributedDataParallel inside the policy needs a
            # gradient for every parameter in every backward.
            from torch.nn.parallel import DistributedDataParallel

            ddp = isinstance(self.policy, torch.nn.Module) and any(
                isinstance(m, DistributedDataParallel) for m in self.policy.modules())
            self._steps[key] = LeanStep(
                module, options=CompileOptions(
                    compiler=cfg.compiler, schedule="auto", overlap=cfg.overlap,
                    bucket_cap_mb=cfg.bucket_cap_mb if self.sharding is not None else None,
                    gather_at_use=self.sharding is not None),
                config=StepConfig(schedule="retain", partitioner_budget=partitioner_budget,
                                  reshard_after_forward=regather, sample_output=0,
                                  sample_arg="prev_sample",
                                  zero_grads=ddp, defer_reductions=self.sharding is not None,
                                  fallback="recompute" if self.sharding is None else "raise"))
        return self._steps[key]

    def _grad_bytes(self) -> int:
        """Bytes of one full gradient of the trainable parameters (under ``fsdp`` too:
        Reweight's per-sample buffers hold unreduced full-size gradients)."""
        shapes = self._full_shapes()
        return sum(shapes[n].numel() * p.element_size()
                   for n, p in self.policy.named_parameters() if p.requires_grad)

    def _versions(self) -> dict[str, int]:
        return {n: p._version for n, p in self.policy.named_parameters() if p.requires_grad}

    def _budget_bytes(self, device) -> int:
        cfg = self.config
        if cfg.memory_budget_bytes is not None:
            return cfg.memory_budget_bytes
        return int(free_memory_bytes(device) * cfg.memory_fraction)

    def _call_args(self, x, k: int, cond_list, local) -> list:
        """The positional arguments of a step call on the rows ``local`` (with a placeholder
        reference mean for the KL, filled in for trained calls)."""
        step = torch.full((local.numel(),), k, dtype=torch.long, device=x.device)
        args = [x[local], step] + [c[local] for c in cond_list]
        if self.config.beta > 0:
            args.append(torch.zeros_like(args[0]))
        return args

    def _reference_mean(self, args, keys, noise) -> torch.Tensor:
        """The reference policy's transition mean for one call's rows (no grad)."""
        cfg = self.config
        x, step = args[0], args[1]
        cond = dict(zip(keys, args[2:2 + len(keys)]))
        with torch.no_grad():
            v = torch.func.functional_call(self._velocity, self._reference, (x, step, cond),
                                           strict=False)
            sigmas = self.policy.sigmas.to(x.device)
            out = sde_step(cfg.sde, latents=x, velocity=v, sigma=sigmas[step],
                           sigma_next=sigmas[step + 1], eta=cfg.eta, sigma_max=sigmas[1],
                           noise=noise)
        return out.mean

    # -- schedule choice ---------------------------------------------------------------------
    def _graphs(self, lean: LeanStep, example):
        args, kwargs = example
        graphs = lean.plan(*args, **kwargs)
        if len(graphs) != 1:
            raise RuntimeError(f"the policy step compiled to {len(graphs)} graphs (a graph "
                               "break); the trainer plans from one")
        return graphs[0]

    def _costs(self, graph, num_rows: int) -> StepCosts:
        """The graphs' per-call costs for ``num_rows`` rows (FLOPs counted once per graph and
        batch size: counting runs the graphs on fake tensors, which costs more than a small
        model's step)."""
        key = (id(graph), num_rows)
        if key not in self._cost_cache:
            symbol = graph.batch_symbol
            seconds = {}
            if self.config.device is not None:
                from ..sim import simulate

                # (sizes at the traced example's batch: the whole batch, as the FLOPs here)
                seconds = {f"{name}_s": simulate(gm, self.config.device).total_s
                           for name, gm in (("forward", graph.forward),
                                            ("backward", graph.backward),
                                            ("inference", graph.inference))
                           if gm is not None}
            self._cost_cache[key] = (graph, StepCosts(
                saved_bytes=graph.kept_bytes(num_rows),
                forward_flops=graph_flops(graph.forward, symbol, num_rows),
                backward_flops=graph_flops(graph.backward, symbol, num_rows),
                inference_flops=graph_flops(graph.inference, symbol, num_rows), **seconds))
        return self._cost_cache[key][1]

    def _plans(self, keys, example, mask, schedule, in_flight=None, held_grads: int = 0):
        """Plan the three schedules from the step's graphs, pick one (auto, with smaller
        partitioner budgets for retain when it does not fit)."""
        cfg = self.config
        # Data (and sequence) parallel: every rank plans with the smallest budget of them all.
        budget_bytes = int(self.ranks.all_min(self._budget_bytes(example[0][0].device)))
        rows_per_step = [n for n in mask.sum(0).tolist() if n]
        num_rows, num_steps = mask.shape
        samples_in_flight = num_rows if cfg.global_std else (
            cfg.group_size if in_flight is None else in_flight)

        def plans_for(partitioner_budget, regather=False):
            graph = self._graphs(self.lean_step(keys, partitioner_budget, regather), example)
            costs = self._costs(graph, num_rows)
            call_bytes = max(graph.kept_bytes(n) for n in rows_per_step)
            buffers = (samples_in_flight + (cfg.beta > 0) + held_grads) * self._grad_bytes()
            rows = reweight_rows_per_backward(
                rows=max(rows_per_step), grad_bytes=self._grad_bytes(),
                row_saved_bytes=graph.kept_bytes(1),
                room_bytes=budget_bytes - buffers - call_bytes)
            return build_schedule_plans(
                costs=costs, selected_calls=len(rows_per_step), total_calls=num_steps,
                retain_bytes=sum(graph.kept_bytes(n) for n in rows_per_step),
                reweight_call_bytes=call_bytes,
                samples_in_flight=samples_in_flight, grad_bytes=self._grad_bytes(),
                with_kl=cfg.beta > 0, memory_budget_bytes=budget_bytes,
                partitioner_budget=partitioner_budget, reweight_rows=rows,
                held_grads=held_grads), graph

        # Retain's graphs may differ from the others' (the parameters gathered again in the
        # backward): its plan comes from its own, and an explicit retain captures only those.
        regather = self._regathers("retain")
        plans, graph = plans_for(None, regather and schedule == "retain")
        if regather and schedule == "auto":
            plans["retain"] = plans_for(None, True)[0]["retain"]
        if graph.random_ops and schedule != "recompute":
            dropouts = [f"{name} ({type(m).__name__}, p={m.p})"
                        for name, m in self.policy.named_modules()
                        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training
                        and m.p > 0]
            where = f"; dropout in training mode at {', '.join(dropouts)}" if dropouts else ""
            raise RandomOpInGraphError(
                f"schedule={schedule!r}: the captured step draws random numbers "
                f"({', '.join(graph.random_ops)}{where}): running it again would not reproduce "
                "the rollout's forward, so its graph cannot be reused. Call model.eval() "
                "(dropout), or pass the noise in as an argument.")
        if schedule != "auto":
            return schedule, f"schedule={schedule!r} requested", plans, None, budget_bytes
        name, reason = choose_schedule(plans)
        if name == "retain" or plans["retain"].fits:  # (a faster plan chosen on a device)
            return name, reason, plans, None, budget_bytes
        for partitioner_budget in cfg.partitioner_budgets:
            smaller, _ = plans_for(partitioner_budget, regather)
            if smaller["retain"].fits:
                plans["retain"] = smaller["retain"]
                return "retain", (f"retain with the partitioner's activation budget "
                                  f"{partitioner_budget}: keeps "
                                  f"{smaller['retain'].peak_bytes} bytes, within "
                                  f"{budget_bytes}"), plans, partitioner_budget, budget_bytes
        return name, reason + f" (also at partitioner budgets {cfg.partitioner_budgets})", \
            plans, None, budget_bytes

    def _setup(self, conditions, generator, *, schedule, chunks) -> _Setup:
        """Everything drawn before the rollout, the plans and the chosen schedule."""
        cfg, par = self.config, self.parallel
        keys = list(conditions)
        num_prompts = next(iter(conditions.values())).shape[0]
        batch = num_prompts * cfg.group_size
        cond = {k: v.repeat_interleave(cfg.group_size, dim=0) for k, v in conditions.items()}
        cond_list = [cond[k] for k in keys]
        num_steps = len(self.policy.sigmas) - 1
        schedule = cfg.schedule if schedule is None else schedule
        if schedule not in SCHEDULES + ("auto",):
            raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULES + ('auto',)}")

        # One base seed per step; every sample draws from its own generator seeded by
        # (seed, prompt, generation), so where a sample runs does not change what it draws.
        seed = step_seed(generator)
        if self.ranks.distributed:
            fingerprint = [(k, tuple(v.shape), str(v.dtype),
                            float(v.detach().double().sum()),
                            float((v.detach().double().flatten() ** 2).sum()))
                           for k, v in conditions.items()]
            self.ranks.check_same("the step's conditions and generator seed",
                                  f"seed {seed} schedule {schedule} chunks {chunks} {fingerprint}")
        # One process: every layout is "all rows here, one prompt group after another".
        layout = cfg.layout if par.distributed else "conventional"
        owner = row_owner(layout, num_prompts=num_prompts, group_size=cfg.group_size,
                          world_size=par.world_size, seed=seed)
        owned = owner == par.rank
        local = owned.nonzero().flatten()
        draws = draw_samples(self.policy, selection=cfg.selection, num_prompts=num_prompts,
                             group_size=cfg.group_size, num_steps=num_steps, seed=seed,
                             init_same_noise=cfg.init_same_noise, rows=local.tolist())
        selected, latents0, noise = draws.selected, draws.latents0, draws.noise
        if not 1 <= chunks <= selected.shape[1]:
            raise ValueError(f"chunks={chunks} must be between 1 and the {selected.shape[1]} "
                             "selected steps per sample")
        chunk_steps = list(torch.tensor_split(selected, chunks, dim=1))
        mask = torch.zeros(batch, num_steps, dtype=torch.bool)
        mask.scatter_(1, chunk_steps[0], True)
        example = (self._call_args(latents0, 0, cond_list, torch.arange(batch)),
                   {"noise": noise[0]})
        units = assign(layout, num_prompts=num_prompts, group_size=cfg.group_size,
                       world_size=par.world_size, rank=par.rank, seed=seed)
        plan_mask = mask[local] if local.numel() else mask
        if self.sharding is not None and local.numel():
            # fsdp: Retain also keeps a stand-in row at every step another rank trains and
            # this one does not (_fsdp_padding)
            extra = mask.any(0) & ~plan_mask.any(0)
            if bool(extra.any()):
                plan_mask = torch.cat([plan_mask, extra[None]])
        # Reweight's gradient buffers in flight: a group's rows on this rank (the whole local
        # batch when advantages wait for everyone: global_std, or groups scattered over ranks).
        in_flight = (plan_mask.shape[0] if layout == "scattered"
                     else max([len(u.rows) for u in units] + [1]))
        # fsdp Reweight reducing once per update holds a group's corrected full-size gradient
        # beside the next group's buffers (grad_sync)
        held = int(self.sharding is not None and self._per_group("reweight", layout)
                   and not self._group_sync() and len(units) > 1)
        schedule, reason, plans, partitioner_budget, budget_bytes = self._plans(
            keys, example, plan_mask, schedule, in_flight=in_flight, held_grads=held)
        if self.ranks.distributed:
            # The ranks must run the same schedule (their collectives follow it): the most
            # frugal of their choices.
            order = ("retain", "reweight", "recompute")
            agreed = order[int(self.ranks.all_max(order.index(schedule)))]
            if agreed != schedule:
                reason = (f"{agreed}: another rank's rows do not fit {schedule} (this rank: "
                          f"{reason})")
                schedule, partitioner_budget = agreed, None
            # And the same graphs: Retain's partitioner budget changes what the backward
            # recomputes (under fsdp, which gathers it runs), so the smallest budget any
            # rank needs (None, the partitioner's default, counts as the largest).
            value = self.ranks.all_min(2.0 if partitioner_budget is None
                                       else partitioner_budget)
            agreed_budget = None if value >= 2.0 else value
            if schedule == "retain" and agreed_budget != partitioner_budget:
                reason += (f"; partitioner budget {agreed_budget}, which another rank's rows "
                           "need")
                partitioner_budget = agreed_budget
        padding = None
        if self.sharding is not None:
            padding = self._fsdp_padding(layout, num_prompts=num_prompts, seed=seed,
                                         mask=mask, schedule=schedule)
            self._check_fsdp_calls(keys, example, padding, chunk_steps, schedule,
                                   partitioner_budget, self._regathers(schedule))
        sync_rounds = self._sync_rounds(schedule, layout, num_prompts=num_prompts, seed=seed)
        return _Setup(keys=keys, num_prompts=num_prompts, batch=batch, cond=cond,
                      cond_list=cond_list, selected=selected, latents0=latents0, noise=noise,
                      chunk_steps=chunk_steps, mask=mask,
                      lean=self.lean_step(keys, partitioner_budget,
                                          self._regathers(schedule)), schedule=schedule,
                      reason=reason, plans=plans, partitioner_budget=partitioner_budget,
                      budget_bytes=budget_bytes, seed=seed, layout=layout, local=local,
                      owned=owned, units=units, padding=padding, sync_rounds=sync_rounds)

    def _per_group(self, schedule: str, layout: str) -> bool:
        """Reweight trains each prompt group in the rollout as soon as it is scored, unless its
        advantages wait for the whole batch (global std; groups scattered over the ranks)."""
        return schedule == "reweight" and not self.config.global_std and layout != "scattered"

    def _sync_rounds(self, schedule: str, layout: str, *, num_prompts: int, seed: int) -> int:
        """Reweight with per-group sync: the rounds of prompt groups it reduces after (the
        most units any rank has: every rank reduces after every round, in the same order, a
        rank with fewer prompt groups adding zeros); 0 otherwise (one reduction per update)."""
        par = self.parallel
        if not (par.distributed and self._per_group(schedule, layout) and self._group_sync()):
            return 0
        return max(len(assign(layout, num_prompts=num_prompts, group_size=self.config.group_size,
                              world_size=par.world_size, rank=r, seed=seed))
                   for r in range(par.world_size))

    def _sync_plan(self, st: _Setup, graph) -> tuple[dict[str, tuple[int, int]], str]:
        """Per schedule, the gradient reductions one update will issue on this rank and their
        bytes (what ``GradResult.sync_collectives`` / ``sync_bytes`` then count), with a line
        saying where they come from; ({}, "") in one process."""
        if not self.ranks.distributed:
            return {}, ""
        par = self.parallel
        # Without sharding: one all-reduce per group of the mesh (data, sequence parallel).
        groups = len(self.ranks.groups)
        params = dict(self.policy.named_parameters())
        grads = [params[n] for n in self.trainable]
        buckets = len({(p.dtype, p.device) for p in grads})
        rounds = self._sync_rounds("reweight", st.layout, num_prompts=st.num_prompts,
                                   seed=st.seed)
        trained_steps = int(st.mask.any(0).sum())
        if self.sharding is not None:
            # Recompute and Retain: the backward graph's own reductions, once per trained
            # step; Reweight: every (padded) full gradient per round (or update).
            count, nbytes = _backward_reductions(graph)
            full = sum(self.sharding.rows[n] * par.world_size * p[0].numel() * p.element_size()
                       for n, p in zip(self.trainable, grads))
            parts = sum(p.numel() * p.element_size() for p in grads)
            # and a sequence-parallel group sums the reduced parts
            summed = (buckets, parts) if groups > 1 else (0, 0)
            out = {"recompute": (count * trained_steps + summed[0],
                                 nbytes * trained_steps + summed[1])}
            out["retain"] = out["recompute"]
            # (each round's reduction is the others': reduce-scatters, then the sum)
            out["reweight"] = (max(rounds, 1) * (buckets + summed[0]),
                               max(rounds, 1) * (full + summed[1]))
        else:  # one all-reduce of every gradient per update (Reweight: per round)
            full = sum(p.numel() * p.element_size() for p in grads)
            out = {"recompute": (groups * buckets, groups * full),
                   "retain": (groups * buckets, groups * full),
                   "reweight": (max(rounds, 1) * buckets * groups,
                                max(rounds, 1) * full * groups)}
        cfg = self.config
        kinds = [f"{'fsdp' if self.sharding is not None else 'ddp'} over {par.world_size} "
                 "ranks"] if par.distributed else []
        if self._sequence_sync is not None and self._sequence_sync.distributed:
            kinds.append(f"the sequence-parallel group's sum over "
                         f"{self._sequence_sync.world_size} ranks")
        why = [" and ".join(kinds)]
        if self.sharding is not None:
            per = (f"{count} bucketed reduce-scatter(s) of {format_bytes(nbytes)}, "
                   f"bucket_cap_mb={cfg.bucket_cap_mb:g}" if cfg.bucket_cap_mb is not None
                   else f"{count} reduce-scatter(s), one per parameter")
            why.append(f"recompute and retain reduce-scatter in every backward ({per}), one "
                       f"backward per trained step ({trained_steps})")
        if rounds:
            why.append(f"reweight once per round of prompt groups ({rounds}; grad_sync="
                       f"{cfg.grad_sync!r})")
        else:
            waits = ("scattered layout" if st.layout == "scattered" else
                     "global_std" if cfg.global_std else f"grad_sync={cfg.grad_sync!r}")
            why.append(f"reweight once per update ({waits})")
        return out, "; ".join(why)

    def _group_sync(self) -> bool:
        """``GRPOConfig.grad_sync`` resolved: reduce per round of prompt groups?"""
        mode = self.config.grad_sync
        return mode == "group" or (mode == "auto" and self.sharding is not None)

    def _fsdp_padding(self, layout: str, *, num_prompts: int, seed: int, mask, schedule: str):
        """``parallel="fsdp"`` gathers the parameters inside every step call and
        reduce-scatters their gradients inside every backward, so every rank must call the
        step as often, in the same order. Rows are spread unevenly (a rank without rows, a
        worker group with fewer prompts, DanceGRPO's per-sample trained steps), so the ranks
        agree on the union of their calls, which every rank computes alike from the layout
        and the mask: per unit index and denoising step, an untrained call when any rank has
        an untrained row there, a trained call when any rank has a trained row (Recompute:
        one call when any rank has rows). A rank without rows for a call makes it on a
        stand-in row (``PendingUpdate._stand_in``) whose loss is multiplied by zero: its
        gradient adds exactly nothing."""
        cfg, par = self.config, self.parallel
        if self._per_group(schedule, layout):
            every = [assign(layout, num_prompts=num_prompts, group_size=cfg.group_size,
                            world_size=par.world_size, rank=r, seed=seed)
                     for r in range(par.world_size)]
            units = [sorted(row for us in every if u < len(us) for row in us[u].rows)
                     for u in range(max(len(us) for us in every))]
        else:
            units = [list(range(mask.shape[0]))]
        padding = []
        for rows in units:
            m = mask[rows]
            if schedule == "recompute":
                padding.append([(bool(rows), False)] * m.shape[1])
            else:
                padding.append([(bool((~m[:, k]).any()), bool(m[:, k].any()))
                                for k in range(m.shape[1])])
        return padding

    def _check_fsdp_calls(self, keys, example, padding, chunk_steps, schedule: str,
                          partitioner_budget=None, regather: bool = False) -> None:
        """The step's forward and inference graphs must issue the same collectives in one order
        (a rank's untrained call pairs with another's trained one), and the ranks' padded
        calls must agree (they do by construction; compared across the ranks all the same,
        before the rollout, as a cheap guard against a rank drawing something else)."""
        graph = self._graphs(self.lean_step(keys, partitioner_budget, regather), example)
        orders = {name: _gather_order(gm, graph.report, name)
                  for name, gm in (("forward", graph.forward), ("inference", graph.inference))
                  if gm is not None}
        if len(set(map(tuple, orders.values()))) > 1:
            raise RuntimeError(
                "parallel='fsdp': the step's forward and inference graphs issue their "
                f"collectives in different orders ({orders}); ranks that run different graphs "
                "at one step would pair the wrong all-gathers. Use parallel='ddp' (or, where only "
                "their buckets differ, GRPOConfig(bucket_cap_mb=None))")
        calls = " | ".join("".join(f"{int(a)}{int(b)}" for a, b in unit) for unit in padding)
        later = [sorted(set(steps.flatten().tolist())) for steps in chunk_steps[1:]]
        self.parallel.check_same(
            "the step calls under parallel='fsdp'", f"{schedule} {calls} {later}",
            fix="parallel='fsdp' runs the parameter all-gathers inside every step call and the "
                "gradient reduce-scatters inside every backward, so every rank must draw the "
                "same batch: pass the same conditions and generator seed on every rank")

    def explain_schedules(self, conditions, generator=None, *, schedule=None) -> ScheduleReport:
        """What ``leancompile.explain(trainer, conditions)`` returns: ``explain``."""
        return self.explain(conditions, generator, schedule=schedule)

    def explain(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                schedule: str | None = None) -> ScheduleReport:
        """Compile the step graphs and build the plans for this batch without running the
        rollout: the three schedules with memory and time estimates, the choice, and what the
        pipeline's LeanGRPO stage found in the step's forward graph."""
        st = self._setup(conditions, generator, schedule=schedule, chunks=1)
        graph = self._graphs(st.lean, (self._call_args(st.latents0, 0, st.cond_list,
                                                       torch.arange(st.batch)),
                                       {"noise": st.noise[0]}))
        nodes = {name: len(gm.graph.nodes) for name, gm in (
            ("forward", graph.forward), ("backward", graph.backward),
            ("inference", graph.inference))}
        sync, sync_note = self._sync_plan(st, graph)
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
                chunks: int = 1, schedule: str | None = None) -> "PendingUpdate":
        """Run the rollout (with the schedule's forward/backward work) and score it; the
        returned ``PendingUpdate.update()`` computes the gradients. Changing the parameters in
        between (an optimizer step) is detected and that update is recomputed.
        ``chunks > 1`` splits each sample's selected steps into that many chunks; only the first
        goes through the schedule (``pending.update(chunk=c)`` recomputes chunk ``c``)."""
        with self.parallel.graph_collectives():
            return self._rollout(conditions, generator, chunks=chunks, schedule=schedule)

    def _rollout(self, conditions: Mapping[str, torch.Tensor], generator=None, *,
                 chunks: int = 1, schedule: str | None = None) -> "PendingUpdate":
        """``rollout`` (its collectives' failures made ``PeerFailureError``)."""
        cfg = self.config
        start = time.perf_counter()  # planning counts: a user's step pays for it
        st = self._setup(conditions, generator, schedule=schedule, chunks=chunks)
        st.lean.reset_stats()
        st.lean.take_deferred_grads()  # nothing an earlier, abandoned rollout held back
        pending = PendingUpdate(trainer=self, setup=st, versions=self._versions())
        adv_config = AdvantageConfig(global_std=cfg.global_std, adv_clip_max=cfg.adv_clip_max)
        group_ids = group_ids_for(st.num_prompts, cfg.group_size)
        par = self.parallel
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
        per_group = self._per_group(st.schedule, st.layout)
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
                    rewards[rows] = self._score(traj[:, -1], group_cond)
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
            if st.sync_rounds:
                pending.rollout_grads, pending._rollout_sync = pending.take_rounds()
            else:
                pending.rollout_grads = pending.collect(deferred=True)
                pending._rollout_sync = pending.sync
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


def _sequence_parallel_of(policy: nn.Module):
    """The ``SequenceParallel`` of a submodule of ``policy``, if one was parallelized."""
    found = {id(sp): sp for m in policy.modules()
             if (sp := getattr(m, "_leancompile_sequence_parallel", None)) is not None}
    if len(found) > 1:
        raise NotImplementedError("the policy holds several sequence-parallel models; one is "
                                  "supported")
    return next(iter(found.values()), None)


def _backward_reductions(graph) -> tuple[int, int]:
    """The gradient reduce-scatters one run of the step's backward issues, and their bytes:
    counted in the backward as AOTAutograd made it (FlashOverlap may have turned one into P2P
    steps, which still reduce once), less those the bucketing pass merged into one per
    bucket (its report on the backward graph)."""
    count = nbytes = 0
    for node in graph.backward_aten.graph.nodes:
        if node.op == "call_function" and "reduce_scatter_tensor" in str(node.target):
            val = node.args[0].meta.get("val")
            count += 1
            nbytes += val.numel() * val.element_size() if val is not None else 0
    merged, buckets = _bucketed(graph, "backward").get("reduce_scatter", (0, 0))
    return count - merged + buckets, nbytes


def _bucketed(graph, phase: str) -> dict[str, tuple[int, int]]:
    """What the bucketing pass merged in the step's ``phase`` graph:
    ``{kind: (collectives, buckets)}`` (``bucket_collectives.merged_counts``)."""
    report = graph.report
    results = [] if report is None else [p for r in report.graphs if r.phase == phase
                                         for p in r.passes if p.name == BUCKETS]
    return merged_counts(results[0]) if results else {}


def _gather_order(gm, report=None, phase: str = "") -> list:
    """The communication a graph issues, in order: per collective (its wait aside) or
    point-to-point step, the op and the dtype and shape of its first tensor argument; then
    the buckets the bucketing pass made (``report``: the step's, for the ``phase`` graph)."""
    out = []
    for node in gm.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        if node.op != "call_function" or namespace not in COMMUNICATION_NAMESPACES \
                or "wait_tensor" in str(node.target):
            continue
        arg = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        val = arg.meta.get("val") if arg is not None else None
        out.append((str(node.target).split(".")[1], str(val.dtype),
                    tuple(str(d) for d in val.shape))  # (sizes may be symbolic)
                   if isinstance(val, torch.Tensor) else str(node.target))
    if report is not None:
        out += [note for r in report.graphs if r.phase == phase for p in r.passes
                if p.name == BUCKETS for note in p.notes if note.startswith("all_gather")]
    return out


class PendingUpdate:
    """A scored rollout waiting for its update; see ``GRPOTrainer.rollout``."""

    def __init__(self, *, trainer: GRPOTrainer, setup: _Setup, versions):
        self.trainer = trainer
        self.setup = setup
        self.schedule = setup.schedule
        self.reason = setup.reason
        self.plans = setup.plans
        self.chunk_steps = setup.chunk_steps
        self.versions = versions
        self.rollout: Rollout | None = None
        self.rollout_seconds = 0.0
        self.trained_in_rollout = False
        self._done: set[int] = set()
        self._mean_refs: dict = {}
        self._kl: list[torch.Tensor] = []
        self._stash: dict = {}
        self.rollout_grads: dict | None = None
        self.sync = (0, 0)
        self._rollout_sync = (0, 0)
        self._rounds: tuple | None = None
        self._retained = self._buffered = 0
        self._ratio_error: float | None = None
        self._backwards_counted = 0
        self._stand_in_row = None
        self._stand_in_kept: dict = {}

    # -- gradients live in .grad while the trainer computes them ------------------------------
    def stash_grads(self) -> None:
        """Set the user's ``.grad`` aside (``restore_grads`` puts it back)."""
        self._stash = {n: p.grad for n, p in self.trainer.policy.named_parameters()}
        for p in self.trainer.policy.parameters():
            p.grad = None

    def collect(self, *, deferred: bool = False) -> dict[str, torch.Tensor]:
        """The trainable parameters' ``.grad`` (taken out), summed over the ranks when data
        parallel: the update's one gradient reduction. ``deferred``: the update ran
        Reweight's path, whose gradients wait in the step for one reduce-scatter under fsdp
        (the same on every rank: it decides whether this rank joins that collective)."""
        params = dict(self.trainer.policy.named_parameters())
        grads = {}
        for name in self.trainer.trainable:
            p = params[name]
            grads[name] = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            p.grad = None
        with record_function("leancompile.sync"):
            sync = (0, 0)
            if self.trainer.sharding is not None:  # the parts, reduced over data parallel
                sync = self._fsdp_reductions(grads, deferred=deferred)
            # ddp's all-reduce (fsdp: none), then the sequence-parallel group's sum
            more = self.trainer.ranks.sync_gradients(grads)
            self.sync = (sync[0] + more[0], sync[1] + more[1])
        return grads

    def reduce_round(self) -> None:
        """Reweight with ``grad_sync="group"``: the gradients of the round of prompt groups
        just trained (their advantages are in them) reduced over the ranks now (``collect``)
        and added to the rollout's total; under fsdp the rank's full-size gradients are
        reduce-scattered to its parts and freed before the next group's buffers fill."""
        grads = self.collect(deferred=True)
        if self._rounds is None:
            self._rounds = (grads, self.sync)
            return
        total, (count, nbytes) = self._rounds
        for name, g in grads.items():
            total[name] += g
        self._rounds = (total, (count + self.sync[0], nbytes + self.sync[1]))

    def take_rounds(self) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """The summed gradients of every ``reduce_round`` and their (collectives, bytes)."""
        rounds, self._rounds = self._rounds, None
        if rounds is None:
            raise RuntimeError("take_rounds() before any reduce_round() (a bug in the trainer)")
        return rounds

    def _fsdp_reductions(self, grads: dict[str, torch.Tensor], *,
                         deferred: bool) -> tuple[int, int]:
        """``parallel="fsdp"``: Reweight's held-back full gradients reduce-scattered with one
        collective and added to ``grads``; returns (collectives, bytes) of this update's
        gradient reductions, the backward graphs' own reduce-scatters included. Every rank
        passes every sharded parameter in the trainer's order (zeros for those this rank
        has no gradient of, e.g. no rows), so the ranks' flat buffers line up."""
        trainer = self.trainer
        par, lean, sharding = trainer.parallel, self.setup.lean, trainer.sharding
        count, nbytes = par.sync_collectives, par.sync_bytes
        names = {id(p): n for n, p in trainer.policy.named_parameters()}
        taken = {names[id(p)]: g for p, g in lean.take_deferred_grads()}
        if not deferred and taken:
            raise RuntimeError(f"gradients of {sorted(taken)[:4]} were held back for a "
                               "reduction outside Reweight's path (a bug in the trainer)")
        params = dict(trainer.policy.named_parameters())
        held = {} if not deferred else {
            n: taken[n] if n in taken else params[n].new_zeros(
                (sharding.rows[n] * par.world_size,) + tuple(sharding.shapes[n][1:]))
            for n in trainer.trainable if n in sharding.shapes}
        for name, part in par.reduce_scatter_grads(held).items():
            grads[name] += part
        in_graph, in_graph_bytes = self._in_graph_reductions()
        return (par.sync_collectives - count + in_graph,
                par.sync_bytes - nbytes + in_graph_bytes)

    def _in_graph_reductions(self) -> tuple[int, int]:
        """``parallel="fsdp"``: the gradient reduce-scatters the step's backward graphs ran
        since the last count (the rollout's start, or the previous chunk's update; each update
        call runs one backward), and their bytes."""
        lean = self.setup.lean
        graph = next((g for g in lean.graphs if g.backward_aten is not None), None)
        count, nbytes = (0, 0) if graph is None else _backward_reductions(graph)
        calls = lean.stats.backward_graphs_run - self._backwards_counted
        self._backwards_counted = lean.stats.backward_graphs_run
        return count * calls, nbytes * calls

    def restore_grads(self) -> None:
        for name, p in self.trainer.policy.named_parameters():
            p.grad = self._stash.get(name)

    # -- rollout and update loops ------------------------------------------------------------
    def _stand_in(self):
        """``parallel="fsdp"``'s stand-in row (``GRPOTrainer._fsdp_padding``): latents and
        SDE noise from a generator of its own (the global random state is not touched) and
        the batch's first conditions; its calls' values are finite and never used."""
        if self._stand_in_row is None:
            st = self.setup
            g = torch.Generator().manual_seed(0)
            shape = (1,) + tuple(st.latents0.shape[1:])
            x = torch.randn(shape, generator=g).to(st.latents0)
            noise = torch.randn((st.noise.shape[0],) + shape, generator=g).to(st.noise)
            self._stand_in_row = (x, [c[:1] for c in st.cond_list], noise)
        return self._stand_in_row

    def _stand_in_call(self, k: int, trained: bool):
        """One padding call of the rollout at step ``k`` (under ``rollout()``); Retain's
        trained ones are kept for the update's padding call (``_stand_in_update``)."""
        trainer, lean = self.trainer, self.setup.lean
        x, cond, noise = self._stand_in()
        args = trainer._call_args(x, k, cond, torch.arange(1))
        out = lean(*args, noise=noise[k])
        if trained:
            self._stand_in_kept[k] = (args, out[0])

    def _stand_in_update(self, k: int) -> None:
        """The update's padding call at step ``k`` (under ``update()``): the kept stand-in
        call reused (Retain) or recomputed, its loss times zero, backpropagated (the backward
        graph's reduce-scatters run with a zero contribution from this rank)."""
        trainer, lean = self.trainer, self.setup.lean
        if k in self._stand_in_kept:
            args, prev = self._stand_in_kept[k]
        else:
            x, cond, _ = self._stand_in()
            args, prev = trainer._call_args(x, k, cond, torch.arange(1)), x
        out = lean(*args, prev_sample=prev)
        loss = out[1].sum() * 0.0
        if trainer.config.beta > 0:
            loss = loss + out[2].sum() * 0.0
        loss.backward()

    def sample(self, rows: torch.Tensor, padding: list | None = None):
        """Denoise the samples ``rows`` through all steps under ``rollout()``: calls of the
        selected rows are trained (named by their sample), the others are not. ``padding``
        (fsdp): per step, the (untrained, trained) calls every rank makes; those this rank
        has no rows for are made on the stand-in row (untrained under Reweight, whose
        trained calls gather as untrained ones do and reduce nothing)."""
        st, trainer = self.setup, self.trainer
        lean = st.lean
        num_steps = st.noise.shape[0]
        device = st.latents0.device
        rows_at = rows.to(device, non_blocking=True)  # (see train)
        x = st.latents0[rows_at]
        noise_rows = st.noise[:, rows_at]
        cond_rows = [c[rows_at] for c in st.cond_list]
        trajectory = [x]
        log_probs = torch.zeros(rows.numel(), num_steps, device=device)
        flags, samples = [], []
        split = st.schedule != "recompute"
        with lean.rollout(train=lambda i: flags[i], samples=lambda i: samples[i],
                          schedule=st.schedule, budget_bytes=st.budget_bytes), \
                torch.no_grad(), record_function("leancompile.rollout"):
            for k in range(num_steps):
                x_next = torch.empty_like(x)
                sel = st.mask[rows, k]
                parts = [(~sel).nonzero().flatten(), sel.nonzero().flatten()] if split else \
                    [torch.arange(rows.numel())]
                for local, trained in zip(parts, (False, True)):
                    if local.numel() == 0:
                        if padding is not None and padding[k][int(trained)]:
                            kept = trained and st.schedule == "retain"
                            flags.append(kept)
                            samples.append(torch.tensor([st.batch]))  # no sample of the batch
                            self._stand_in_call(k, kept)
                        continue
                    trained = trained and split
                    local_at = local.to(device, non_blocking=True)
                    args = trainer._call_args(x, k, cond_rows, local_at)
                    noise = noise_rows[k][local_at]
                    if trained and trainer.config.beta > 0:
                        args[-1] = trainer._reference_mean(args, st.keys, noise)
                        self._mean_refs[(k, tuple(rows[local].tolist()))] = args[-1]
                    flags.append(trained)
                    samples.append(rows[local])
                    out = lean(*args, noise=noise)
                    x_next[local_at], log_probs[local_at, k] = out[0], out[1]
                x = x_next
                trajectory.append(x)
        stats = lean.stats
        self._retained = max(self._retained, stats.peak_kept_bytes)
        self._buffered = max(self._buffered, stats.peak_buffer_bytes)
        return torch.stack(trajectory, dim=1), log_probs

    def train(self, rows, advantages, trajectory, log_probs, *, chunk: int,
              on_policy: bool = True) -> None:
        """The update of ``rows`` for chunk ``chunk`` of the selected steps: each step's
        selected rows called again (same inputs) under ``update()``, the PPO loss (+ KL)
        backpropagated into ``.grad``. ``on_policy``: the parameters are the rollout's, so the
        ratio should be 1: its largest deviation is recorded (``ratio_error``)."""
        st, trainer, cfg = self.setup, self.trainer, self.trainer.config
        lean = st.lean
        steps = self.chunk_steps[chunk]
        mask = torch.zeros(st.batch, st.noise.shape[0], dtype=torch.bool)
        mask.scatter_(1, steps, True)
        norm = float(st.batch * steps.shape[1])
        # fsdp: a step some rank trains runs a backward (reduce-scatters) on every rank,
        # except on Reweight's path, whose update calls run no collective.
        pad = st.padding is not None and not (self.schedule == "reweight" and chunk == 0
                                              and on_policy)
        # Row indices and advantages where the trajectory is, once (an index on the host
        # indexing a device tensor is copied over, and waits for the device, at every use).
        device = trajectory.device
        rows_at = rows.to(device, non_blocking=True)
        cond_rows = [c[rows_at] for c in st.cond_list]
        advantages = advantages.to(device, torch.float32, non_blocking=True)
        errors = []  # |ratio - 1| per call, read once after the loop
        with lean.update(), record_function("leancompile.update"):
            for k in range(st.noise.shape[0]):
                local = mask[rows, k].nonzero().flatten()
                if local.numel() == 0:
                    if pad and bool(mask[:, k].any()):
                        self._stand_in_update(k)
                    continue
                glob, local_at = rows[local], local.to(device, non_blocking=True)
                glob_at = rows_at[local_at]
                args = trainer._call_args(trajectory[rows_at, k], k, cond_rows, local_at)
                if cfg.beta > 0:
                    key = (k, tuple(glob.tolist()))
                    args[-1] = self._mean_refs[key] if key in self._mean_refs else \
                        trainer._reference_mean(args, st.keys, st.noise[k][glob_at])
                out = lean(*args, prev_sample=trajectory[glob_at, k + 1])
                ratio = torch.exp(out[1] - log_probs[glob_at, k])
                if on_policy:
                    errors.append((ratio.detach() - 1).abs().max())
                adv = advantages[glob_at]
                clipped = torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
                loss = torch.maximum(-adv * ratio, -adv * clipped).sum() / norm
                if cfg.beta > 0:
                    loss = loss + cfg.beta * out[2].sum() / norm
                    self._kl.append(out[2].detach())
                loss.backward()
        if errors:
            error = torch.stack(errors).max().item()
            self._ratio_error = max(self._ratio_error or 0.0, error)
        stats = lean.stats
        self._retained = max(self._retained, stats.peak_kept_bytes)
        self._buffered = max(self._buffered, stats.peak_buffer_bytes)

    def update(self, chunk: int = 0) -> GradResult:
        """Gradients of chunk ``chunk`` of the selected steps (0: the schedule's; later
        chunks and any update after a parameter change: recomputed)."""
        with self.trainer.parallel.graph_collectives():
            return self._update(chunk)

    def _update(self, chunk: int) -> GradResult:
        if chunk in self._done:
            raise ValueError(f"chunk {chunk} of this rollout was already updated")
        if not 0 <= chunk < len(self.chunk_steps):
            raise ValueError(f"chunk={chunk}; this rollout has {len(self.chunk_steps)} chunks")
        earlier = bool(self._done)
        self._done.add(chunk)
        trainer, record = self.trainer, self.rollout
        start = time.perf_counter()
        stale = trainer._versions() != self.versions
        lean = self.setup.lean
        # What the rollout kept serves chunk 0 only, fresh and first: any other update frees
        # it and recomputes, the same way on every rank (under fsdp a rank reusing while
        # another recomputes would pair different collectives).
        reusable = chunk == 0 and not stale and not earlier
        before = lean.stats.reused_calls
        if chunk == 0 and stale and self.schedule != "recompute":
            warnings.warn(
                "the policy's parameters changed between rollout and update (an optimizer "
                "step or an in-place change): the kept activations / gradient buffers are "
                "stale, so this update is recomputed", OffPolicyWarning, stacklevel=2)
        rows = self.setup.local
        self.stash_grads()
        try:
            if chunk == 0 and self.trained_in_rollout and not stale:
                grads = self.rollout_grads  # reweight updated each group as it was scored
                self.sync = self._rollout_sync
            else:
                if not reusable:
                    self._kl.clear()
                    self._ratio_error = None
                    lean.discard_kept()
                self.train(rows, record.advantages, record.latents, record.log_probs,
                           chunk=chunk, on_policy=reusable)
                grads = self.collect(deferred=self.schedule == "reweight" and reusable)
        finally:
            self.restore_grads()
        reused = lean.stats.reused_calls > before or (
            self.trained_in_rollout and chunk == 0 and not stale)
        par = trainer.parallel
        if par.distributed:  # a rank without rows reused nothing, but its peers did
            reused = par.all_max(float(reused)) > 0
        used = self.schedule if reused and self.schedule != "recompute" else "recompute"
        kl_sum = float(torch.cat(self._kl).sum()) if self._kl else 0.0
        kl_count = sum(k.numel() for k in self._kl)
        if trainer.config.beta > 0:
            kl_sum, kl_count = par.all_sum([kl_sum, kl_count])
        kl = kl_sum / kl_count if kl_count else 0.0
        self._kl.clear()
        ratio_error, self._ratio_error = self._ratio_error, None
        synchronize(record.latents.device)  # (update_seconds include the queued work)
        if par.distributed:
            ratio_error = par.all_max(-1.0 if ratio_error is None else ratio_error)
            ratio_error = None if ratio_error < 0 else ratio_error
        return GradResult(grads=grads, rollout=record, schedule=used, reason=self.reason,
                          plans=self.plans, retained_bytes=self._retained if used != "recompute"
                          else 0, buffer_bytes=self._buffered if used != "recompute" else 0,
                          kl=kl, rollout_seconds=self.rollout_seconds,
                          update_seconds=time.perf_counter() - start, ratio_error=ratio_error,
                          sync_collectives=self.sync[0], sync_bytes=self.sync[1])
