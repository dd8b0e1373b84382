"""LeanGRPO in the loops users already own: ``lean_compile(fn, schedule=...)``.

FlowGRPO- and DanceGRPO-style trainers sample trajectories under ``no_grad``, score them, then
run the model again on every trained step to get gradients. On-policy that second forward
computes what the rollout already computed. Wrap the function both phases call (the model's
velocity, or a whole step: velocity + SDE transition + log-prob) and mark the two phases::

    step = leancompile.lean_compile(transformer_velocity, schedule="auto")
    with step.rollout(train=range(n_train)):     # the sampling loop, unchanged
        with torch.no_grad():
            for k in range(T):
                v = step(x, t[k], cond)
                ...
    with step.update():                           # the training loop, unchanged
        for batch in shuffled_minibatches:
            v = step(x_b, t_b, cond_b)            # no forward: the rollout's outputs
            loss(v).backward()                    # backward through what the rollout kept
            ...

How a call runs (each Dynamo graph of the function is captured by ``capture.capture_graph``
into forward, backward and inference graphs through the pass pipeline):

- outside both phases: as ``torch.compile`` would (inference graph under ``no_grad``,
  forward + backward with autograd otherwise);
- ``rollout``: calls chosen by ``train`` run the forward graph and keep what the schedule
  needs: ``retain`` the saved activations, ``reweight`` one gradient per trained row of every
  per-row scalar output (a log-prob), taken at once; the other calls run the inference graph.
  ``auto`` retains while the kept bytes fit the memory budget, then reweights (when the step has
  a per-row scalar output) or keeps nothing;
- ``update``: a call whose every row equals a kept row (same computation: a structural hash of
  the graph; same inputs: row fingerprints confirmed with ``torch.equal``; same parameter
  versions) returns the kept outputs without running a forward; its backward runs the kept
  backward graph (whole kept calls as they are, or the rows of any regrouping gathered when the
  LeanGRPO stage proved the graph keeps samples' rows apart) or sums the kept per-row gradients
  weighted by the incoming cotangents. Every other call is recomputed, and counted with its
  reason in ``step.stats``.

A step that draws its sample inside (FlowGRPO's and DanceGRPO's SDE steps when no
``prev_sample`` is given) declares it: ``sample_output`` is the output holding the drawn sample,
``sample_arg`` the keyword the update passes it back in. A rollout call and an update call then
match when the update graph computes, from the sample, exactly what the rollout graph computes
from the value it drew (the rollout graph's sample output is hashed as an input). The drawn
sample must reach the other outputs detached (FlowGRPO's ``prev_sample.detach()`` in the
log-prob): the update holds the sample it passes back constant, so a rollout graph whose
gradients flow through the sample is refused (``capture/fingerprint.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections import Counter
from typing import Callable

import torch
import torch.fx as fx
from torch import Tensor

from ..capture import StepGraphs, capture_graph
from ..compiler import LeanBackend, LeanGraphPass
from ..options import CompileOptions
from ..passes.lean_grpo import reweight_rows_per_backward
from ..report import Report, record_report
from .config import SCHEDULE_CHOICES, StepConfig, StepReport, StepStats
from .graphs import numel_per_row
from .inputs import call_batch_size, densely, given_back, tensors_of, to_copy
from .runtime import GraphRuntime, warn_little_reuse
from .state import StepState, TrainSpec, free_memory_bytes, sample_ids

__all__ = ["lean_compile", "LeanStep", "LeanModule"]


class _Backend:
    """The Dynamo backend of one ``LeanStep``: captures each graph, returns its runtime."""

    def __init__(self, step: "LeanStep"):
        self.step = step
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        step = self.step
        report = Report(options=step.options.cache_key())
        graph_pass = LeanGraphPass(step.options, report=report, graph_index=self.graphs)
        self.graphs += 1
        _rename_sample(gm, step.config.sample_arg)
        graphs = capture_graph(gm, example_inputs, graph_pass=graph_pass,
                               compiler=step.options.compiler,
                               sample_output=step.config.sample_output,
                               memory_budget=step.config.partitioner_budget,
                               reshard_after_forward=step.config.reshard_after_forward,
                               batch=step._state_batch)
        graphs.report = report
        record_report(report)
        step.reports.append(report)
        step.graphs.append(graphs)
        return GraphRuntime(step, graphs)


_GLOBAL_HOOKS = [0]
"""Which set of global module hooks is registered now (``_note_global_hooks``), read by every
step's entry so that Dynamo guards on it: ``register_module_forward_pre_hook`` and its kin
change what a module call computes, and Dynamo guards no global hook."""
_HOOK_SETS: dict = {((), (), (), ()): 0}


def _note_global_hooks() -> None:
    module = torch.nn.modules.module
    key = (tuple(module._global_forward_pre_hooks), tuple(module._global_forward_hooks),
           tuple(module._global_backward_pre_hooks), tuple(module._global_backward_hooks))
    _GLOBAL_HOOKS[0] = _HOOK_SETS.setdefault(key, len(_HOOK_SETS))


def _hook_roots(fn: Callable) -> tuple[torch.nn.Module, ...] | None:
    """The modules whose trees hold every module hook a call of ``fn`` can run: ``fn`` itself
    when it is a module, the module of a bound method; None when not known (a function: the
    modules it reaches are known to Dynamo only)."""
    if isinstance(fn, torch.nn.Module):
        return (fn,)
    owner = getattr(fn, "__self__", None)
    return (owner,) if isinstance(owner, torch.nn.Module) else None


def _module_hook_set(roots) -> tuple:
    """The hooks registered on every module under ``roots`` now (by handle id: a hook removed
    and another added differ), for the modules that have any. It walks the modules' own dicts:
    on the 2-layer SD3 with LoRA (249 modules) 0.1 ms, where a key of every module from
    ``Module.modules()`` took 0.26 ms."""
    key, seen, stack = [], set(), list(roots)
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        attrs = module.__dict__
        try:
            a, b, c, d = (attrs["_forward_pre_hooks"], attrs["_forward_hooks"],
                          attrs["_backward_pre_hooks"], attrs["_backward_hooks"])
        except KeyError:  # (a module that keeps one elsewhere, e.g. on its class)
            a, b, c, d = (getattr(module, name, None) or {} for name in _HOOK_DICTS)
        if a or b or c or d:
            key.append((id(module), tuple(a), tuple(b), tuple(c), tuple(d)))
        kind = type(module)
        if kind.named_modules is not _NAMED_MODULES or kind.modules is not _MODULES:
            stack.extend(module.modules())  # (a tree of its own making: what it says it holds)
        else:
            stack.extend(attrs["_modules"].values())
    return tuple(key)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_NAMED_MODULES, _MODULES = torch.nn.Module.named_modules, torch.nn.Module.modules


def _entry(fn: Callable, module_hooks: list) -> Callable:
    """A function that calls ``fn``, with a code object of its own: Dynamo keeps its compiled
    graphs (and counts recompiles against its limit) per code object, so each ``LeanStep`` gets
    its own, whatever else compiles ``fn``. It reads ``_GLOBAL_HOOKS`` and ``module_hooks``
    (the step's module-hook set, ``LeanStep._note_module_hooks``): a hook added or removed
    recompiles."""
    def call(*args, **kwargs):
        if _GLOBAL_HOOKS[0] < 0 or module_hooks[0] < 0:  # (never: Dynamo guards the reads)
            raise AssertionError(_GLOBAL_HOOKS, module_hooks)
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    call.__name__ = getattr(fn, "__name__", type(fn).__name__)
    return call


def _rename_sample(gm: fx.GraphModule, sample_arg: str | None) -> None:
    """Hash the update's sample argument under the name the rollout's drawn sample gets."""
    if sample_arg is None:
        return
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        source = getattr(arg, "source", None)
        if source is not None and source.name in (f"L['{sample_arg}']",
                                                  f"L['kwargs']['{sample_arg}']"):
            node.meta["leancompile_sample"] = True


class LeanStep:
    """A function compiled with LeanGRPO schedules; see the module docstring. Made by
    ``leancompile.lean_compile(fn, schedule=...)``; calls go to ``fn``'s compiled graphs."""

    def __init__(self, fn: Callable, *, options: CompileOptions, config: StepConfig,
                 compile_kwargs: dict | None = None):
        if not callable(fn):
            raise TypeError(f"lean_compile needs a function or module, got {type(fn).__name__}")
        self.fn = fn
        self.options = options
        self.config = config
        self.reports: list[Report] = []
        self.graphs: list[StepGraphs] = []
        self._state = StepState(config)
        self._state_batch = None
        self.compile_kwargs = dict(compile_kwargs or {})
        kwargs = dict(self.compile_kwargs)
        kwargs.setdefault("dynamic", False)
        self._hook_roots = _hook_roots(fn)
        self._module_hooks = [0]
        """Which set of module hooks the calls run with: an index into ``_hook_sets``, read by
        every call (``_entry``), so that Dynamo guards it."""
        self._hook_sets: dict[tuple, int] = {}
        self._note_module_hooks()
        self._compiled = torch.compile(_entry(fn, self._module_hooks), backend=_Backend(self),
                                       **kwargs)
        try:
            self.__wrapped__ = fn
            self.__doc__ = getattr(fn, "__doc__", None)
        except AttributeError:  # pragma: no cover - objects without a writable __doc__
            pass

    @property
    def stats(self) -> StepStats:
        return self._state.stats

    def _note_module_hooks(self) -> None:
        """Look at the hooks of the modules the calls run (``_hook_roots``), at each phase's
        entry: a hook added or removed since the graphs were traced makes the next call
        recompile, and a kept call traced without it is not reused (its graph differs). This
        replaces Dynamo's guards on every module's hook dicts, off by default
        (``skip_nnmodule_hook_guards``), which cost 0.5 ms a call on the 2-layer SD3 with LoRA
        (FlowGRPO's loop, tiny size, one A/B run: lean recompute 0.95x of plain Inductor's
        epoch with them, 1.04x without). A hook changed between two calls of one phase is not seen until the next
        phase, as plain ``torch.compile`` never sees one added after its compile."""
        if self._hook_roots is not None:
            key = _module_hook_set(self._hook_roots)
            self._module_hooks[0] = self._hook_sets.setdefault(key, len(self._hook_sets))

    def __call__(self, *args, **kwargs):
        state = self._state
        tensors = tensors_of(args, kwargs)
        copies = None
        if any(to_copy(t) for t in tensors):  # (one graph per layout otherwise)
            args, kwargs, copies = densely(args, kwargs)
            tensors = tensors_of(args, kwargs)
        batch = call_batch_size(tensors)
        if batch > 1:
            for t in tensors:
                if t.dim() >= 1 and t.shape[0] == batch:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        self._state_batch = batch
        if state.phase == "rollout":
            state.stats.rollout_calls += 1
            per = state.trajectory_steps
            state.current = state.train.rows(
                state.call_index if per is None else state.call_index % per, batch)
            state.current_samples = sample_ids(state.samples, state.call_index, batch)
            state.call_index += 1
        state.reached = False
        # Dynamo traces the step with gradients on whatever the caller's mode: under no_grad it
        # would inline a custom autograd.Function's forward, and the graphs captured from that
        # trace would differentiate the forward's ops instead of using the Function's backward
        # (Retain and Reweight would silently get other gradients than Recompute). The runtime
        # reads the caller's mode from the state; a no-grad call still runs no autograd.
        state.grad_mode = torch.is_grad_enabled()
        # Hooks guarded: Dynamo by default skips the guards on modules' hook dicts
        # (skip_nnmodule_hook_guards), so a hook added between the rollout and the update
        # would run the graph traced without it, under every schedule. Plain torch.compile
        # hides this only because its update call, with gradients on, recompiles anyway. A
        # module's step notes its hooks at each phase entry (_note_module_hooks); a function's
        # turns Dynamo's guards on.
        _note_global_hooks()
        dynamo_config = torch._dynamo.config
        skip_hook_guards = dynamo_config.skip_nnmodule_hook_guards
        if self._hook_roots is None:  # (else the step notes its modules' hooks itself)
            dynamo_config.skip_nnmodule_hook_guards = False
        try:
            with torch.enable_grad():
                out = self._compiled(*args, **kwargs)
        finally:
            dynamo_config.skip_nnmodule_hook_guards = skip_hook_guards
            state.current = None
            state.current_samples = None
        if state.phase is not None and not state.reached:
            # Dynamo ran the call without a compiled graph (its recompile limit, a frame it
            # skips): nothing was kept or reused. Counted, never silent.
            key = "rollout" if state.phase == "rollout" else "update"
            reason = ("Dynamo ran the call in Python without a compiled graph (recompile limit "
                      "reached, or a skipped frame); see TORCH_LOGS=recompiles")
            (state.stats.kept if key == "rollout" else state.stats.recomputed)[reason] += 1
            if key == "update":
                state.stats.update_calls += 1
                state.stats.forwards_run += 1
        return given_back(out, copies) if copies else out

    @contextlib.contextmanager
    def rollout(self, train=None, *, trajectory_steps: int | None = None, samples=None,
                schedule: str | None = None, budget_bytes: int | None = None):
        """The sampling loop: calls chosen by ``train`` keep what the schedule needs (see
        ``TrainSpec`` for the forms ``train`` takes; default: every call, every row). Starting a
        rollout frees what an earlier one kept.

        ``trajectory_steps``: the calls one trajectory makes (T denoising steps), for a loop
        that samples several batches of T steps each (FlowGRPO's ``num_batches_per_epoch``):
        ``train`` is then asked about the step within the trajectory (``call_index % T``), so
        ``train=range(n)`` trains the first n steps of every batch, not the first n calls of
        the whole rollout. ``samples`` still takes the call index.

        ``samples``: the sample (trajectory) each row of a call belongs to, as a LongTensor
        ``[calls, rows]`` or a function ``f(call_index) -> LongTensor [rows]``. With it,
        reweight keeps one gradient buffer per sample (the sum over its trained steps) instead
        of one per row, and requires the update to bring the same cotangent to every trained
        step of a sample (on-policy: ``-A_i / (B |S|)``); an optimizer step before all of a
        sample's steps arrived raises. ``schedule`` overrides the wrapper's for this rollout,
        ``budget_bytes`` its memory budget (what ``auto`` and reweight's rows per backward go
        by)."""
        state = self._state
        if state.phase is not None:
            raise RuntimeError(f"rollout() inside {state.phase}(): the phases do not nest")
        if schedule is not None and schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULE_CHOICES}")
        if schedule == "auto" and self.config.defer_reductions:
            raise ValueError("rollout(schedule='auto') with defer_reductions=True: ranks could "
                             "pick different schedules per call; pass retain or reweight")
        if trajectory_steps is not None and (isinstance(trajectory_steps, bool) or not
                                             isinstance(trajectory_steps, int)
                                             or trajectory_steps < 1):
            raise ValueError(f"trajectory_steps={trajectory_steps!r}: the number of calls one "
                             "trajectory makes (its denoising steps), an int >= 1, or None")
        state.unwatch_optimizers()
        state.clear()
        state.start_cycle((len(self.graphs), sum(len(g.compiled) for g in self.graphs)))
        state.stale = None
        state.schedule = schedule or self.config.schedule
        state.samples = samples
        state.train = TrainSpec(train)
        state.trajectory_steps = trajectory_steps
        state.call_index = 0
        self._note_module_hooks()
        state.phase = "rollout"
        if budget_bytes is not None:
            state.budget = budget_bytes
        elif self.config.memory_budget_bytes is not None:
            state.budget = self.config.memory_budget_bytes
        else:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            state.budget = int(free_memory_bytes(device) * self.config.memory_fraction)
        start = time.perf_counter()
        try:
            yield self
        finally:
            state.phase = None
            state.stats.rollout_seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def update(self):
        """The training loop: calls that repeat a kept rollout call reuse it; what was kept and
        not used is freed at exit (and counted in ``stats``)."""
        state = self._state
        if state.phase is not None:
            raise RuntimeError(f"update() inside {state.phase}(): the phases do not nest")
        self._note_module_hooks()
        state.phase = "update"
        start = time.perf_counter()

        def before_step(optimizer, args, kwargs):
            pending = state.pending_samples()
            if pending:
                raise RuntimeError(
                    f"optimizer.step() before every trained step of samples {pending} reached "
                    "the update: reweight keeps one gradient per sample (samples=) and applies "
                    "it when the sample's last step arrives; step the optimizer after them, or "
                    "rollout without samples= (one buffer per row)")

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hook = register_optimizer_step_pre_hook(before_step)
        stats = state.stats
        calls, reused = stats.update_calls, stats.reused_calls
        recomputed = Counter(stats.recomputed)
        kept_rows = bool(state.kept)
        try:
            yield self
            warn_little_reuse(kept_rows, state.stats, calls, reused, recomputed)
            pending = state.pending_samples()
            if pending:
                raise RuntimeError(
                    f"update() ended with samples {pending} only partly updated: their "
                    "merged reweight gradients were never applied (every trained step of a "
                    "sample must reach the update)")
        finally:
            hook.remove()
            state.unwatch_optimizers()
            state.phase = None
            state.clear()
            state.stats.update_seconds += time.perf_counter() - start

    def plan(self, *args, **kwargs) -> list[StepGraphs]:
        """Compile the graphs a call with these arguments runs, without running them (the
        outputs are uninitialised), and return them: what ``explain`` and a trainer's plans
        read (saved bytes, row layouts, FLOPs)."""
        state = self._state
        if state.phase is not None:
            raise RuntimeError(f"plan() inside {state.phase}()")
        state.phase = "plan"
        state.graphs_called = []
        try:
            with torch.no_grad():
                self(*args, **kwargs)
        finally:
            state.phase = None
        graphs = list(state.graphs_called)
        for g in graphs:  # (a call in plan() runs no graph: nothing compiled them yet)
            g.compile()
        return graphs

    def discard_kept(self) -> None:
        """Free everything the last rollout kept (activations, per-sample buffers), so that
        the next update calls recompute; what ``take_deferred_grads`` holds stays."""
        if self._state.phase is not None:
            raise RuntimeError(f"discard_kept() inside {self._state.phase}()")
        self._state.unwatch_optimizers()
        self._state.clear()

    def take_deferred_grads(self) -> list[tuple[Tensor, Tensor]]:
        """``defer_reductions``: (parameter, full-size gradient not yet reduced over the ranks)
        for every parameter Reweight held back since the last call; the caller reduces them
        and adds the result to the parameters' gradients."""
        out = list(self._state.deferred.values())
        self._state.deferred.clear()
        self._state.held_bytes = 0
        return out

    def reset_stats(self) -> StepStats:
        """Return the stats so far and start counting anew."""
        old = self._state.stats
        self._state.stats = StepStats()
        return old

    def explain_schedules(self, *args, **kwargs) -> StepReport:
        """What ``leancompile.explain(step, *args)`` returns: the graphs a call with these
        arguments runs (compiled, not run) and what each schedule keeps for it."""
        graphs = self.plan(*args, **kwargs)
        tensors = tensors_of(args, kwargs)
        batch = next((t.shape[0] for t in tensors if t.dim() >= 1), 1)
        device = tensors[0].device if tensors else torch.device("cpu")
        budget = self.config.memory_budget_bytes or int(
            free_memory_bytes(device) * self.config.memory_fraction)
        rows = []
        for g in graphs:
            params = [r.source for r in g.roles if r.kind == "param"]
            grad_bytes = 0
            if g.forward is not None:
                placeholders = [n for n in g.forward.graph.nodes if n.op == "placeholder"]
                for role, node in zip(g.roles, placeholders):
                    val = node.meta.get("val")
                    if role.kind == "param" and isinstance(val, Tensor):
                        grad_bytes += val.numel() * val.element_size()
            rows.append({
                "kept_bytes": g.kept_bytes(batch) if g.forward is not None else 0,
                "row_local": bool(g.layouts.get("row_local")),
                "reason": g.layouts.get("reason") or "the LeanGRPO stage found no batch",
                "scalars": [j for j in g.differentiable if numel_per_row(g, j, batch) == 1],
                "grad_bytes": grad_bytes, "params": len(params),
                "rows_per_backward": reweight_rows_per_backward(
                    rows=batch, grad_bytes=grad_bytes, requested=self.config.reweight_rows,
                    row_saved_bytes=g.kept_bytes(1) if g.forward is not None else 0,
                    room_bytes=budget) if g.layouts.get("row_local") else 1,
                "random_ops": g.random_ops})
        return StepReport(schedule=self.config.schedule, batch=batch, budget_bytes=budget,
                          graphs=rows, reports=[g.report for g in graphs if g.report])

    def __repr__(self) -> str:
        return (f"LeanStep({getattr(self.fn, '__name__', type(self.fn).__name__)}, "
                f"schedule={self.config.schedule!r}, {self.options})")


