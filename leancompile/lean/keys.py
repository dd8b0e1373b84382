"""How an update call finds the kept rollout rows it repeats: one key per row (what the
computation is, a structural hash of the graph, and what its inputs hold for that row, row
fingerprints), then each candidate confirmed value by value. ``Keys`` is a part of
``GraphRuntime`` (``runtime.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..capture.step_graphs import without_sample
from ..runtime.reuse import row_hashes, values_digest, whole_hash
from .graphs import readable
from .state import KeptCall

__all__ = ["Keys"]


class Keys:
    """Row keys and matching (``GraphRuntime`` methods)."""

    def keys(self, args, batch: int, fingerprint, inputs=None) -> list:
        """One key per row: what the computation is and what its inputs hold for that row."""
        parts = []
        for i in (self.g.key_inputs if inputs is None else inputs):
            if i == self.sample_input or i in self.batch_symint:
                continue
            role, value = self.g.roles[i], args[i]
            if self.rows_of_input(i):
                parts.append((role.source, row_hashes(value, batch)))
            elif isinstance(value, Tensor):
                parts.append((role.source, [whole_hash(value)] * batch))
            else:
                parts.append((role.source, [value] * batch))
        parts.sort(key=lambda p: p[0])
        return [hash((fingerprint, tuple((source, h[r]) for source, h in parts)))
                for r in range(batch)]

    def _same_row(self, args, row, kept: KeptCall, kept_row) -> bool:
        """Confirm a fingerprint match value by value."""
        kroles = {r.source: i for i, r in enumerate(kept.runtime.g.roles)}
        for i in self.g.key_inputs:
            if i == self.sample_input or i in self.batch_symint:
                continue
            role = self.g.roles[i]
            k = kroles.get(role.source)
            if k is None:
                return False
            mine, theirs = args[i], kept.args[k]
            if self.rows_of_input(i):
                n = self.rows_of_input(i)
                if not torch.equal(mine[row * n:(row + 1) * n],
                                   theirs[kept_row * n:(kept_row + 1) * n]):
                    return False
            elif isinstance(mine, Tensor):
                if not (isinstance(theirs, Tensor) and mine.shape == theirs.shape
                        and mine.dtype == theirs.dtype and torch.equal(mine, theirs)):
                    return False
            elif mine != theirs:
                return False
        if self.sample_input is not None:
            j = kept.runtime.step.config.sample_output
            sample = kept.outputs[j]
            mine = args[self.sample_input]
            rows = mine.shape[0] // self.batch_of(args)
            if not torch.equal(mine[row * rows:(row + 1) * rows],
                               sample[kept_row * rows:(kept_row + 1) * rows]):
                return False
        return True

    def match_kept(self, args):
        """(per row of this update call, the kept call and row that serve it; "") or (None,
        why the kept calls cannot serve it)."""
        state, g = self.step._state, self.g
        if not state.kept:
            return None, state.stale or "nothing kept (not a trained rollout call, or already " \
                "freed)"
        if any(isinstance(a, Tensor) and a.requires_grad for i, a in enumerate(args)
               if g.roles[i].kind != "param"):
            return None, "an input of the update call requires grad"
        versions = self.param_versions(args)
        if state.digest is not None and not torch.equal(values_digest(state.digest[0]),
                                                        state.digest[1]):
            counted = any(k.versions.get(s, v) != v for k in state.kept
                          for s, v in versions.items())
            state.clear()
            state.stale = "the parameters changed since the rollout (" + (
                "an optimizer step, or an in-place change" if counted else
                "their values, not their version counters: written through .data outside an "
                "optimizer") + "): kept state is stale"
            return None, state.stale
        batch = self.batch_of(args)
        fingerprint = self._fingerprint_for(args, batch)
        keys = self.keys(args, batch, fingerprint)
        assignment = []
        fresh: dict[int, bool] = {}  # id(kept call) -> its parameters unchanged (_stale)
        for row, key in enumerate(keys):
            candidates = state.index.get(key, [])
            if not candidates:
                return None, self._why_not(fingerprint, row)
            # Rows not yet used first, by this call either (two samples with equal rows, as
            # DanceGRPO's shared initial noise makes at its first step, each get their own);
            # the first that is fresh, unedited and equal value by value serves.
            taken = {(id(k), r) for k, r in assignment}
            ordered = sorted(candidates,
                             key=lambda c: ((id(c[0]), c[1]) in taken, c[1] in c[0].used))
            found, stale, edited = None, 0, 0
            for c in ordered:
                if self._stale(c[0], versions, fresh):
                    stale += 1
                elif c[0].changed():
                    edited += 1
                elif self._same_row(args, row, *c):
                    found = c
                    break
            if found is None and stale == len(candidates):
                state.clear()
                return None, ("the parameters changed since the rollout (an optimizer step, an "
                              "in-place change, or requires_grad set or cleared): kept state is "
                              "stale")
            if found is None and edited and stale + edited == len(candidates):
                return None, ("an output or input of the kept rollout call was changed in place "
                              "after the rollout (what it kept may be views of them): clone "
                              "before editing, e.g. v = v * dt instead of v.mul_(dt)")
            if found is None:
                return None, f"row {row}: inputs not seen in the rollout (fingerprint collision)"
            assignment.append(found)
        return assignment, ""

    @staticmethod
    def _stale(kept: KeptCall, versions: dict, fresh: dict) -> bool:
        """Whether a parameter ``kept`` read has changed since (``versions``: this call's, per
        parameter source); worked out once per kept call and update call (``fresh``), the
        dicts compared whole first (hundreds of parameters, the same rows of a few calls)."""
        ok = fresh.get(id(kept))
        if ok is None:
            theirs = kept.versions
            ok = theirs == versions or not any(
                s in theirs and theirs[s] != v for s, v in versions.items())
            fresh[id(kept)] = ok
        return not ok

    def _fingerprint_for(self, args, batch: int):
        """This graph's fingerprint; for a graph Dynamo specialised to a batch of 1, the
        fingerprint of the kept graph (with a symbolic batch) that computes the same at 1."""
        g, state = self.g, self.step._state
        if g.batch_symbol is not None or batch != 1:
            return g.fingerprint
        for kept in state.kept:
            runtime = kept.runtime
            if g.fingerprint in (runtime.g.fingerprint, runtime.g.sample_fingerprint,
                                 runtime.g.passthrough_fingerprint):
                self.rows_like = {r.source: r.batch_rows for r in runtime.g.roles
                                  if r.batch_rows}
                return g.fingerprint
        for kept in state.kept:
            runtime = kept.runtime
            if runtime.g.batch_symbol is None:
                continue
            full, sample = runtime.fingerprints_at_one(kept)
            passthrough = without_sample(sample, runtime.g.sample_output)
            if g.fingerprint in (full, sample, passthrough or None):
                self.rows_like = {r.source: r.batch_rows for r in runtime.g.roles
                                  if r.batch_rows}
                return runtime.g.fingerprint if g.fingerprint == full else \
                    runtime.g.sample_fingerprint if g.fingerprint == sample else \
                    runtime.g.passthrough_fingerprint
        return g.fingerprint

    def fingerprints_at_one(self, kept: KeptCall) -> tuple[tuple, tuple]:
        """(fingerprint, sample fingerprint) of this graph traced at a batch of 1, on the
        first row of ``kept`` (one of its calls); traced once (``at_one``)."""
        if self.at_one is None:
            self.at_one = self.g.fingerprints_at(self._one_row(kept))
        return self.at_one

    def _one_row(self, kept: KeptCall) -> list:
        """``kept``'s inputs cut to its first row (sizes of the batch set to 1)."""
        args = []
        for i, (role, value) in enumerate(zip(self.g.roles, kept.args)):
            if role.batch_rows:
                args.append(value[:role.batch_rows])
            elif i in self.batch_symint:
                args.append(1)
            else:
                args.append(value)
        return args

    def _why_not(self, fingerprint, row) -> str:
        """Why row ``row`` found no kept row: another graph, or inputs not seen. ``fingerprint``
        is what the keys used (for a graph specialised to a batch of 1, the fingerprint of the
        kept graph that computes the same at 1: ``_fingerprint_for``)."""
        state = self.step._state
        same_graph = [k for k in state.kept if fingerprint in (
            k.runtime.g.fingerprint, k.runtime.g.sample_fingerprint or None,
            k.runtime.g.passthrough_fingerprint or None)]
        if not same_graph:
            return ("no kept rollout call computes the same function (another graph: a changed "
                    "module state such as a disabled adapter, training mode, autocast, a hook added "
                    "or removed, or other "
                    "argument types)" + self._sample_hint())
        return f"row {row}: inputs not seen in the rollout"

    def _sample_hint(self) -> str:
        """Where the update's call takes a tensor argument no kept call took, and the kept
        ones one it does not (``prev_sample=`` where the rollout passed ``noise=``), and no
        sample is configured: how to name the sample."""
        if self.step.config.sample_arg is not None:
            return ""
        def keywords(roles):  # (a sample_arg is a keyword argument)
            names = {readable(r.source) for r in roles if r.kind == "tensor"}
            return {n for n in names if n.isidentifier()}

        mine = keywords(self.g.roles)
        theirs = set().union(*[keywords(k.runtime.g.roles) for k in self.step._state.kept])
        new, gone = sorted(mine - theirs), sorted(theirs - mine)
        if len(new) != 1 or not gone:
            return ""
        return (f"; this call passes {readable(new[0])}, the rollout's passed "
                f"{readable(gone[0])}: for a step that draws its sample inside, name it with "
                "lean_compile(..., sample_output=<the sample's index among the outputs>, "
                f"sample_arg={readable(new[0])!r})")
