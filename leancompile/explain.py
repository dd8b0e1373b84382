"""``explain``: the graphs a compile would produce, before and after every pass, without
running the model.

``explain(fn, *args)`` compiles ``fn`` with a backend that goes through exactly the backend's
capture path (Dynamo, AOTAutograd with Inductor's decompositions and partitioner, our
pipeline as Inductor's custom post-grad pass) but stops before code generation; the backward
graph is traced at compile time instead of at the first ``backward()``. The compiled function
then returns uninitialised tensors of the right shapes instead of computing, so ``args`` may be
real tensors, meta tensors (with a module built on the meta device) or fake tensors.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from .compiler import LeanGraphPass, aot_eager
from .report import Report, record_report
from .options import CompileOptions

__all__ = ["explain"]

log = logging.getLogger("leancompile")


class _CaptureBackend:
    def __init__(self, options: CompileOptions, report: Report):
        self.options = options
        self.report = report
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph_pass = LeanGraphPass(
            self.options, previous=torch._inductor.config.post_grad_custom_pre_pass,
            report=self.report, graph_index=self.graphs)
        self.graphs += 1
        if self.options.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            def inner_compile(graph_module, inputs, **kwargs):
                # What Inductor does to the graph before its custom pass (compile_fx_inner's
                # view_to_reshape, post_grad_passes' DCE), then the custom pass itself.
                from torch._inductor.fx_passes.post_grad import view_to_reshape

                view_to_reshape(graph_module)
                graph_module.graph.eliminate_dead_code()
                graph_pass(graph_module.graph, is_inference=kwargs.get("is_inference", False))
                graph_module.recompile()
                return _no_compute(graph_module)

            compile_fx(gm, example_inputs, inner_compile=inner_compile,
                       config_patches={"post_grad_custom_pre_pass": graph_pass})
        else:
            aot_eager(graph_pass)(gm, example_inputs)
        return _no_compute(gm, dynamo=True)


def _no_compute(gm: fx.GraphModule, dynamo: bool = False):
    """A stand-in for a compiled graph: outputs of the right metadata, uninitialised."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    key = "example_value" if dynamo else "val"

    def empty(node):
        if not isinstance(node, fx.Node):
            return node
        value = node.meta.get(key, node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                      device=value.device)
            if dynamo and value.requires_grad:
                out.requires_grad_(True)
            return out
        return value

    def run(*args):
        if args and isinstance(args[0], list) and not dynamo:  # boxed calling convention
            args[0].clear()
        return tree_map(empty, output.args[0])

    run._boxed_call = not dynamo
    return run


def _realise(arg):
    """Fake tensors become uninitialised real tensors of the same metadata (no compute)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(arg, FakeTensor):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            out = torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype,
                                      device=arg.device)
        return out.requires_grad_(arg.requires_grad) if arg.is_floating_point() else out
    return arg


def explain(fn_or_module, *example_args, **options):
    """Trace ``fn_or_module(*example_args)`` as leancompile would compile it and report what
    every pass did to the forward and backward (or inference) graphs.

    An object with its own ``explain_schedules`` (a ``GRPOTrainer``, a ``LeanStep`` from
    ``lean_compile(fn, schedule=...)``) explains itself: ``explain(trainer, conditions)`` returns
    the trainer's ``ScheduleReport`` (the LeanGRPO plans, their memory and time estimates, the
    choice), ``explain(step, *args)`` the step's ``StepReport``.

    ``options`` are leancompile's (``compiler``, ``disable``, ``overlap``, ``schedule``);
    ``compiler`` (default ``"inductor"``) decides which capture path is mirrored. Nothing is
    computed: see the module docstring. Returns a ``Report`` (also ``last_report()``).
    """
    own = getattr(fn_or_module, "explain_schedules", None)
    if callable(own):  # a trainer or a LeanStep: its schedules
        return own(*example_args, **options)
    if not callable(fn_or_module):
        raise TypeError(
            f"explain needs a function or torch.nn.Module to trace, got "
            f"{type(fn_or_module).__name__} ({fn_or_module!r:.80}); pass the callable itself, "
            "then its example arguments: explain(model, x)")
    opts = CompileOptions.from_kwargs(**options)
    report = Report(options=opts.cache_key())
    capture = _CaptureBackend(opts, report)
    args = tree_map(_realise, example_args)
    compiled = torch.compile(fn_or_module, backend=capture)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                       enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False), torch.enable_grad():
        compiled(*args)
    if not report.graphs:
        raise RuntimeError(
            f"explain captured no graph from {fn_or_module!r:.80}: Dynamo compiled nothing "
            "(the whole call ran in Python, or this code object hit Dynamo's recompile limit; "
            "torch._dynamo.reset() clears it)")
    record_report(report)
    return report
