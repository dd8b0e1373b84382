"""``parallel="fsdp"``: every rank makes the same step calls, in the same order.

The step gathers the parameters inside every call and reduce-scatters their gradients inside
every backward, so a rank that skips a call leaves its peers waiting in a collective. Rows are
spread unevenly (a rank without rows, a worker group with fewer prompts, DanceGRPO's
per-sample trained steps), so the ranks agree on the union of their calls (``fsdp_padding``),
which every rank computes alike from the layout and the mask; ``check_fsdp_calls`` compares it
across the ranks before the rollout. A rank without rows for a call makes it on a stand-in row
(``StandIn``) whose loss is multiplied by zero: its gradient adds exactly nothing::

    rank 0 (rows at step k)         rank 1 (no row at step k)
        lean(x[rows], k, ...)           lean(stand_in, k, ...)         # same gathers
        loss.backward()                 (loss * 0.0).backward()        # same reduce-scatters
"""

from __future__ import annotations

import torch

from .graph_comms import gather_order
from .layout import assign
from .policy_step import call_args

__all__ = ["fsdp_padding", "check_fsdp_calls", "StandIn"]


def fsdp_padding(layout: str, *, group_size: int, world_size: int, num_prompts: int,
                 seed: int, mask, schedule: str, per_group: bool) -> list:
    """Per unit index (every rank's longest list of units), per denoising step, the
    (untrained, trained) calls every rank makes: an untrained call when any rank has an
    untrained row there, a trained call when any rank has a trained row (Recompute: one call
    when any rank has rows). ``per_group``: the rollout trains each prompt group as it is
    scored (``sync.per_group``); ``mask``: ``[B, T]`` the trained calls."""
    if per_group:
        every = [assign(layout, num_prompts=num_prompts, group_size=group_size,
                        world_size=world_size, rank=r, seed=seed)
                 for r in range(world_size)]
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


def check_fsdp_calls(graph, padding, chunk_steps, schedule: str, parallel) -> None:
    """The step's forward and inference graphs (``graph``) must issue the same collectives in
    one order (a rank's untrained call pairs with another's trained one), and the ranks'
    padded calls must agree (they do by construction; compared across the ranks of
    ``parallel`` all the same, before the rollout, as a cheap guard against a rank drawing
    something else)."""
    orders = {name: gather_order(gm, graph.report, name)
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
    parallel.check_same(
        "the step calls under parallel='fsdp'", f"{schedule} {calls} {later}",
        fix="parallel='fsdp' runs the parameter all-gathers inside every step call and the "
            "gradient reduce-scatters inside every backward, so every rank must draw the "
            "same batch: pass the same conditions and generator seed on every rank")


class StandIn:
    """The stand-in row of one rollout (``st``: its ``RolloutSetup``): latents and SDE noise
    from a generator of its own (the global random state is not touched) and the batch's first
    conditions; its calls' values are finite and never used."""

    def __init__(self, st, *, with_kl: bool):
        self.setup = st
        self.with_kl = with_kl
        self._row = None
        self._kept: dict = {}

    def _stand_in(self):
        if self._row is None:
            st = self.setup
            g = torch.Generator().manual_seed(0)
            shape = (1,) + tuple(st.latents0.shape[1:])
            x = torch.randn(shape, generator=g).to(st.latents0)
            noise = torch.randn((st.noise.shape[0],) + shape, generator=g).to(st.noise)
            self._row = (x, [c[:1] for c in st.cond_list], noise)
        return self._row

    def rollout_call(self, k: int, trained: bool) -> None:
        """One padding call of the rollout at step ``k`` (under ``rollout()``); Retain's
        trained ones are kept for the update's padding call (``update_call``)."""
        x, cond, noise = self._stand_in()
        args = call_args(x, k, cond, torch.arange(1), with_kl=self.with_kl)
        out = self.setup.lean(*args, noise=noise[k])
        if trained:
            self._kept[k] = (args, out[0])

    def update_call(self, k: int) -> None:
        """The update's padding call at step ``k`` (under ``update()``): the kept stand-in
        call reused (Retain) or recomputed, its loss times zero, backpropagated (the backward
        graph's reduce-scatters run with a zero contribution from this rank)."""
        if k in self._kept:
            args, prev = self._kept[k]
        else:
            x, cond, _ = self._stand_in()
            args, prev = call_args(x, k, cond, torch.arange(1), with_kl=self.with_kl), x
        out = self.setup.lean(*args, prev_sample=prev)
        loss = out[1].sum() * 0.0
        if self.with_kl:
            loss = loss + out[2].sum() * 0.0
        loss.backward()
