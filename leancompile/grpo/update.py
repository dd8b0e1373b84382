"""``PendingUpdate``: a scored rollout waiting for its update (``GRPOTrainer.rollout``).

The rollout loop (``rollout.py``) calls ``sample`` on each prompt group's rows (the step under
``LeanStep.rollout()``: the trained calls keep what the schedule needs) and, with Reweight's
per-group path, ``train`` as soon as the group is scored. ``update(chunk)`` then computes the
gradients: it calls the trained steps again under ``LeanStep.update()`` with the same inputs
(the kept activations or gradient buffers reused when the parameters are still the rollout's;
otherwise recomputed) and backpropagates FlowGRPO's PPO loss (+ KL)::

    ratio = exp(log_prob(x_{k+1} | x_k) - rollout_log_prob)           per trained call
    loss  = sum(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))) / (B * S)  [+ beta * KL]

It talks to its trainer through ``TrainerParts`` (``parts.py``) and the ``GRPOConfig`` the
rollout ran with; its gradients are taken out of ``.grad`` and reduced by a
``GradientCollector`` (``sync.py``), and under ``parallel="fsdp"`` its padding calls are made
on a ``StandIn`` row (``fsdp_padding.py``).
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn as nn
from torch.profiler import record_function

from ..lean import synchronize
from .fsdp_padding import StandIn
from .parts import TrainerParts
from .policy_step import call_args
from .results import GradResult, OffPolicyWarning, Rollout
from .rollout_setup import RolloutSetup
from .sync import GradientCollector

__all__ = ["PendingUpdate", "parameter_versions"]


def parameter_versions(policy: nn.Module) -> dict[str, int]:
    """The trainable parameters' version counters: an in-place change (an optimizer step)
    between rollout and update changes them."""
    return {n: p._version for n, p in policy.named_parameters() if p.requires_grad}


class PendingUpdate:
    """A scored rollout waiting for its update; see ``GRPOTrainer.rollout``."""

    def __init__(self, *, parts: TrainerParts, config, setup: RolloutSetup, versions):
        self.parts = parts
        self.config = config
        """The ``GRPOConfig`` the rollout ran with."""
        self.setup = setup
        self.schedule = setup.schedule
        self.reason = setup.reason
        self.plans = setup.plans
        self.chunk_steps = setup.chunk_steps
        self.versions = versions
        self.rollout: Rollout | None = None
        self.rollout_seconds = 0.0
        self.trained_in_rollout = False
        self.rollout_grads: dict | None = None
        self.gradients = GradientCollector(parts, setup.lean)
        self._rollout_sync = (0, 0)
        self._done: set[int] = set()
        self._mean_refs: dict = {}
        self._kl: list[torch.Tensor] = []
        self._retained = self._buffered = 0
        self._ratio_error: float | None = None
        self._stand_in = StandIn(setup, with_kl=config.beta > 0)

    # -- gradients live in .grad while the trainer computes them ------------------------------
    @property
    def sync(self) -> tuple[int, int]:
        """(collectives, bytes) of the last gradient reduction."""
        return self.gradients.sync

    def stash_grads(self) -> None:
        """Set the user's ``.grad`` aside (``restore_grads`` puts it back)."""
        self.gradients.stash()

    def restore_grads(self) -> None:
        self.gradients.restore()

    def collect(self, *, deferred: bool = False) -> dict[str, torch.Tensor]:
        """The trainable parameters' gradients, reduced (``GradientCollector.collect``)."""
        return self.gradients.collect(deferred=deferred)

    def reduce_round(self) -> None:
        """Reduce the round of prompt groups just trained (``GradientCollector``)."""
        self.gradients.reduce_round()

    def take_rounds(self) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """The summed gradients of every ``reduce_round`` and their (collectives, bytes)."""
        return self.gradients.take_rounds()

    def keep_rollout_grads(self) -> None:
        """Reweight trained every prompt group during the rollout: their gradients, reduced
        (per round of prompt groups, or now), are the first update's."""
        if self.setup.sync_rounds:
            self.rollout_grads, self._rollout_sync = self.take_rounds()
        else:
            self.rollout_grads = self.collect(deferred=True)
            self._rollout_sync = self.gradients.sync

    # -- rollout and update loops ------------------------------------------------------------
    def sample(self, rows: torch.Tensor, padding: list | None = None):
        """Denoise the samples ``rows`` through all steps under ``rollout()``: calls of the
        selected rows are trained (named by their sample), the others are not. ``padding``
        (fsdp): per step, the (untrained, trained) calls every rank makes; those this rank
        has no rows for are made on the stand-in row (untrained under Reweight, whose
        trained calls gather as untrained ones do and reduce nothing)."""
        st, cfg = self.setup, self.config
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
                halves = [(~sel).nonzero().flatten(), sel.nonzero().flatten()] if split else \
                    [torch.arange(rows.numel())]
                for local, trained in zip(halves, (False, True)):
                    if local.numel() == 0:
                        if padding is not None and padding[k][int(trained)]:
                            kept = trained and st.schedule == "retain"
                            flags.append(kept)
                            samples.append(torch.tensor([st.batch]))  # no sample of the batch
                            self._stand_in.rollout_call(k, kept)
                        continue
                    trained = trained and split
                    local_at = local.to(device, non_blocking=True)
                    args = call_args(x, k, cond_rows, local_at, with_kl=cfg.beta > 0)
                    noise = noise_rows[k][local_at]
                    if trained and cfg.beta > 0:
                        args[-1] = self.parts.reference.mean(args, st.keys, noise, sde=cfg.sde,
                                                             eta=cfg.eta)
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
        st, cfg = self.setup, self.config
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
                        self._stand_in.update_call(k)
                    continue
                glob, local_at = rows[local], local.to(device, non_blocking=True)
                glob_at = rows_at[local_at]
                args = call_args(trajectory[rows_at, k], k, cond_rows, local_at,
                                 with_kl=cfg.beta > 0)
                if cfg.beta > 0:
                    key = (k, tuple(glob.tolist()))
                    args[-1] = self._mean_refs[key] if key in self._mean_refs else \
                        self.parts.reference.mean(args, st.keys, st.noise[k][glob_at],
                                                  sde=cfg.sde, eta=cfg.eta)
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
        with self.parts.parallel.graph_collectives():
            return self._update(chunk)

    def _update(self, chunk: int) -> GradResult:
        if chunk in self._done:
            raise ValueError(f"chunk {chunk} of this rollout was already updated")
        if not 0 <= chunk < len(self.chunk_steps):
            raise ValueError(f"chunk={chunk}; this rollout has {len(self.chunk_steps)} chunks")
        earlier = bool(self._done)
        self._done.add(chunk)
        parts, record = self.parts, self.rollout
        start = time.perf_counter()
        stale = parameter_versions(parts.policy) != self.versions
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
                sync = self._rollout_sync
            else:
                if not reusable:
                    self._kl.clear()
                    self._ratio_error = None
                    lean.discard_kept()
                self.train(rows, record.advantages, record.latents, record.log_probs,
                           chunk=chunk, on_policy=reusable)
                grads = self.collect(deferred=self.schedule == "reweight" and reusable)
                sync = self.gradients.sync
        finally:
            self.restore_grads()
        reused = lean.stats.reused_calls > before or (
            self.trained_in_rollout and chunk == 0 and not stale)
        par = parts.parallel
        if par.distributed:  # a rank without rows reused nothing, but its peers did
            reused = par.all_max(float(reused)) > 0
        used = self.schedule if reused and self.schedule != "recompute" else "recompute"
        kl_sum = float(torch.cat(self._kl).sum()) if self._kl else 0.0
        kl_count = sum(k.numel() for k in self._kl)
        if self.config.beta > 0:
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
                          sync_collectives=sync[0], sync_bytes=sync[1])
