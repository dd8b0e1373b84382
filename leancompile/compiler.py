"""Two of the three ways into the pipeline: ``backend()`` and ``install()`` (the third,
``lean_compile``, is in ``leancompile/lean``, with the LeanGRPO phases it can add).

All three run the same ``Pipeline`` on the post-grad graphs AOTAutograd produces (forward,
backward and inference). With Inductor our pipeline is Inductor's ``post_grad_custom_pre_pass``,
so Inductor's own passes and lowering run after it; with ``aot_eager`` the rewritten aten
graphs run eagerly, traced with Inductor's decompositions and partitioner so the graphs our
passes see are the ones they would see under Inductor.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from .report import GraphRecord, Report, record_report
from .options import CompileOptions
from .passes import PASSES, inductor_config_patches, inductor_patches, issues_ahead
from .pipeline import Pipeline

__all__ = ["backend", "install", "Installation", "LeanGraphPass", "leancompile_backend",
           "aot_eager", "no_schedule"]

log = logging.getLogger("leancompile")

__version__ = "0.1.0"

try:  # torch 2.13 has it; 2.11 does not
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
    _INFERENCE_AWARE = True
except ImportError:  # torch 2.11: Inductor calls pass(graph), see _post_grad_is_inference
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
    _INFERENCE_AWARE = False


def current_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else ``$RANK``, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of the pass and pipeline sources, so an edited pass never reuses a cached graph."""
    here = Path(__file__).parent
    # The passes, what they trace into graphs (the runtime schedules), the runner, and the
    # capture of a LeanStep's graphs (how they are traced: e.g. whether the backward may
    # donate saved buffers, which Inductor's graph key does not hold).
    files = sorted({Path(s.module_file) for s in PASSES} | set((here / "passes").rglob("*.py"))
                   | set((here / "runtime").glob("*.py")) | set((here / "capture").glob("*.py"))
                   | {here / "pipeline.py"})
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _post_grad_is_inference() -> bool:
    """Whether the graph Inductor's post-grad passes are running on is an inference graph,
    where Inductor calls custom passes without saying (torch 2.11 has no
    ``CustomInferenceAwareGraphPass``): its ``post_grad_passes(gm, is_inference)`` frame on
    the stack says. Without it (a pass called by hand), False: the phase then comes from the
    graph (tangent inputs: backward, else forward)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "post_grad_passes" and code.co_filename.endswith("post_grad.py"):
            return bool(frame.f_locals.get("is_inference", False))
        frame = frame.f_back
    return False


def _phase_of(graph: fx.Graph, is_inference: bool) -> str:
    if is_inference:
        return "inference"
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return "backward"
    return "forward"


class LeanGraphPass(_PassBase):
    """Our pipeline as an Inductor ``post_grad_custom_pre_pass``.

    ``previous`` is a pass that was installed before ours; it runs first, then our pipeline.
    ``uuid()`` (Inductor's cache key for custom passes) covers the options, the pass names,
    versions and sources, this rank, and the previous pass's uuid: two ranks or two option sets
    never share a cached graph. If the previous pass has no uuid, neither do we (Inductor then
    bypasses its cache, as it would for that pass alone).
    """

    def __init__(self, options: CompileOptions, *, previous: Any = None,
                 report: Report | None = None, graph_index: int = 0):
        self.options = options
        self.previous = previous
        self.pipeline = Pipeline(options)
        self._report = report
        self._graph_index = graph_index
        self.tunes_inductor = False
        """Set by a caller that compiles under ``passes.inductor_patches(self)``: a graph that
        issues collectives ahead (``passes.issues_ahead``) then turns Inductor's
        ``reorder_for_peak_memory`` off for its own compile, which the caller's patch puts
        back afterwards."""

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        if is_inference is None:  # an Inductor that does not say (torch 2.11)
            is_inference = _post_grad_is_inference()
        self.run_previous(graph, is_inference=is_inference)
        gm = graph.owning_module
        if gm is None:
            raise RuntimeError("leancompile's pass needs a graph owned by a GraphModule")
        # Inductor regenerates the code once, at the end of its post-grad passes (which work
        # on the graph, not the code).
        self.run(gm, phase=_phase_of(graph, is_inference), recompile=False)
        if self.tunes_inductor and issues_ahead(gm, self.options):
            # read by Inductor's scheduler for this graph; inductor_patches restores it
            torch._inductor.config.reorder_for_peak_memory = False

    def _previous_passes(self) -> tuple:
        """The pass(es) installed before ours: Inductor takes one or a list."""
        if self.previous is None:
            return ()
        return tuple(self.previous) if isinstance(self.previous, (list, tuple)) else \
            (self.previous,)

    def run_previous(self, graph: fx.Graph, *, is_inference: bool) -> None:
        """Run the pass(es) installed before ours, the way Inductor would have."""
        for previous in self._previous_passes():
            if _INFERENCE_AWARE and isinstance(previous, _PassBase):
                previous(graph, is_inference=is_inference)
            else:
                previous(graph)

    def run(self, gm: fx.GraphModule, *, phase: str, recompile: bool = True) -> GraphRecord:
        """The pipeline on ``gm``, recorded in the compile's report (``recompile``: as
        ``Pipeline.run``)."""
        record = self.pipeline.run(gm, phase=phase, graph_index=self._graph_index,
                                   recompile=recompile)
        report = self._report
        if report is None:  # installed pass: the report of the compile this graph belongs to
            report = _unbound_report(self.options, phase)
        report.graphs.append(record)
        return record

    def uuid(self) -> str | None:
        # Inductor asks for the uuid on every compile, also one its caches will serve: the
        # moment to (re-)arm the installation's cache-hit report for this compile.
        for inst in list(_installations):
            if inst.graph_pass is self:
                inst.note_compile(_compile_id())
        previous_uuid = None
        if self.previous is not None:
            uuids = []
            for previous in self._previous_passes():
                get_uuid = getattr(previous, "uuid", None)
                uuids.append(get_uuid() if callable(get_uuid) else None)
                if uuids[-1] is None:
                    return None
            previous_uuid = uuids[0] if not isinstance(self.previous, (list, tuple)) \
                else uuids
        payload = {
            "leancompile": __version__,
            "passes": [(s.name, s.version) for s in PASSES],
            "source": _source_hash(),
            "options": _code_options(self.options),
            "rank": current_rank(),
            "previous": str(previous_uuid),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _code_options(options: CompileOptions) -> dict:
    """The options as far as they change the code Inductor generates: the LeanGRPO stage plans
    reuse without changing the graph, so the graphs of ``schedule="retain"``, ``"reweight"``,
    ``"auto"`` and ``"recompute"`` share cache entries (a graph compiled without a schedule keeps
    its own: the stage does not run there)."""
    key = options.cache_key()
    if key["schedule"] is not None:
        key["schedule"] = "planned"
    return key


_unbound: "collections.OrderedDict[str, Report]" = collections.OrderedDict()
_UNBOUND_KEEP = 256
_unbound_lock = threading.Lock()
_installations: list["Installation"] = []


def _compile_id() -> str | None:
    """The Dynamo compile this graph belongs to. AOTAutograd compiles a backward lazily, at the
    first backward call, inside the compile context of its forward, so a forward and its
    backward see the same id whatever ran in between."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is None:
        return None
    # Compile ids restart at 0/0 after torch._dynamo.reset(); the context object does not
    # (AOTAutograd re-enters the forward's own context for the lazy backward).
    return f"{cid}@{id(CompileContext.get())}"


