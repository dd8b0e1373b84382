"""What a ``LeanStep`` holds between its phases: which rollout calls are trained
(``TrainSpec``), each kept call (``KeptCall``) and the step's state (``StepState``: the index of
kept rows, memory, per-sample buffers, the watch over optimizers and parameter values); the
device facts the phases read (``free_memory_bytes``, ``synchronize``)."""

from __future__ import annotations

import os
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .config import StepConfig, StepStats
from .costs import Ledger, verdict

__all__ = ["TrainSpec", "KeptCall", "StepState", "free_memory_bytes", "synchronize", "sample_ids",
           "buffer_bytes"]


class TrainSpec:
    """``train`` of ``rollout()``: None (every call, every row), an int n (the first n calls),
    a container of call indices, a bool tensor ``[calls]`` or ``[calls, rows]``, or a callable
    ``f(call_index) -> bool | bool tensor [rows] | None``."""

    def __init__(self, spec):
        if not (spec is None or callable(spec) or isinstance(spec, (int, Tensor))
                or hasattr(spec, "__contains__")):
            raise TypeError(f"train={spec!r}: pass None, an int, call indices, a bool tensor "
                            "[calls] or [calls, rows], or a function of the call index")
        if isinstance(spec, Tensor) and (spec.dtype != torch.bool or spec.dim() not in (1, 2)):
            raise ValueError(f"train tensor must be bool [calls] or [calls, rows], got "
                             f"{spec.dtype} {tuple(spec.shape)}")
        self.spec = spec

    def rows(self, index: int, batch: int) -> list[int] | None:
        spec = self.spec
        if spec is None:
            value = True
        elif isinstance(spec, bool):
            value = spec
        elif isinstance(spec, int):
            value = index < spec
        elif isinstance(spec, Tensor):
            value = spec[index] if index < spec.shape[0] else False
        elif callable(spec):
            value = spec(index)
        else:
            value = index in spec
        if value is None or value is False:
            return None
        if value is True:
            return list(range(batch))
        if isinstance(value, Tensor) and value.dim() == 0:
            return list(range(batch)) if bool(value) else None
        mask = torch.as_tensor(value, dtype=torch.bool).flatten()
        if mask.numel() != batch:
            raise ValueError(f"train selects rows with a mask of {mask.numel()} entries for a "
                             f"call of {batch} rows (call {index})")
        rows = mask.nonzero().flatten().tolist()
        return rows or None


@dataclass(eq=False, kw_only=True)
class KeptCall:
    """One trained rollout call: its inputs, outputs and what the schedule kept."""

    runtime: object
    """The ``GraphRuntime`` (``runtime.py``) of the graph that ran it."""
    mode: str
    args: list
    batch: int
    outputs: list
    saved: list | None
    grads: dict
    rows: list[int]
    used: set = field(default_factory=set)
    versions: dict = field(default_factory=dict)
    symbols: dict = field(default_factory=dict)
    nbytes: int = 0
    samples: list | None = None
    """Reweight: the sample of each row when the rollout named them (buffers per sample)."""
    watched: list = field(default_factory=list)
    """(tensor, version) of its outputs and tensor inputs (parameters aside) as the rollout
    left them: the saved tensors may be views of them."""
    keys: list = field(default_factory=list)
    """The keys its rows are indexed under (``StepState.index``)."""

    def changed(self) -> bool:
        """Whether the caller changed an output or input of this call in place since."""
        return any(t._version != v for t, v in self.watched)


