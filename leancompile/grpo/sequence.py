"""The trainer with a sequence-parallel policy (a transformer made sequence parallel with
``leancompile.integrations.diffusers.parallelize_ulysses``): every rank of its group runs the
same rows on its part of the tokens. Here: finding the group in the policy
(``sequence_parallel_of``), checking that it and the data-parallel group form one mesh
(``check_mesh``), and scoring the rows once per sample rather than once per rank
(``score_rows``, ``GRPOConfig.split_rewards``)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .rewards import check_rewards

__all__ = ["sequence_parallel_of", "check_mesh", "score_rows"]


def sequence_parallel_of(policy: nn.Module):
    """The ``SequenceParallel`` of a submodule of ``policy``, if one was parallelized."""
    found = {id(sp): sp for m in policy.modules()
             if (sp := getattr(m, "_leancompile_sequence_parallel", None)) is not None}
    if len(found) > 1:
        raise NotImplementedError("the policy holds several sequence-parallel models; one is "
                                  "supported")
    return next(iter(found.values()), None)


def check_mesh(ranks, data, sequence, parallel) -> None:
    """A sequence-parallel policy with data parallelism: the ranks of a sequence-parallel
    group run the same rows (and, under fsdp, hold the same parts), so they must share one
    data-parallel rank, and the ranks of ``process_group`` one position in their
    sequence-parallel groups (the two groups are the dimensions of one mesh, ``(dp, sp)``;
    checkpoints under fsdp are written by the data-parallel group at position 0). Raised
    on every rank. ``ranks``: the trainer's ``AllRanks``; ``data``, ``sequence``: its
    data-parallel and sequence-parallel ``DataParallel``; ``parallel``: the trainer's
    ``parallel=`` argument."""
    if not data.distributed:
        return
    mesh_fix = ("Build both groups from one mesh: mesh = init_device_mesh(device, (dp, sp), "
                "mesh_dim_names=('dp', 'sp')); parallelize_ulysses(transformer, "
                "mesh.get_group('sp')); GRPOTrainer(..., parallel='ddp' (or 'fsdp'), "
                "process_group=mesh.get_group('dp')).")
    fix = (f"parallel={parallel!r} with a sequence-parallel policy: the ranks of a "
           "sequence-parallel group run the same rows, so each must hold the same "
           "data-parallel rank, and the ranks of process_group must hold the same "
           "position in their sequence-parallel groups. " + mesh_fix)
    ranks.check_each([
        (sequence, "the data-parallel rank (in process_group) of the sequence-parallel group's "
         "ranks", f"data-parallel rank {data.rank} of {data.world_size}"),
        (data, "the position in their sequence-parallel groups of "
         "process_group's ranks", f"sequence-parallel rank {sequence.rank} of "
         f"{sequence.world_size}")],
        fix=fix)


def score_rows(reward_fn: Callable, latents: torch.Tensor, cond: dict, *, sequence=None,
               split: bool = True) -> torch.Tensor:
    """``reward_fn`` on these rows' final latents, on the host; with a sequence-parallel
    policy (``sequence``: its group's ``DataParallel``) and ``split``, each rank of the group
    scores every N-th row and the group sums the scores (the others' zeros: exact)."""
    n = latents.shape[0]
    sp = sequence
    if sp is None or not sp.distributed or not split:
        return check_rewards(reward_fn(latents, cond), n).to("cpu")
    mine = torch.arange(sp.rank, n, sp.world_size)
    # One collective: the scores and, last, how many ranks failed (a rank whose share
    # raised must not leave its peers waiting for its scores).
    scores = torch.zeros(n + 1)
    error = None
    if mine.numel():
        try:
            scores[mine] = check_rewards(
                reward_fn(latents[mine], {k: v[mine] for k, v in cond.items()}),
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
