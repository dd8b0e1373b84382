"""What ``capture_graph`` returns (``StepGraphs``): the forward, backward and inference graphs
of one Dynamo graph, compiled, with their calling conventions and what the LeanGRPO stage found.

Its three functions take the flat inputs Dynamo passes (``roles``) as a list::

    run_forward(args)                        -> (*outputs, *saved)
    run_backward([saved[i] for i in bw_saved] + cotangents)
                                             -> one gradient (or None) per input
    run_inference(args)                      -> outputs
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from .conventions import kept_storage
from .fingerprint import structural_hashes
from .roles import InputRole
from .trace import aot_trace

__all__ = ["StepGraphs", "relaid_saved"]


@dataclass(kw_only=True)
class StepGraphs:
    """The forward, backward and inference graphs of one Dynamo graph, after the pass
    pipeline, with their calling conventions and what the LeanGRPO stage found.

    ``run_forward(args) -> outputs + saved``, ``run_backward(saved_for_bw + cotangents) ->
    one gradient (or None) per input`` and ``run_inference(args) -> outputs`` take the flat
    inputs Dynamo passes (``roles``) as a list.

    Each graph goes through the pipeline and the compiler on its first run (or ``compile()``):
    the update graph of a step whose update calls all reuse the rollout's never compiles its
    own forward and backward, and a graph never run under ``no_grad`` never compiles its
    inference graph. ``layouts``, ``saved_meta``, ``kept_roots`` and ``kept_bytes`` (what the
    pipeline finds in the forward) compile the forward when read; ``forward``, ``backward`` and
    ``inference`` are the graphs after the pipeline once compiled, before it until then."""

    roles: list[InputRole]
    num_outputs: int
    output_types: list[str]
    """Per user output: ``fresh``, ``input`` (the input at ``output_bases[i]`` itself) or
    ``view`` (a view of that input)."""
    output_bases: list[int | None]
    differentiable: list[int]
    """The outputs whose cotangents the backward takes, in order."""
    saved_names: list[str]
    bw_saved: list[int]
    """For each saved value the backward takes, in its order, the index into ``saved``."""
    run_forward: Callable | None
    run_backward: Callable | None
    run_inference: Callable
    forward: fx.GraphModule | None
    backward: fx.GraphModule | None
    inference: fx.GraphModule
    batch_symbol: object = None
    fingerprint: tuple = ()
    """Hashes of what each output computes from the inputs' roles (inference graph)."""
    sample_fingerprint: tuple = ()
    """The same with ``sample_output`` treated as an input (see ``leancompile/lean``)."""
    key_inputs: list[int] = field(default_factory=list)
    """Inputs the outputs depend on (parameters excluded)."""
    sample_key_inputs: list[int] = field(default_factory=list)
    """The same for ``sample_fingerprint`` (what the outputs but the sample depend on)."""
    random_ops: list[str] = field(default_factory=list)
    report: object = None
    regather: object = None
    """``RegatherFound`` (``passes/regather_params.py``) when captured with
    ``reshard_after_forward=True``: the parameters' gathers the backward runs again."""
    dynamo_graph: fx.GraphModule | None = None
    """The Dynamo graph itself (``fingerprints_at``)."""
    sample_output: int | None = None
    sample_grad_outputs: list[int] = field(default_factory=list)
    """Outputs whose gradient flows through the drawn sample (``sample_gradient_outputs``,
    ``fingerprint.py``): an update passing the sample back cannot reuse this graph's forward."""
    backward_aten: fx.GraphModule | None = None
    """The backward graph as aten ops that run eagerly (after the pipeline with ``aot_eager``;
    before Inductor's lowering otherwise): what batched Reweight runs under ``torch.func.vmap``
    (one batch-1 backward per row, vectorised)."""
    traced_frozen: list[int] = field(default_factory=list)
    """Tensor inputs that did not require grad when the graphs were traced: the backward
    computes no gradient for them (``leancompile/lean`` refuses a call where one now does)."""
    _found: dict | None = field(default=None, init=False, repr=False, compare=False)
    """What the pipeline found in the forward (``layouts``, ``saved_meta``, ``kept_roots``), or
    None until the forward is compiled."""
    _pending: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Phase -> the graph not compiled yet, with the contexts it was traced under."""
    _compile_graph: Callable | None = field(default=None, init=False, repr=False,
                                            compare=False)
    saved_relaid: frozenset | None = field(default=None, init=False, repr=False, compare=False)
    """Once the forward is compiled: the saved values (indices into ``saved``) whose strides the
    compiled forward may return other than traced (Inductor's layout optimisation lays a
    convolution's tensors out its own way), from the strides Inductor reports for the forward's
    outputs; None when no report came (``aot_eager``, no tracing context), so that every saved
    tensor is checked. The backward compiled here asserts the traced strides
    (``leancompile/lean/runtime.py`` lays those out as traced before it runs)."""
    _kept_bytes_at: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """``kept_bytes`` by batch (substituting into sympy expressions costs milliseconds, and the
    trainer and the wrapper ask on every call)."""

    def defer_compile(self, compile_graph: Callable) -> None:
        """Set ``run_forward``, ``run_backward`` and ``run_inference`` (each graph there is) to
        compile their graph with ``compile_graph(graph, phase) -> run`` on their first call.
        Dynamo's tracing and compile contexts of now are entered again then, as AOTAutograd
        does for the backward it compiles lazily."""
        from torch._guards import CompileContext, TracingContext

        self._compile_graph = compile_graph
        contexts = (TracingContext.try_get(), CompileContext.try_get())
        for phase in ("forward", "backward", "inference"):
            if getattr(self, phase) is None:
                continue
            self._pending[phase] = contexts
            setattr(self, f"run_{phase}", _FirstRun(self, phase))
        if self.forward is None:
            self._found = {"layouts": {}, "saved_meta": [], "kept_roots": {}}

    def compile(self, *phases: str) -> None:
        """Run the pipeline and the compiler on the graphs of ``phases`` (``forward``,
        ``backward``, ``inference``; all by default) not compiled yet. The backward compiles
        after the forward, in the order a capture always had."""
        from torch._guards import TracingContext, compile_context, tracing

        for phase in phases or ("forward", "backward", "inference"):
            if phase == "backward":
                self.compile("forward")
            contexts = self._pending.get(phase)
            if contexts is None:
                continue
            tracing_context, compile_ctx = contexts
            strides = None
            with contextlib.ExitStack() as stack:
                # (a first run under torch.inference_mode(): Inductor's fake tensors and
                # constants must not be inference tensors)
                stack.enter_context(torch.inference_mode(False))
                if tracing_context is not None:
                    stack.enter_context(tracing(tracing_context))
                    if phase == "forward":  # (Inductor reports its outputs' strides there)
                        strides = stack.enter_context(TracingContext.report_output_strides())
                if compile_ctx is not None:
                    stack.enter_context(compile_context(compile_ctx))
                run = self._compile_graph(getattr(self, phase), phase)
            del self._pending[phase]
            setattr(self, f"run_{phase}", run)
            if phase == "forward":
                self.saved_relaid = relaid_saved(self.forward, self.num_outputs, strides)
                saved_meta, kept_roots = kept_storage(self.forward, self.num_outputs,
                                                      self.batch_symbol)
                self._found = {
                    "layouts": dict(self.forward.meta.get("lean_grpo", {}).get("layouts", {})),
                    "saved_meta": saved_meta, "kept_roots": kept_roots}

    @property
    def compiled(self) -> set[str]:
        """The phases whose graph is compiled (a phase with no graph counts as compiled)."""
        return {p for p in ("forward", "backward", "inference") if p not in self._pending}

    def _forward_found(self) -> dict:
        if self._found is None:
            self.compile("forward")
        return self._found

    @property
    def layouts(self) -> dict:
        """From the LeanGRPO stage: ``outputs`` and ``saved`` layouts (``RowLayout``,
        ``Mixed``, ``None`` for batch-independent, ``"symint"``) and ``row_local`` (bool) with
        ``reason``."""
        return self._forward_found()["layouts"]

    @property
    def saved_meta(self) -> list:
        """Per saved value, its fake value (shapes with the batch symbol)."""
        return self._forward_found()["saved_meta"]

    @property
    def kept_roots(self) -> dict:
        """Storages the saved tensors live in that are not inputs (or views of inputs): name
        -> bytes (an int, or a sympy expression of ``batch_symbol``)."""
        return self._forward_found()["kept_roots"]

    def kept_bytes(self, batch: int) -> int:
        """Bytes a forward's saved tensors hold beyond its inputs, for ``batch`` rows: each
        storage once (a view costs nothing of its own)."""
        total = self._kept_bytes_at.get(batch)
        if total is not None:
            return total
        total = 0
        for nbytes in self.kept_roots.values():
            if not isinstance(nbytes, int):  # a sympy expression of the batch size
                nbytes = nbytes.subs({self.batch_symbol: batch})
            total += int(nbytes)
        self._kept_bytes_at[batch] = total
        return total

    @property
    def trainable(self) -> bool:
        return self.run_backward is not None

    @property
    def passthrough_fingerprint(self) -> tuple:
        """``sample_fingerprint`` without the sample's entry: what an update graph computes
        when the step returns its sample argument itself (FlowGRPO's SDE step returns the
        ``prev_sample`` it was given). Dynamo returns such an input outside the graph, so that
        graph has one output fewer; ``()`` when the sample output is not the sample alone."""
        return without_sample(self.sample_fingerprint, self.sample_output)

    def fingerprints_at(self, args) -> tuple[tuple, tuple]:
        """(fingerprint, sample fingerprint) of this graph traced with concrete ``args`` (real
        tensors): what a graph Dynamo specialised for those sizes (a batch of 1) computes, to
        compare with one."""
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        with tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True))):
            captured = aot_trace(self.dynamo_graph, args, {"enable_autograd_cache": False})
        graph = captured["inference"][0]
        fingerprint, _ = structural_hashes(graph, self.roles)
        sample = ()
        if self.sample_output is not None:
            sample, _ = structural_hashes(graph, self.roles, cut=self.sample_output)
        return fingerprint, sample


def relaid_saved(forward: fx.GraphModule, num_outputs: int, strides) -> frozenset | None:
    """The saved values of ``forward`` (indices into ``saved``) that the compiled forward may
    return with other strides than traced, given ``strides`` (per output of the forward, the
    strides the compiler reported at the traced sizes; an empty list or None: no report, so
    None, every saved value to be checked). A saved value whose traced strides are all plain
    integers equal to the reported ones in every dim longer than 1 has the traced layout; one
    with a symbolic stride (a layout that is not batch-major) or no reported stride is checked
    on every call."""
    outputs = next(n for n in reversed(forward.graph.nodes) if n.op == "output").args[0]
    if not strides or len(strides) != len(outputs):
        return None
    relaid = set()
    for k, node in enumerate(outputs[num_outputs:]):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        real = strides[num_outputs + k]
        if not isinstance(val, torch.Tensor):
            continue
        if real is None:  # (a stride Inductor could not state: a data-dependent size)
            relaid.add(k)
            continue
        for size, traced, got in zip(val.shape, val.stride(), real):
            if isinstance(size, torch.SymInt) and size.node.hint is not None:
                size = size.node.hint
            if isinstance(traced, torch.SymInt) or isinstance(got, torch.SymInt) or (
                    isinstance(size, int) and size > 1 and traced != got):
                relaid.add(k)
                break
    return frozenset(relaid)


def without_sample(fingerprint: tuple, sample_output: int | None) -> tuple:
    """A sample fingerprint without its sample output's entry (``passthrough_fingerprint``);
    ``()`` when that output is not the sample alone."""
    j = sample_output
    if not fingerprint or j is None or j >= len(fingerprint) or fingerprint[j] != "<sample>":
        return ()
    return fingerprint[:j] + fingerprint[j + 1:]


class _FirstRun:
    """``run_<phase>`` of a ``StepGraphs`` until its graph is compiled: compiles it (which
    puts the compiled function in its place) and runs that."""

    __slots__ = ("graphs", "phase")

    def __init__(self, graphs: StepGraphs, phase: str):
        self.graphs, self.phase = graphs, phase

    def __call__(self, args):
        self.graphs.compile(self.phase)
        return getattr(self.graphs, f"run_{self.phase}")(args)