class StepState:
    def __init__(self, config: StepConfig):
        self.config = config
        self.phase: str | None = None
        self.train = TrainSpec(None)
        self.trajectory_steps: int | None = None
        """``rollout(trajectory_steps=T)``: ``train`` is asked about ``call_index % T``."""
        self.call_index = 0
        self.current: list[int] | None = None
        self.index: dict = {}
        self.kept: list[KeptCall] = []
        self.kept_bytes = 0
        self.buffer_bytes = 0
        self.budget = 0
        self.reached = False
        self.grad_mode = False
        """Whether the caller had gradients enabled (the compiled entry always runs with them
        on: ``LeanStep.__call__``)."""
        self.schedule = config.schedule
        self.samples = None
        self.current_samples: list[int] | None = None
        self.sample_grads: dict = {}
        """Reweight with ``samples``: (sample, output) -> {parameter source: summed gradient}."""
        self.deferred: dict = {}
        """``defer_reductions``: id(parameter) -> (parameter, summed full-size gradient); kept
        across rollouts and updates until ``take_deferred_grads()``."""
        self.held_bytes = 0
        """Bytes of the ``deferred`` gradients."""
        self.sample_blocks: dict = {}
        """Reweight with ``samples``: (samples, output) -> {parameter source: [len(samples),
        *shape] block}, whose slices are those samples' ``sample_grads``."""
        self.sample_rows: Counter = Counter()
        """Reweight with ``samples``: trained rows kept per sample."""
        self.arrived: dict = {}
        """Reweight with ``samples``: sample -> the cotangents its rows brought so far."""
        self.claimed: dict = {}
        """Reweight with ``samples``: sample -> the kept (call, row) pairs update calls have
        served (a step served twice cannot be: the buffer holds each step once)."""
        self.graphs_called: list = []
        self.stats = StepStats()
        self.ledger = Ledger()
        """This rollout's and update's measured costs (``costs.py``)."""
        self.auto_off: str | None = None
        """Why ``auto`` keeps nothing any more (``costs.verdict``), once a cycle showed that
        keeping cost more than it saved."""
        self.stale: str | None = None
        """Why nothing is kept any more, when the parameters changed after the rollout."""
        self._step_hook = None
        self.digest_ids: set[int] = set()
        self.digest: tuple | None = None
        """(trainable parameters, ``values_digest`` of them) at the first kept call of each graph
        that reads them:
        compared by each update call, for writes through ``.data`` (manual SGD, an EMA copied
        in) that neither version counters nor the optimizer hook see."""

    def start_cycle(self, graphs: tuple) -> None:
        """At a rollout's entry: auto's verdict on the cycle ending here, then a new ledger.
        ``graphs``: the step's graphs and compiled phases now (``costs.Ledger.graphs``)."""
        if self.auto_off is None and self.config.auto_measured:
            self.auto_off = verdict(self.ledger, graphs)
        self.ledger = Ledger(graphs=graphs)

    def watch_optimizers(self) -> None:
        """While something is kept: any ``optimizer.step()`` over a kept call's parameters
        makes it stale: fused and 8-bit optimizers change parameters without bumping the
        version counters ``GraphRuntime.param_versions`` reads (writes through ``.data``
        outside an optimizer: ``digest``)."""
        if self._step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            # (a weak reference: a step dropped between its rollout and update is freed with
            # what it kept; its hook then does nothing)
            this = weakref.ref(self)

            def after_step(optimizer, args, kwargs):
                state = this()
                if state is not None:
                    state._after_step(optimizer, args, kwargs)

            self._step_hook = register_optimizer_step_post_hook(after_step)

    def unwatch_optimizers(self) -> None:
        """(Never from inside the hook: torch iterates its hooks while calling them.)"""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not self.kept:
            return
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(kept.args[i]) in stepped for kept in self.kept for i in kept.runtime.params):
            self.clear()
            self.stale = (f"the parameters changed since the rollout ({type(optimizer).__name__}"
                          ".step() ran): kept state is stale")

    def add(self, kept: KeptCall, keys: list) -> None:
        self.watch_optimizers()
        self.kept.append(kept)
        self.index_rows(kept, keys)
        if kept.mode == "retain":
            self.kept_bytes += kept.nbytes
            self.stats.peak_kept_bytes = max(self.stats.peak_kept_bytes, self.kept_bytes)
        else:
            self.buffer_bytes += kept.nbytes
            self.note_peak()
        self.stats.kept[kept.mode] += 1
        self.stats.kept_rows += len(kept.rows)

    def index_rows(self, kept: KeptCall, keys: list) -> None:
        """Make ``kept``'s trained rows findable by their keys (one per row)."""
        for row in kept.rows:
            self.index.setdefault(keys[row], []).append((kept, row))
            kept.keys.append(keys[row])

    def note_peak(self) -> None:
        self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes,
                                           self.buffer_bytes + self.held_bytes)

    def release(self, kept: KeptCall) -> None:
        """Forget ``kept`` (the backward closures of update calls may still hold its tensors
        until they run)."""
        if kept not in self.kept:
            return
        self.kept.remove(kept)
        for key in set(kept.keys):
            entries = [e for e in self.index.get(key, ()) if e[0] is not kept]
            if entries:
                self.index[key] = entries
            else:
                self.index.pop(key, None)
        if kept.mode == "retain":
            self.kept_bytes -= kept.nbytes
        else:
            self.buffer_bytes -= kept.nbytes

    def pending_samples(self) -> list:
        """Samples some of whose rows reached the update, not all (their merged gradient waits
        for the rest)."""
        return sorted(s for s, got in self.arrived.items() if 0 < len(got) < self.sample_rows[s])

    def clear(self) -> None:
        self.sample_grads.clear()
        self.sample_blocks.clear()
        self.sample_rows.clear()
        self.arrived.clear()
        for kept in list(self.kept):
            unused = [r for r in kept.rows if r not in kept.used]
            if unused:
                self.stats.unused_rows += len(unused)
                self.stats.unused_bytes += kept.nbytes * len(unused) // max(len(kept.rows), 1)
        self.kept.clear()
        self.index.clear()
        self.kept_bytes = self.buffer_bytes = 0
        self.digest = None
        self.digest_ids = set()
        self.claimed.clear()


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now (the CPU: available physical memory). On CUDA: the
    device's free memory and what PyTorch's caching allocator holds unused (freed tensors it
    keeps for reuse: what an earlier rollout kept is free again after its update)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


def synchronize(device: torch.device | None = None) -> None:
    """Wait until ``device`` (None: the current CUDA device, if CUDA was used) has run the work
    queued on it, so that a host clock read next times that work: CUDA kernels run after
    the Python that launched them has returned; the host runs its own at once."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_ids(spec, index: int, batch: int) -> list[int] | None:
    if spec is None:
        return None
    ids = spec(index) if callable(spec) else spec[index]
    ids = torch.as_tensor(ids).flatten().tolist()
    if len(ids) != batch:
        raise ValueError(f"samples gives {len(ids)} sample ids for call {index} of {batch} rows")
    return [int(i) for i in ids]


def buffer_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for grads in state.sample_grads.values()
               for t in grads.values() if t is not None)
