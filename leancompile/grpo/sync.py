"""When and how the trainer reduces its gradients over the ranks.

Data-parallel Recompute and Retain reduce once per update (under ``fsdp``: the step's backward
graphs reduce-scatter in every backward). Reweight trains each prompt group as soon as it is
scored (``per_group``) and, with ``GRPOConfig.grad_sync="group"`` (``group_sync``), reduces
after every round of prompt groups (``sync_rounds``: the most prompt groups any rank has, so
every rank reduces as often). ``sync_plan`` predicts the reductions one update issues (what
``explain`` reports); ``GradientCollector`` takes the gradients out of ``.grad`` and reduces
them, counting what it sent (``GradResult.sync_collectives`` / ``sync_bytes``).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..passes.result import format_bytes
from .graph_comms import backward_reductions
from .layout import assign
from .parts import TrainerParts

__all__ = ["per_group", "group_sync", "sync_rounds", "sync_plan", "GradientCollector"]


def per_group(config, schedule: str, layout: str) -> bool:
    """Reweight trains each prompt group in the rollout as soon as it is scored, unless its
    advantages wait for the whole batch (global std; groups scattered over the ranks)."""
    return schedule == "reweight" and not config.global_std and layout != "scattered"


def group_sync(config, sharded: bool) -> bool:
    """``GRPOConfig.grad_sync`` resolved: reduce per round of prompt groups?"""
    mode = config.grad_sync
    return mode == "group" or (mode == "auto" and sharded)


def sync_rounds(config, parallel, schedule: str, layout: str, *, sharded: bool,
                num_prompts: int, seed: int) -> int:
    """Reweight with per-group sync: the rounds of prompt groups it reduces after (the
    most units any rank has: every rank reduces after every round, in the same order, a
    rank with fewer prompt groups adding zeros); 0 otherwise (one reduction per update)."""
    par = parallel
    if not (par.distributed and per_group(config, schedule, layout)
            and group_sync(config, sharded)):
        return 0
    return max(len(assign(layout, num_prompts=num_prompts, group_size=config.group_size,
                          world_size=par.world_size, rank=r, seed=seed))
               for r in range(par.world_size))


def sync_plan(parts: TrainerParts, config, st, graph) -> tuple[dict[str, tuple[int, int]], str]:
    """Per schedule, the gradient reductions one update will issue on this rank and their
    bytes (what ``GradResult.sync_collectives`` / ``sync_bytes`` then count), with a line
    saying where they come from; ({}, "") in one process. ``st``: the rollout's
    ``RolloutSetup``; ``graph``: the step's graph."""
    if not parts.ranks.distributed:
        return {}, ""
    par, sharding = parts.parallel, parts.sharding
    # Without sharding: one all-reduce per group of the mesh (data, sequence parallel).
    groups = len(parts.ranks.groups)
    params = dict(parts.policy.named_parameters())
    grads = [params[n] for n in parts.trainable]
    buckets = len({(p.dtype, p.device) for p in grads})
    rounds = sync_rounds(config, par, "reweight", st.layout, sharded=sharding is not None,
                         num_prompts=st.num_prompts, seed=st.seed)
    trained_steps = int(st.mask.any(0).sum())
    if sharding is not None:
        # Recompute and Retain: the backward graph's own reductions, once per trained
        # step; Reweight: every (padded) full gradient per round (or update).
        count, nbytes = backward_reductions(graph)
        full = sum(sharding.rows[n] * par.world_size * p[0].numel() * p.element_size()
                   for n, p in zip(parts.trainable, grads))
        total = sum(p.numel() * p.element_size() for p in grads)
        # and a sequence-parallel group sums the reduced parts
        summed = (buckets, total) if groups > 1 else (0, 0)
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
    cfg = config
    kinds = [f"{'fsdp' if sharding is not None else 'ddp'} over {par.world_size} "
             "ranks"] if par.distributed else []
    sequence = parts.sequence_sync
    if sequence is not None and sequence.distributed:
        kinds.append(f"the sequence-parallel group's sum over {sequence.world_size} ranks")
    why = [" and ".join(kinds)]
    if sharding is not None:
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


