"""Group-relative advantages: each sample's reward, normalised within its prompt group.

GRPO has no critic. A prompt is sampled ``group_size`` times and each sample's advantage is its
reward minus the group's mean, divided by a std (the group's, or the whole batch's), then
clamped. The advantage is the only thing the reward contributes to the gradient
(``docs/leangrpo.md`` section 1), and the LeanGRPO schedules need it as a plain function of the
batch's rewards: Reweight scales a per-sample gradient buffer by it, Retain scales a kept
graph's cotangent by it.

The numbers follow FlowGRPO's ``PerPromptStatTracker.update`` (``flow_grpo/stat_tracking.py``)
and training loop (``scripts/train_sd3.py``):

- mean per group; std ``np.std`` (biased, ``ddof=0``) of the group, or of every reward in the
  batch with ``global_std=True`` (the mean stays per group); ``eps = 1e-4`` is added to the std,
  not under the square root: ``A = (r - mean) / (std + eps)``;
- advantages clamped to ``[-adv_clip_max, adv_clip_max]`` with ``adv_clip_max = 5`` (FlowGRPO
  clamps in the loss; doing it here gives the same values).

DanceGRPO (``fastvideo/train_grpo_flux.py``, ``use_group``) uses ``torch.std`` (unbiased,
``ddof=1``) and ``eps = 1e-8``, also added to the std, and the same clamp of 5: set
``unbiased=True, eps=1e-8``. The statistics are computed in float64 (FlowGRPO uses numpy
float64) and the result is returned as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AdvantageConfig", "group_advantages", "group_ids_for"]


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards become advantages. The defaults are FlowGRPO's."""

    global_std: bool = False
    """Divide by the std of every reward in the batch instead of the group's (FlowGRPO's
    ``sample.global_std``; its SD3.5 configs turn it on). The mean is still the group's. Then
    every advantage depends on every group, so none is final before the whole batch is scored."""

    adv_clip_max: float = 5.0
    """Advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (FlowGRPO and DanceGRPO: 5).
    ``math.inf`` disables the clamp."""

    eps: float = 1e-4
    """Added to the std before dividing (FlowGRPO ``1e-4``, DanceGRPO ``1e-8``); keeps a group
    whose rewards are all equal at advantage 0 instead of NaN."""

    unbiased: bool = False
    """Use the unbiased std (divide by ``n - 1``), as DanceGRPO's ``torch.std`` does; FlowGRPO's
    ``np.std`` is biased (divide by ``n``). Every group then needs at least two samples."""

    def __post_init__(self):
        if isinstance(self.adv_clip_max, bool) or not isinstance(self.adv_clip_max, (int, float)) \
                or not self.adv_clip_max > 0:
            raise ValueError(f"adv_clip_max={self.adv_clip_max!r} must be a number > 0; use "
                             "math.inf to disable the clamp")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) \
                or not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps={self.eps!r} must be a finite number > 0 (FlowGRPO uses "
                             "1e-4, DanceGRPO 1e-8); with 0 a group of equal rewards gives 0/0")


def group_ids_for(num_prompts: int, group_size: int) -> Tensor:
    """Group id of each row when rows are laid out prompt-major: row ``b`` belongs to prompt
    ``b // group_size`` (DanceGRPO's ``repeat_interleave`` layout). Shape
    ``[num_prompts * group_size]``, int64."""
    for name, value in (("num_prompts", num_prompts), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    return torch.arange(num_prompts).repeat_interleave(group_size)


def _std(centered: Tensor, counts: Tensor, index: Tensor, num: int, unbiased: bool) -> Tensor:
    sq = torch.zeros(num, dtype=centered.dtype, device=centered.device)
    sq.index_add_(0, index, centered**2)
    return torch.sqrt(sq / (counts - 1 if unbiased else counts))


def group_advantages(rewards: Tensor, group_ids: Tensor,
                     config: AdvantageConfig | None = None) -> Tensor:
    """Advantages ``[B]`` (float32) of ``rewards [B]``, normalised within the groups given by
    ``group_ids [B]`` (any integer labels; rows of a group need not be adjacent).

    ``A_b = clamp((r_b - mean_g) / (std + eps), -adv_clip_max, adv_clip_max)`` where ``g`` is
    ``b``'s group and ``std`` is the group's std, or the batch's with ``config.global_std``.
    """
    config = AdvantageConfig() if config is None else config
    if not isinstance(rewards, Tensor) or rewards.ndim != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards)
        raise ValueError(f"rewards must be a 1-D tensor [B]; got {shape}")
    if not isinstance(group_ids, Tensor) or group_ids.shape != rewards.shape:
        shape = tuple(group_ids.shape) if isinstance(group_ids, Tensor) else type(group_ids)
        raise ValueError(f"group_ids must be a tensor shaped like rewards {tuple(rewards.shape)}; "
                         f"got {shape}; build it with group_ids_for(num_prompts, group_size)")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex \
            or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor; got {group_ids.dtype}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; there is nothing to normalise")

    r = rewards.detach().to(torch.float64)
    bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        shown = bad[:16]
        values = [r[i].item() for i in shown]
        more = f" (and {len(bad) - 16} more)" if len(bad) > 16 else ""
        raise ValueError(f"rewards of samples {shown}{more} are not finite: {values}; fix the "
                         "reward function or drop these samples before computing advantages")

    group_ids = group_ids.to(r.device)  # (labels built on the host, rewards on a device)
    _, index = torch.unique(group_ids, return_inverse=True)
    num = int(index.max()) + 1
    counts = torch.zeros(num, dtype=torch.float64, device=r.device)
    counts.index_add_(0, index, torch.ones_like(r))
    if config.unbiased and (counts < 2).any():
        lonely = [int(group_ids[(index == g).nonzero()[0, 0]])
                  for g in (counts < 2).nonzero().flatten().tolist()]
        raise ValueError(f"groups {lonely} have a single sample; the unbiased std needs at "
                         "least two per group (use unbiased=False, or larger groups)")
    sums = torch.zeros(num, dtype=torch.float64, device=r.device)
    sums.index_add_(0, index, r)
    centered = r - (sums / counts)[index]

    if config.global_std:
        if config.unbiased and r.numel() < 2:
            raise ValueError("the unbiased global std needs at least two rewards")
        std = torch.std(r, correction=1 if config.unbiased else 0)
    else:
        std = _std(centered, counts, index, num, config.unbiased)[index]
    advantages = centered / (std + config.eps)
    advantages = advantages.clamp(-config.adv_clip_max, config.adv_clip_max)
    return advantages.to(torch.float32)
