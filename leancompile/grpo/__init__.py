"""Diffusion GRPO pieces (LeanGRPO): SDE transitions with log-probs, group advantages,
timestep selection, rewards, and the trainer that runs compiler-produced schedules.

Import what you use from the modules (``leancompile.grpo.trainer``, ``.config``, ``.sde``,
``.rewards``, ...); the names below are the ones most code needs.
"""

from .advantages import AdvantageConfig, group_advantages, group_ids_for
from .rewards import (TargetColorReward, check_rewards, decode_latents, decoded,
                      jpeg_compressibility, jpeg_incompressibility)
from .sde import SDE_KINDS, SDEStep, kl_to_reference, sde_step
from .timesteps import TimestepSelection, same_noise_latents, select_timesteps
from .config import GRPOConfig
from .results import GradResult, OffPolicyWarning, Rollout
from .trainer import GRPOTrainer

__all__ = [
    "GRPOConfig", "GRPOTrainer", "GradResult", "Rollout", "OffPolicyWarning",
    "sde_step", "SDEStep", "SDE_KINDS", "kl_to_reference",
    "AdvantageConfig", "group_advantages", "group_ids_for",
    "TimestepSelection", "select_timesteps", "same_noise_latents",
    "jpeg_compressibility", "jpeg_incompressibility", "TargetColorReward", "decode_latents",
    "decoded", "check_rewards",
]
