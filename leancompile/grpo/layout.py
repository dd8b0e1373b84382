"""Who generates which sample: the data-parallel layouts of a GRPO batch, and per-sample seeds.

A GRPO batch is ``P`` prompts x ``M`` generations (``group_size``), ``B = P * M`` rows laid out
prompt-major (row ``p * M + m`` is generation ``m`` of prompt ``p``). Every rank passes the same
``P`` conditions; a layout maps rows to the ``R`` ranks of a process group:

``conventional`` (DanceGRPO)
    Each rank owns whole prompt groups: prompts are split into ``R`` contiguous blocks
    (``torch.tensor_split``; a rank may own none when ``P < R``). Advantages need no
    communication; each rank keeps the state of all ``M`` samples of its groups.
``scattered`` (FlowGRPO)
    The ``B`` rows are permuted (a permutation drawn from the step's seed) and split into ``R``
    blocks: members of a group sit on several ranks, so rewards are gathered over the whole
    process group before any advantage is known, and the update waits for the whole batch.
``shared`` (LeanGRPO)
    All ranks work on one prompt at a time. With ``M >= R`` generation ``m`` of a prompt runs on
    rank ``m % R`` (``ceil(M / R)`` samples per rank and prompt); with ``M < R`` the ranks split
    into ``R // M`` worker groups (contiguous blocks of ranks; the remainder spread over the first
    groups), prompt ``p`` goes to worker group ``p % G`` and generation ``m`` to the group's
    ``m % W``-th rank. Rewards are gathered inside the worker group (its own sub-communicator)
    and the group is updated as soon as it is scored; each rank keeps ``1/R`` of a group's state
    (``1/W`` with worker groups).

The assignment is a pure function of ``(layout, P, M, R, seed)``: ``assign(...)`` returns, for
one rank, the ``Unit``\\ s it works through in order (the rows it generates for some prompt
groups, and the ranks that share those groups). Every layout and world size produces the same
trajectories as one process because nothing a sample draws depends on where it runs:
``sample_seed(seed, prompt, generation)`` seeds one generator per sample (its initial latent,
its trained steps, its SDE noise), from a base ``seed`` drawn once per step from the caller's
generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .timesteps import TimestepSelection, select_timesteps

__all__ = ["LAYOUTS", "SampleDraws", "Unit", "assign", "draw_samples", "row_owner", "sample_seed",
           "step_seed", "worker_groups"]

LAYOUTS = ("conventional", "scattered", "shared")

_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads nearby inputs."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def step_seed(generator: torch.Generator | None) -> int:
    """A step's base seed: one draw from the caller's generator (torch's global one if None)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


def sample_seed(seed: int, prompt: int, generation: int) -> int:
    """The seed of sample ``(prompt, generation)`` of a step whose base seed is ``seed``
    (``generation=-1``: the prompt's own draws, e.g. DanceGRPO's shared initial latent).
    A non-negative int below 2**63, usable with ``torch.Generator.manual_seed``."""
    z = _mix(_mix(_mix(seed & _MASK) ^ (prompt & _MASK)) ^ (generation & _MASK))
    return z >> 1


@dataclass(frozen=True)
class Unit:
    """Work a rank does together: generate ``rows`` (global row indices, possibly none) of the
    prompt groups ``prompts``, whose members are spread over ``ranks`` (group ranks; the
    rewards of those groups are gathered among them)."""

    prompts: tuple[int, ...]
    rows: tuple[int, ...]
    ranks: tuple[int, ...]


def worker_groups(group_size: int, world_size: int) -> list[tuple[int, ...]]:
    """The shared layout's worker groups: ``max(1, R // M)`` contiguous blocks of ranks."""
    count = max(1, world_size // group_size)
    return [tuple(int(r) for r in block)
            for block in torch.tensor_split(torch.arange(world_size), count)]


def _check(layout, num_prompts, group_size, world_size, rank):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {LAYOUTS}")
    for name, value in (("num_prompts", num_prompts), ("group_size", group_size),
                        ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, {world_size})")


def row_owner(layout: str, *, num_prompts: int, group_size: int, world_size: int,
              seed: int = 0) -> torch.Tensor:
    """``[B]`` int64: the rank that generates each row under ``layout``."""
    _check(layout, num_prompts, group_size, world_size, 0)
    batch = num_prompts * group_size
    owner = torch.empty(batch, dtype=torch.long)
    if layout == "conventional":
        for r, block in enumerate(torch.tensor_split(torch.arange(num_prompts), world_size)):
            for p in block.tolist():
                owner[p * group_size:(p + 1) * group_size] = r
    elif layout == "scattered":
        perm = torch.randperm(batch, generator=torch.Generator().manual_seed(
            sample_seed(seed, -1, -1)))
        for r, block in enumerate(torch.tensor_split(perm, world_size)):
            owner[block] = r
    else:
        groups = worker_groups(group_size, world_size)
        for p in range(num_prompts):
            ranks = groups[p % len(groups)]
            for m in range(group_size):
                owner[p * group_size + m] = ranks[m % len(ranks)]
    return owner


def assign(layout: str, *, num_prompts: int, group_size: int, world_size: int, rank: int,
           seed: int = 0) -> list[Unit]:
    """The units ``rank`` works through, in order (see the module docstring). ``seed`` only
    matters for ``scattered`` (its permutation)."""
    _check(layout, num_prompts, group_size, world_size, rank)
    owner = row_owner(layout, num_prompts=num_prompts, group_size=group_size,
                      world_size=world_size, seed=seed)
    mine = (owner == rank).nonzero().flatten().tolist()
    if layout == "scattered":
        # Groups span arbitrary ranks: one unit, rewards gathered over everyone.
        return [Unit(prompts=tuple(range(num_prompts)), rows=tuple(mine),
                     ranks=tuple(range(world_size)))]
    if layout == "conventional":
        prompts = sorted({r // group_size for r in mine})
        return [Unit(prompts=(p,), rows=tuple(range(p * group_size, (p + 1) * group_size)),
                     ranks=(rank,)) for p in prompts]
    groups = worker_groups(group_size, world_size)
    index = next(i for i, g in enumerate(groups) if rank in g)
    units = []
    for p in range(index, num_prompts, len(groups)):
        rows = tuple(r for r in mine if r // group_size == p)
        units.append(Unit(prompts=(p,), rows=rows, ranks=groups[index]))
    return units


@dataclass(kw_only=True)
class SampleDraws:
    """What the samples of one step draw before the rollout (rows not drawn are zeros)."""

    selected: torch.Tensor
    """``[B, S]`` trained step indices (every row: selection is cheap and the update's
    normaliser needs it)."""
    latents0: torch.Tensor
    """``[B, ...]`` float32 initial latents."""
    noise: torch.Tensor
    """``[T, B, ...]`` float32 SDE noise."""


def draw_samples(policy, *, selection: TimestepSelection, num_prompts: int, group_size: int,
                 num_steps: int, seed: int, init_same_noise: bool = False,
                 rows: Sequence[int] | None = None) -> SampleDraws:
    """Draw each sample's trained steps, initial latent and SDE noise from its own generator
    (``sample_seed(seed, prompt, generation)``), in that order; only ``rows`` (default: all)
    get latents and noise. A window shared by the batch (``window_per_sample=False``) comes from
    the step's own generator, and with ``init_same_noise`` (DanceGRPO) a prompt's initial
    latent from the prompt's (``generation=-1``). ``policy.initial_latents(1, generator)`` draws
    one latent (diffusers pipelines draw row ``i`` of a batch with ``generator[i]`` the same
    way)."""
    batch = num_prompts * group_size
    rows = list(range(batch)) if rows is None else [int(r) for r in rows]
    generators = {}

    def generator(b):
        if b not in generators:
            p, m = divmod(b, group_size)
            generators[b] = torch.Generator().manual_seed(sample_seed(seed, p, m))
        return generators[b]

    per_sample = selection.strategy == "dance_grpo" or (
        selection.strategy == "window" and selection.window_per_sample)
    if per_sample:
        selected = torch.cat([select_timesteps(selection, batch=1, num_steps=num_steps,
                                               generator=generator(b)) for b in range(batch)])
    else:
        selected = select_timesteps(selection, batch=batch, num_steps=num_steps,
                                    generator=torch.Generator().manual_seed(
                                        sample_seed(seed, -2, -2)))
    first = None
    latents, noises = {}, {}
    for b in rows:
        if init_same_noise:
            p = b // group_size
            x = policy.initial_latents(1, torch.Generator().manual_seed(
                sample_seed(seed, p, -1)))
        else:
            x = policy.initial_latents(1, generator(b))
        x = x.float()
        latents[b] = x[0]
        # (drawn on the host, as the generators are: the same noise on any device)
        noises[b] = torch.randn((num_steps,) + tuple(x.shape[1:]), generator=generator(b),
                                dtype=torch.float32).to(x.device)
        first = x
    if first is None:  # nothing drawn on this rank: shapes from one throw-away latent
        first = policy.initial_latents(1, torch.Generator().manual_seed(0)).float()
    shape = tuple(first.shape[1:])
    latents0 = torch.zeros((batch,) + shape, dtype=torch.float32, device=first.device)
    noise = torch.zeros((num_steps, batch) + shape, dtype=torch.float32, device=first.device)
    for b in rows:
        latents0[b] = latents[b]
        noise[:, b] = noises[b]
    return SampleDraws(selected=selected, latents0=latents0, noise=noise)