class GradientCollector:
    """The gradients of one rollout's updates: they live in ``.grad`` while the step computes
    them (the user's ``.grad`` set aside meanwhile), then are taken out and reduced over the
    ranks. ``lean``: the rollout's ``LeanStep`` (under fsdp it holds Reweight's unreduced
    gradients back, and its backward graphs reduce-scatter)."""

    def __init__(self, parts: TrainerParts, lean):
        self.parts = parts
        self.lean = lean
        self.sync = (0, 0)
        """(collectives, bytes) of the last ``collect``'s reductions."""
        self._stash: dict = {}
        self._rounds: tuple | None = None
        self._backwards_counted = 0

    def stash(self) -> None:
        """Set the user's ``.grad`` aside (``restore`` puts it back)."""
        self._stash = {n: p.grad for n, p in self.parts.policy.named_parameters()}
        for p in self.parts.policy.parameters():
            p.grad = None

    def restore(self) -> None:
        for name, p in self.parts.policy.named_parameters():
            p.grad = self._stash.get(name)

    def collect(self, *, deferred: bool = False) -> dict[str, torch.Tensor]:
        """The trainable parameters' ``.grad`` (taken out), summed over the ranks when data
        parallel: the update's one gradient reduction. ``deferred``: the update ran
        Reweight's path, whose gradients wait in the step for one reduce-scatter under fsdp
        (the same on every rank: it decides whether this rank joins that collective)."""
        parts = self.parts
        params = dict(parts.policy.named_parameters())
        grads = {}
        for name in parts.trainable:
            p = params[name]
            grads[name] = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            p.grad = None
        with record_function("leancompile.sync"):
            sync = (0, 0)
            if parts.sharding is not None:  # the parts, reduced over data parallel
                sync = self._fsdp_reductions(grads, deferred=deferred)
            # ddp's all-reduce (fsdp: none), then the sequence-parallel group's sum
            more = parts.ranks.sync_gradients(grads)
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
        parts = self.parts
        par, lean, sharding = parts.parallel, self.lean, parts.sharding
        count, nbytes = par.sync_collectives, par.sync_bytes
        names = {id(p): n for n, p in parts.policy.named_parameters()}
        taken = {names[id(p)]: g for p, g in lean.take_deferred_grads()}
        if not deferred and taken:
            raise RuntimeError(f"gradients of {sorted(taken)[:4]} were held back for a "
                               "reduction outside Reweight's path (a bug in the trainer)")
        params = dict(parts.policy.named_parameters())
        held = {} if not deferred else {
            n: taken[n] if n in taken else params[n].new_zeros(
                (sharding.rows[n] * par.world_size,) + tuple(sharding.shapes[n][1:]))
            for n in parts.trainable if n in sharding.shapes}
        for name, part in par.reduce_scatter_grads(held).items():
            grads[name] += part
        in_graph, in_graph_bytes = self._in_graph_reductions()
        return (par.sync_collectives - count + in_graph,
                par.sync_bytes - nbytes + in_graph_bytes)

    def _in_graph_reductions(self) -> tuple[int, int]:
        """``parallel="fsdp"``: the gradient reduce-scatters the step's backward graphs ran
        since the last count (the rollout's start, or the previous chunk's update; each update
        call runs one backward), and their bytes."""
        lean = self.lean
        graph = next((g for g in lean.graphs if g.backward_aten is not None), None)
        count, nbytes = (0, 0) if graph is None else backward_reductions(graph)
        calls = lean.stats.backward_graphs_run - self._backwards_counted
        self._backwards_counted = lean.stats.backward_graphs_run
        return count * calls, nbytes * calls