class LeanModule(torch.nn.Module):
    """``lean_compile(module, schedule=...)``: the module as the loop holds it, its calls
    through a ``LeanStep``. Everything but the call passes through to the wrapped module, as
    with ``torch.compile``'s ``OptimizedModule``: attributes (``.config``, ``.dtype``,
    ``disable_adapter()``), ``train()``/``eval()``, and the module tree itself: the wrapper
    shares the wrapped module's submodules, parameters and buffers (the same dicts), so
    ``parameters()``, ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` have
    the wrapped module's names at every level (a checkpoint of either loads into the other;
    under DDP, ``module.`` + those names). ``.module`` is the wrapped module itself (what
    FlowGRPO reaches through its DDP wrapper: ``transformer.module.disable_adapter()``). The
    phases and stats are the step's: ``rollout()``, ``update()``, ``stats``, ``plan()``,
    ``explain_schedules()``, ``discard_kept()``. So a diffusers pipeline takes it in place of
    its transformer::

        pipeline.transformer = leancompile.lean_compile(pipeline.transformer, schedule="retain")
    """

    _STEP_ATTRIBUTES = ("rollout", "update", "stats", "plan", "explain_schedules",
                        "discard_kept", "take_deferred_grads", "reset_stats", "graphs",
                        "reports", "_state")

    def __init__(self, module: torch.nn.Module, step: LeanStep):
        super().__init__()
        for tree in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            object.__setattr__(self, tree, getattr(module, tree))
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "lean_step", step)
        object.__setattr__(self, "_signature", _keyword_signature(module))
        self.training = module.training

    def forward(self, *args, **kwargs):
        # Arguments by keyword, whichever way the caller passed them: the sampler calls
        # transformer(x, t, ...) where the training code calls transformer(hidden_states=x,
        # ...), and Dynamo names (and hashes) an input by how it was passed.
        names = self._signature
        if args and names is not None and len(args) <= len(names) and \
                not kwargs.keys() & names[:len(args)]:
            kwargs = {**dict(zip(names, args)), **kwargs}
            args = ()
        return self.lean_step(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)  # (its own flag; the submodules are shared)
        self.training = mode
        return self

    def __deepcopy__(self, memo):
        """A copy of the module under a step of its own (``copy.deepcopy(transformer)`` for a
        reference or EMA model: a copied step would still call the original module)."""
        module = copy.deepcopy(self.module, memo)
        step = self.lean_step
        return LeanModule(module, LeanStep(module, options=step.options, config=step.config,
                                           compile_kwargs=step.compile_kwargs))

    def __getattr__(self, name: str):
        if name in LeanModule._STEP_ATTRIBUTES:
            return getattr(self.__dict__["lean_step"], name)
        try:
            return super().__getattr__(name)  # (the shared submodules, parameters, buffers)
        except AttributeError:
            return getattr(self.__dict__["module"], name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self.module)))

    def __repr__(self) -> str:
        return f"LeanModule(schedule={self.lean_step.config.schedule!r}, {self.module!r})"


