"""``TrainerParts``: what the trainer's collaborators (the rollout set-up, the rollout loop,
``PendingUpdate``, the gradient reductions) are handed of it, fixed when it is built. The
``GRPOConfig`` is passed beside it, read when a rollout starts (a trainer's ``config`` may be
replaced between rollouts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .fsdp import ParameterSharding
from .parallel import AllRanks, DataParallel
from .reference import ReferencePolicy

__all__ = ["TrainerParts"]


@dataclass(frozen=True, kw_only=True)
class TrainerParts:
    """The parts of a ``GRPOTrainer`` that do not change after it is built."""

    policy: nn.Module
    """The policy (under ``parallel="fsdp"`` its trainable parameters are this rank's parts)."""
    trainable: tuple[str, ...]
    """Names of the trainable parameters, in ``policy.named_parameters()`` order."""
    parallel: DataParallel
    """Data parallelism (``parallel=None``: one process)."""
    ranks: AllRanks
    """Every rank of the trainer (data parallel x sequence parallel)."""
    sharding: ParameterSharding | None = None
    """``parallel="fsdp"``: the trainable parameters' shards."""
    sequence_sync: DataParallel | None = None
    """A sequence-parallel policy's group (its gradient sum, the split reward scoring)."""
    reference: ReferencePolicy | None = None
    """The KL's reference (``GRPOConfig.beta > 0``)."""