def _unbound_report(options: CompileOptions, phase: str) -> Report:
    """The report of the current compile (made on its first graph) under ``install()``."""
    key = _compile_id()
    with _unbound_lock:
        report = _unbound.get(key) if key is not None else None
        if report is None or phase in report.phases:
            report = Report(options=options.cache_key())
            if key is not None:
                _unbound[key] = report
                while len(_unbound) > _UNBOUND_KEEP:
                    _unbound.popitem(last=False)
            for inst in _installations:
                inst.reports.append(report)
            record_report(report)
        return report


class LeanBackend:
    """A ``torch.compile`` backend: AOTAutograd, our pipeline on every post-grad graph, then
    Inductor or ``aot_eager``. Each Dynamo graph it compiles gets its own ``Report``."""

    def __init__(self, options: CompileOptions, *, on_report: Callable[[Report], None] | None
                 = None):
        self.options = options
        self._on_report = on_report
        self._graphs_compiled = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        report = Report(options=self.options.cache_key())
        if self._on_report is not None:
            self._on_report(report)
        record_report(report)
        graph_pass = LeanGraphPass(
            self.options, previous=torch._inductor.config.post_grad_custom_pre_pass,
            report=report, graph_index=self._graphs_compiled)
        self._graphs_compiled += 1
        if self.options.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=inductor_patches(graph_pass))
            if not report.graphs:
                report.cached = True
                log.info("leancompile: graph %d served from Inductor's cache; passes not rerun",
                         graph_pass._graph_index)
            return compiled
        return aot_eager(graph_pass)(gm, example_inputs)

    def __repr__(self) -> str:
        return f"leancompile.backend({self.options})"