def _keyword_signature(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The names of ``module.forward``'s parameters that a call may pass by position, when
    every one of them can also be passed by keyword (no ``*args``, no positional-only one),
    else None."""
    import inspect

    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
        return None
    return tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)


_TORCH_COMPILE_KWARGS = ("fullgraph", "dynamic")


_STEP_KWARGS = tuple(f.name for f in dataclasses.fields(StepConfig) if f.name != "schedule")


def lean_compile(fn=None, *, backend: str = "inductor", **options):
    """Compile a function or module with leancompile's passes; usable as ``@lean_compile`` or
    ``@lean_compile(backend="aot_eager", overlap="flash", ...)``.

    ``backend`` is what compiles the graphs after our passes (``"inductor"`` or
    ``"aot_eager"``). The leancompile options (``overlap``, ``variant``, ``chunks_per_rank``,
    ``chunks``, ``on_error``, ``disable``) are those of ``leancompile.backend``; ``fullgraph``
    and ``dynamic`` go to ``torch.compile``.

    With ``schedule=`` (``"auto"``, ``"retain"``, ``"reweight"``, ``"recompute"``) the result is
    a ``leancompile.lean.LeanStep``: the function as compiled, plus ``rollout()`` and
    ``update()`` phases in which an update call reuses the rollout's forward (LeanGRPO); for a
    module, a ``LeanModule`` (the module as before, its calls through such a step). It
    also takes ``sample_output`` and ``sample_arg`` (a step that draws its sample inside),
    ``memory_budget_bytes`` and ``memory_fraction`` (``auto``'s budget), ``auto_measured``
    (``auto`` also weighs measured costs), ``partitioner_budget``,
    ``reshard_after_forward`` and ``reweight_rows``; see ``StepConfig``. Any other keyword
    raises ``TypeError``.
    """
    compile_kwargs = {k: options.pop(k) for k in _TORCH_COMPILE_KWARGS if k in options}
    step_kwargs = {k: options.pop(k) for k in _STEP_KWARGS if k in options}
    if "compiler" in options:
        raise TypeError("lean_compile takes backend=..., not compiler=...")
    try:
        compile_options = CompileOptions.from_kwargs(compiler=backend, **options)
    except TypeError as err:
        raise TypeError(f"lean_compile: {err}; it also takes backend, the torch.compile "
                        f"options {list(_TORCH_COMPILE_KWARGS)} and, with schedule=, "
                        f"{list(_STEP_KWARGS)}") from None
    if step_kwargs and compile_options.schedule is None:
        raise TypeError(f"lean_compile: {sorted(step_kwargs)} go with schedule=...")
    if compile_options.schedule is not None:
        config = StepConfig(schedule=compile_options.schedule, **step_kwargs)

        def wrap_step(target):
            step = LeanStep(target, options=compile_options, config=config,
                            compile_kwargs=compile_kwargs)
            return LeanModule(target, step) if isinstance(target, torch.nn.Module) else step

        return wrap_step if fn is None else wrap_step(fn)
    lean_backend = LeanBackend(compile_options)

    def wrap(target):
        if not callable(target):
            raise TypeError(f"lean_compile needs a function or module, got "
                            f"{type(target).__name__}")
        return torch.compile(target, backend=lean_backend, **compile_kwargs)

    return wrap if fn is None else wrap(fn)
