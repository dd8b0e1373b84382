"""Execute a LeanGRPO ``SchedulePlan`` with the captured step graphs.

``ScheduleRunner`` holds one rollout's state: the trajectory, the rollout log-probs, and either
the kept activations (Retain), the per-sample gradient buffers (Reweight) or nothing
(Recompute). Which graph runs where comes from the plan's ops; the gradient lands in
``runner.grads`` (one tensor per trainable parameter, rank-local: a ``sync`` op is where a
distributed all-reduce goes, a no-op in one process).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..passes.lean_grpo import SchedulePlan
from .graphs_cache import CompiledStep, StepGraphCache
from .sde import kl_to_reference

__all__ = ["ScheduleRunner", "RetainedEntry", "measure_bytes"]

log = logging.getLogger("leancompile")


def measure_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out storages shared with any
    tensor in ``exclude`` (the inputs the caller holds anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude if isinstance(t, torch.Tensor)}
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(kw_only=True)
class RetainedEntry:
    """Saved tensors of one forward call at a selected step, kept until the advantages."""

    step: int
    rows: torch.Tensor
    saved: tuple
    graph: CompiledStep
    kl_cotangent: torch.Tensor | None
    nbytes: int


@dataclass(kw_only=True)
class _Counts:
    forward_infer: int = 0
    forward_save: int = 0
    backward: int = 0
    syncs: int = 0


class ScheduleRunner:
    """Runs one rollout and its update under ``plan`` (see ``leancompile.passes.lean_grpo``).

    ``sample_module``/``score_module`` are ``PolicyStep`` modules (sample and score mode) of
    the same policy; ``module_inputs`` their parameters and buffers in capture order;
    ``ref_inputs`` the same list with the reference model's weights (KL), or None.
    ``trainable`` are the primal indices whose gradients are wanted; ``norm`` is ``B*|S|``.
    """

    def __init__(self, *, plan: SchedulePlan, graphs: StepGraphCache, sample_module,
                 score_module, module_inputs: list, ref_inputs: list | None,
                 trainable: list[int], beta: float, clip_range: float, norm: float,
                 partitioner_budget: float | None = None, allow_random: bool = False):
        self.plan = plan
        self.graphs = graphs
        self.sample_module = sample_module
        self.score_module = score_module
        self.module_inputs = module_inputs
        self.ref_inputs = ref_inputs
        self.trainable = trainable
        self.beta = beta
        self.clip_range = clip_range
        self.norm = float(norm)
        self.partitioner_budget = partitioner_budget
        self.allow_random = allow_random
        self.grads: list[torch.Tensor | None] = [None] * len(trainable)
        self.retained: list[RetainedEntry] = []
        self.retained_bytes = 0
        self.peak_retained_bytes = 0
        self.buffers: dict[int, list[torch.Tensor | None]] = {}
        self.kl_buffer: list[torch.Tensor | None] = [None] * len(trainable)
        self.peak_buffer_bytes = 0
        self.kl_values: list[torch.Tensor] = []
        self.counts = _Counts()

    # -- plan lookups -------------------------------------------------------------------
    def _has(self, phase: str, op: str, applies_to: str | None = None) -> bool:
        return any(o.phase == phase and o.op == op and (applies_to is None or
                                                        o.applies_to == applies_to)
                   for o in self.plan.ops)

    @property
    def name(self) -> str:
        return self.plan.name

    # -- graph calls ----------------------------------------------------------------------
    def _graph(self, module, args, mode: str) -> CompiledStep:
        budget = self.partitioner_budget if mode == "sample" else None
        return self.graphs.get(module, args, key=mode, memory_budget=budget,
                               allow_random=self.allow_random)

    def _accumulate(self, target: list, grads, scale: torch.Tensor | float | None = None):
        for j, index in enumerate(self.trainable):
            g = grads[index]
            if g is None:
                continue
            if scale is not None:
                g = g * scale
            target[j] = g if target[j] is None else target[j] + g

    def _kl_cotangent(self, mean, mean_ref, kl_std, rows_weight):
        """d(beta * sum_rows w_row * KL_row)/d mean, and the KL values (eager, small)."""
        with torch.enable_grad():
            m = mean.detach().requires_grad_(True)
            kl = kl_to_reference(m, mean_ref, kl_std)
            (cot,) = torch.autograd.grad((kl * rows_weight).sum() * self.beta, m)
        return cot, kl.detach()

    # -- rollout ----------------------------------------------------------------------------
    def rollout(self, *, latents: torch.Tensor, noise: torch.Tensor, conditions: list,
                selected: torch.Tensor, rows: torch.Tensor):
        """Denoise ``latents`` (``[b, ...]``) through all steps; ``noise`` is ``[T, b, ...]``,
        ``selected`` a bool mask ``[b, T]``, ``rows`` the global sample index of each row.
        Returns (trajectory ``[b, T+1, ...]``, log-probs ``[b, T]``)."""
        num_steps = noise.shape[0]
        x = latents.float()
        trajectory = [x]
        log_probs = torch.zeros(x.shape[0], num_steps)
        save_selected = self._has("rollout", "forward_save", "selected")
        backward_now = self._has("rollout", "backward_now", "selected")
        with torch.no_grad():
            for k in range(num_steps):
                x_next = torch.empty_like(x)
                sel = selected[:, k]
                groups = [(~sel).nonzero().flatten(), sel.nonzero().flatten()] \
                    if save_selected else [torch.arange(x.shape[0])]
                for local, is_selected in zip(groups, (False, True)):
                    if local.numel() == 0:
                        continue
                    if save_selected and is_selected and backward_now:
                        # Reweight: one sample per call, so each G_i is its own gradient.
                        for i in local.tolist():
                            one = torch.tensor([i])
                            out, lp = self._selected_call(k, one, x, noise[k], conditions, rows,
                                                          keep=False)
                            x_next[one], log_probs[one, k] = out, lp
                        continue
                    if save_selected and is_selected:
                        out, lp = self._selected_call(k, local, x, noise[k], conditions, rows,
                                                      keep=True)
                    else:
                        out, lp = self._inference_call(k, local, x, noise[k], conditions)
                    x_next[local], log_probs[local, k] = out, lp
                x = x_next
                trajectory.append(x)
        return torch.stack(trajectory, dim=1), log_probs

    def _args(self, k, local, x, third, conditions):
        step = torch.full((local.numel(),), k, dtype=torch.long)
        return [x[local], step, third[local]] + [c[local] for c in conditions]

    def _inference_call(self, k, local, x, noise_k, conditions):
        args = self._args(k, local, x, noise_k, conditions)
        graph = self._graph(self.sample_module, args, "sample")
        outs = graph.run_inference(self.module_inputs, args)
        self.counts.forward_infer += 1
        return outs[0], outs[1]

    def _reference_mean(self, module, args, mode):
        graph = self._graph(module, args, mode)
        outs = graph.run_inference(self.ref_inputs, args)
        return outs[-2]

    def _selected_call(self, k, local, x, noise_k, conditions, rows, *, keep: bool):
        args = self._args(k, local, x, noise_k, conditions)
        graph = self._graph(self.sample_module, args, "sample")
        outs, saved = graph.run_forward(self.module_inputs, args)
        self.counts.forward_save += 1
        x_next, log_prob = outs[0], outs[1]
        kl_cot = None
        if self.beta > 0:
            mean, kl_std = outs[2], outs[3]
            mean_ref = self._reference_mean(self.sample_module, args, "sample")
            weight = torch.full((local.numel(),), 1.0 / self.norm)
            kl_cot, kl = self._kl_cotangent(mean, mean_ref, kl_std, weight)
            self.kl_values.append(kl)
        if keep:
            nbytes = measure_bytes(saved, exclude=list(self.module_inputs) + args)
            self.retained.append(RetainedEntry(step=k, rows=rows[local], saved=saved,
                                               graph=graph, kl_cotangent=kl_cot, nbytes=nbytes))
            self.retained_bytes += nbytes
            self.peak_retained_bytes = max(self.peak_retained_bytes, self.retained_bytes)
        else:
            sample = int(rows[local][0])
            buffer = self.buffers.setdefault(sample, [None] * len(self.trainable))
            cot_logp = torch.full((local.numel(),), -1.0 / self.norm)
            n_extra = len(graph.captured.differentiable_outputs) - 1
            zeros_mean = [torch.zeros_like(outs[2])] if n_extra else []
            self._accumulate(buffer, graph.run_backward(saved, [cot_logp] + zeros_mean))
            self.counts.backward += 1
            if kl_cot is not None:
                self._accumulate(self.kl_buffer, graph.run_backward(
                    saved, [torch.zeros_like(cot_logp), kl_cot]))
                self.counts.backward += 1
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._buffer_bytes())
        return x_next, log_prob

    def _buffer_bytes(self) -> int:
        tensors = [g for buf in self.buffers.values() for g in buf if g is not None]
        tensors += [g for g in self.kl_buffer if g is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- update -----------------------------------------------------------------------------
    def backward_retained(self, advantages: torch.Tensor) -> None:
        """Retain: backward of every kept step with cotangent ``-A_i/(B*|S|)``."""
        for entry in self.retained:
            cot = -advantages[entry.rows].float() / self.norm
            extra = [entry.kl_cotangent] if entry.kl_cotangent is not None else []
            self._accumulate(self.grads, entry.graph.run_backward(entry.saved, [cot] + extra))
            self.counts.backward += 1
        self.retained.clear()
        self.retained_bytes = 0

    def scale_buffers(self, advantages: torch.Tensor, samples=None) -> None:
        """Reweight: ``grad += A_i * G_i`` for ``samples`` (all buffered ones by default); the
        buffers are freed."""
        samples = list(self.buffers) if samples is None else [int(s) for s in samples]
        for sample in samples:
            buffer = self.buffers.pop(sample, None)
            if buffer is None:
                continue
            a = advantages[sample].float()
            for j, g in enumerate(buffer):
                if g is not None:
                    self.grads[j] = g * a if self.grads[j] is None else self.grads[j] + g * a

    def finish_kl(self) -> None:
        for j, g in enumerate(self.kl_buffer):
            if g is not None:
                self.grads[j] = g if self.grads[j] is None else self.grads[j] + g
        self.kl_buffer = [None] * len(self.trainable)

    def recompute(self, *, trajectory, old_log_probs, selected_steps, conditions, advantages,
                  rows) -> None:
        """Recompute: forward (score mode, with grad) at every selected step, PPO-clipped
        loss, backward. ``selected_steps`` is ``[b, S]``; all rows of a call share a step."""
        num_steps = old_log_probs.shape[1]
        mask = torch.zeros(trajectory.shape[0], num_steps, dtype=torch.bool)
        mask.scatter_(1, selected_steps, True)
        for k in range(num_steps):
            local = mask[:, k].nonzero().flatten()
            if local.numel() == 0:
                continue
            x, x_next = trajectory[:, k], trajectory[:, k + 1]
            args = self._args(k, local, x, x_next, conditions)
            graph = self._graph(self.score_module, args, "score")
            outs, saved = graph.run_forward(self.module_inputs, args)
            self.counts.forward_save += 1
            log_prob = outs[0].detach().requires_grad_(True)
            ratio = torch.exp(log_prob - old_log_probs[local, k])
            adv = advantages[rows[local]].float()
            unclipped = -adv * ratio
            clipped = -adv * torch.clamp(ratio, 1.0 - self.clip_range, 1.0 + self.clip_range)
            loss = torch.maximum(unclipped, clipped).sum() / self.norm
            (cot,) = torch.autograd.grad(loss, log_prob)
            cotangents = [cot]
            if len(graph.captured.differentiable_outputs) > 1:
                mean, kl_std = outs[1], outs[2]
                mean_ref = self._reference_mean(self.score_module, args, "score")
                weight = torch.full((local.numel(),), 1.0 / self.norm)
                kl_cot, kl = self._kl_cotangent(mean, mean_ref, kl_std, weight)
                self.kl_values.append(kl)
                cotangents.append(kl_cot)
            self._accumulate(self.grads, graph.run_backward(saved, cotangents))
            self.counts.backward += 1

    def sync(self) -> None:
        """Where a data-parallel all-reduce of ``grads`` goes; one process: nothing to do."""
        self.counts.syncs += 1
