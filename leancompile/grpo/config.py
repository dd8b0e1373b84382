"""The trainer's configuration: ``GRPOConfig`` (one keyword-only dataclass, validated when it
is built) and the names its fields take."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import check_bucket_cap_mb
from ..passes.lean_grpo import SCHEDULES
from .layout import LAYOUTS
from .sde import SDE_KINDS
from .timesteps import TimestepSelection

__all__ = ["GRPOConfig", "GRAD_SYNCS"]

GRAD_SYNCS = ("auto", "group", "update")
"""``GRPOConfig.grad_sync``'s values."""


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