def aot_eager(graph_pass: LeanGraphPass):
    """The ``aot_eager`` path with ``graph_pass`` on every graph: AOTAutograd with Inductor's
    decompositions and min-cut partitioner (the graphs Inductor would see), then the graphs run
    as they are."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def compiler(phase):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            gm.graph.eliminate_dead_code()  # Inductor does this before its custom passes
            graph_pass.run_previous(gm.graph, is_inference=phase == "inference")
            graph_pass.run(gm, phase=phase)  # regenerates gm's code once, after the passes
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=select_decomp_table(),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


def no_schedule(options: CompileOptions, where: str) -> CompileOptions:
    """``options`` when they hold no LeanGRPO schedule, else a ``ValueError`` saying where
    schedules go."""
    if options.schedule is not None:
        raise ValueError(
            f"{where} does not take schedule={options.schedule!r}: a LeanGRPO schedule needs "
            "the rollout()/update() phases of the object leancompile.lean_compile(fn, "
            "schedule=...) returns; wrap the policy function with that")
    return options


def backend(**options) -> LeanBackend:
    """A ``torch.compile`` backend running leancompile's passes.

    Options (all keyword): ``compiler`` (``"inductor"`` default, or ``"aot_eager"``),
    ``disable`` (pass names to skip), ``overlap``, ``variant``, ``chunks_per_rank``,
    ``chunks``, ``on_error``. Unknown names raise ``TypeError``. Example:
    ``torch.compile(model, backend=leancompile.backend(disable=...))``.
    """
    return LeanBackend(no_schedule(CompileOptions.from_kwargs(**options), "backend()"))


def leancompile_backend(gm: fx.GraphModule, example_inputs, *, options: dict | None = None,
                        mode: str | None = None):
    """The backend registered as ``"leancompile"``: ``torch.compile(m, backend="leancompile",
    options={...})`` takes the same options as ``leancompile.backend``."""
    if mode is not None:
        raise TypeError(
            f"torch.compile(mode={mode!r}) is an Inductor preset and is not supported with "
            "backend='leancompile'; pass leancompile options through options={...}")
    return backend(**(options or {}))(gm, example_inputs)


class Installation:
    """Our pipeline installed as Inductor's ``post_grad_custom_pre_pass``.

    Returned by ``install()``; ``uninstall()`` (or leaving the ``with`` block) puts back the
    pass that was installed before.
    """

    def __init__(self, options: CompileOptions):
        from torch._inductor import config

        self.options = options
        self.previous = config.post_grad_custom_pre_pass
        self.graph_pass = LeanGraphPass(options, previous=self.previous)
        config.post_grad_custom_pre_pass = self.graph_pass
        # Inductor settings the passes may need (inductor_config_patches): for every compile
        # while installed (an installed pass cannot restore them per graph), put back on
        # uninstall
        self._patched = {name: getattr(config, name)
                         for name in inductor_config_patches(options)}
        for name, value in inductor_config_patches(options).items():
            setattr(config, name, value)
        self.active = True
        self.reports: list[Report] = []
        """One report per compile while installed, in order (a forward and its later
        backward share one; a compile served from Inductor's caches gets one that says so)."""
        self._hits: dict[str, int] = {}
        self._start, self._end = self._on_compile_start, self._on_compile_end
        self.arm()
        _installations.append(self)

    def arm(self) -> None:
        """(Re-)register the compile callbacks that report cache hits: ``torch._dynamo.reset()``
        clears every callback, so every compile re-arms them (through ``uuid()``)."""
        handler = torch._dynamo.callback.callback_handler
        if self.active and self._start not in handler.start_callbacks:
            handler.register_start_callback(self._start)
        if self.active and self._end not in handler.end_callbacks:
            handler.register_end_callback(self._end)
        log.info("leancompile installed as post_grad_custom_pre_pass%s",
                 f" (chained after {self.previous!r})" if self.previous is not None else "")

    def uninstall(self) -> None:
        from torch._inductor import config

        if not self.active:
            return
        if config.post_grad_custom_pre_pass is not self.graph_pass:
            raise RuntimeError(
                "another post_grad_custom_pre_pass was installed after leancompile.install() "
                f"({config.post_grad_custom_pre_pass!r}); remove it first, so that uninstalling"
                " leancompile does not drop it")
        config.post_grad_custom_pre_pass = self.previous
        for name, value in self._patched.items():
            setattr(config, name, value)
        self.active = False
        handler = torch._dynamo.callback.callback_handler
        if self._start in handler.start_callbacks:
            handler.remove_start_callback(self._start)
        if self._end in handler.end_callbacks:
            handler.remove_end_callback(self._end)
        if self in _installations:
            _installations.remove(self)

    @staticmethod
    def _cache_hits() -> int:
        from torch._dynamo.utils import counters

        return (counters["inductor"]["fxgraph_cache_hit"]
                + counters["aot_autograd"]["autograd_cache_hit"])

    def note_compile(self, compile_id: str | None) -> None:
        """A compile is under way (called from the pass's uuid): arm the callbacks and take
        the cache counters' baseline if its start was missed (callbacks cleared by a reset)."""
        self.arm()
        if compile_id is not None and compile_id not in self._hits:
            self._hits[compile_id] = self._cache_hits()

    def _on_compile_start(self, args) -> None:
        self._hits[_compile_id() or args.compile_id] = self._cache_hits()

    def _on_compile_end(self, args) -> None:
        """A compile that hit Inductor's caches ran no pass: give it a report saying so."""
        key = _compile_id() or args.compile_id
        before = self._hits.pop(key, None)
        if before is None or self._cache_hits() == before:
            return
        with _unbound_lock:
            if key in _unbound:
                return  # the passes ran for (part of) this compile
            report = Report(options=self.options.cache_key(), cached=True)
            _unbound[key] = report
            for inst in _installations:
                inst.reports.append(report)
        record_report(report)
        log.info("leancompile: compile %s served from Inductor's cache; passes not rerun",
                 args.compile_id)

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def install(**options) -> Installation:
    """Hook leancompile's passes into Inductor for trainers that already call
    ``torch.compile``: a plain call installs until ``.uninstall()``; ``with install(...):``
    installs for the block. A pass already installed runs first, and is restored on exit.

    Takes ``disable``, ``overlap``, ``schedule``; the compiler is the caller's (Inductor).
    """
    if "compiler" in options:
        raise TypeError("install() hooks into Inductor, so it takes no compiler option; use "
                        "torch.compile(..., backend=leancompile.backend(compiler=...)) instead")
    return Installation(no_schedule(CompileOptions.from_kwargs(**options), "install()"))
