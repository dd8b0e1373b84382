"""A trained rollout call at run time: ``KeptRollout`` (a part of ``runtime.GraphRuntime``)
runs it and keeps what the step's schedule needs for the update: the forward's saved tensors
(Retain), per-row gradients (Reweight), or nothing (recompute; auto once keeping fits no more
or lost), then indexes the call's rows under its fingerprints for the update's matching
(``keys.py``)."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..capture import RANDOM_FIXES, RandomOpInGraphError
from ..runtime.reuse import storage_bytes, values_digest
from .graphs import numel_per_row, output_shape
from .state import KeptCall, buffer_bytes

__all__ = ["KeptRollout"]


class KeptRollout:
    """The rollout side of ``GraphRuntime``: ``self`` is the runtime (``self.g`` its graphs,
    ``self.step`` the ``LeanStep``)."""

    def _rollout(self, args, train_rows: list[int], grad: bool):
        """A trained rollout call. Under ``torch.inference_mode()`` (or with inference tensors
        among its inputs) it runs with inference mode off, on copies of those inputs: what it
        keeps must be normal tensors, whose version counters show an in-place edit by the
        caller (inference tensors have none); the outputs are normal tensors."""
        if torch.is_inference_mode_enabled() or any(
                isinstance(a, Tensor) and a.is_inference() for a in args):
            with torch.inference_mode(False):
                args = [a.clone() if isinstance(a, Tensor) and a.is_inference() else a
                        for a in args]
                return self._rollout_kept(args, train_rows, grad)
        return self._rollout_kept(args, train_rows, grad)

    def _rollout_kept(self, args, train_rows: list[int], grad: bool):
        state, g = self.step._state, self.g
        start, ready = time.perf_counter(), "forward" in g.compiled  # (a compile: not timed)
        if grad:
            raise ValueError("the rollout's trained calls must run under torch.no_grad() (their "
                             "outputs carry no autograd graph: the update gets the gradients)")
        schedule = state.schedule
        if g.random_ops and schedule != "recompute":
            raise RandomOpInGraphError(
                f"the wrapped step draws random numbers ({', '.join(g.random_ops[:3])}): an "
                "update's forward would not repeat the rollout's, so nothing can be reused. " +
                RANDOM_FIXES)
        if g.sample_grad_outputs and schedule != "recompute":
            j = self.step.config.sample_output
            raise ValueError(
                f"the wrapped step's drawn sample (output {j}, sample_output={j}) carries "
                f"gradient into output(s) {g.sample_grad_outputs}: the rollout's backward "
                "differentiates through the sample, while the update, which passes it back in "
                f"{self.step.config.sample_arg}=, holds it constant, so reusing the rollout "
                "would give other gradients. Detach the drawn sample where the step reads it "
                "(FlowGRPO and DanceGRPO compute the log-prob from prev_sample.detach()), or use "
                "schedule='recompute'")
        batch = self.batch_of(args)
        train_rows = [r for r in train_rows if r < batch]
        state.stats.trained_calls += 1
        mode, why = self._choose(args, batch, train_rows)
        if mode is None:
            state.stats.kept[why] += 1
            return self._plain(args, False)
        forward_start = time.perf_counter()
        with torch.no_grad():
            full = list(g.run_forward(args))
        forward_seconds = time.perf_counter() - forward_start
        outputs, saved = full[:g.num_outputs], full[g.num_outputs:]
        kept = KeptCall(runtime=self, mode=mode, args=args, batch=batch, outputs=outputs,
                     saved=saved if mode == "retain" else None, grads={}, rows=train_rows,
                     versions=self.param_versions(args), symbols=self._symbols(args))
        params = [a for a in args if isinstance(a, Tensor)]
        if mode == "retain":
            kept.nbytes = storage_bytes(saved, exclude=params)
        else:
            kept.saved = saved  # read while the per-row gradients are taken, then dropped
            before = buffer_bytes(state)
            kept.samples = state.current_samples
            self.row_gradients(kept, saved)
            kept.saved = None
            kept.nbytes = sum(t.numel() * t.element_size()
                              for key, grads in kept.grads.items() if isinstance(key, tuple)
                              for t in grads.values() if t is not None) + \
                buffer_bytes(state) - before
        kept.watched = [(t, t._version) for i, t in enumerate(list(args) + outputs)
                        if isinstance(t, Tensor) and i not in self.params]
        trainable = [args[i] for i in self.params if args[i].requires_grad]
        new = [p for p in trainable if id(p) not in state.digest_ids]
        if new:  # (each graph's own: two experts chosen by step are two graphs)
            state.digest_ids.update(id(p) for p in new)
            params, digest = state.digest or ([], None)
            added = values_digest(new)
            state.digest = (params + new, added if digest is None else
                            torch.cat([digest, added.to(digest.device)]))
        keys = self.keys(args, batch, g.fingerprint)
        state.add(kept, keys)
        if g.sample_fingerprint:  # an update passing the drawn sample back matches these keys
            sample_keys = g.sample_fingerprint, g.passthrough_fingerprint
            for fingerprint in filter(None, sample_keys):  # (also one returning it as given)
                state.index_rows(kept, self.keys(args, batch, fingerprint, g.sample_key_inputs))
        ledger = state.ledger
        if mode == "retain" and ready and ledger.note(args):
            ledger.keep_seconds += time.perf_counter() - start
            ledger.forward_seconds += forward_seconds
            ledger.kept_rows += batch
        return self._finish(outputs, args)

    def _choose(self, args, batch, rows) -> tuple[str | None, str]:
        state, g = self.step._state, self.g
        schedule = state.schedule
        if schedule == "recompute":
            return None, "nothing (schedule='recompute')"
        fake_scalar = [j for j in g.differentiable
                       if g.forward is not None and numel_per_row(g, j, batch) == 1]
        if schedule == "reweight":
            if not fake_scalar:
                raise ValueError(
                    "schedule='reweight' keeps one gradient per row of a per-row scalar output "
                    "(a log-prob), and the wrapped function returns none (outputs "
                    f"{[tuple(output_shape(g, j)) for j in range(g.num_outputs)]}, the batch "
                    f"taken as {batch}, the first tensor argument's dim 0): wrap the whole step "
                    "(velocity + SDE + log-prob), pass a batch-major tensor first, or use "
                    "schedule='retain'")
            return "reweight", ""
        if schedule == "retain":
            return "retain", ""
        # auto: retain while the kept activations fit, then reweight, else nothing; nothing
        # once a cycle measured that keeping cost more than it saved (costs.py).
        if state.auto_off:
            return None, state.auto_off
        estimate = g.kept_bytes(batch)
        if state.kept_bytes + estimate <= state.budget:
            return "retain", ""
        grad_bytes = sum(args[i].numel() * args[i].element_size() for i in self.params
                         if args[i].requires_grad)
        if fake_scalar:
            samples = state.current_samples
            new = len(rows) if samples is None else len(
                {samples[r] for r in rows} - {s for s, _ in state.sample_grads})
            buffers = new * len(fake_scalar) * grad_bytes
            if state.buffer_bytes + buffers <= state.budget - state.kept_bytes:
                return "reweight", ""
        return None, (f"nothing (auto: {estimate} more bytes would exceed the memory budget of "
                      f"{state.budget} bytes)")
