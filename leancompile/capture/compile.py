"""Compiling one traced graph, after leancompile's pipeline, into a function of its flat
inputs (``compile_graph``): ``aot_eager`` runs the pipeline on the graph and runs it as it is
(frameless); ``inductor`` lowers it with ``compile_fx_inner``, the pipeline as Inductor's
custom post-grad pass.

Under a profiler, each run of a compiled graph is one range named
``leancompile.<phase>_graph`` (``forward``, ``backward`` or ``inference``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..runtime.frameless import frameless

__all__ = ["compile_graph"]


def compile_graph(graph: fx.GraphModule | None, phase: str, *, compiler: str,
                  graph_pass) -> Callable | None:
    """``graph`` (of ``phase``: ``forward``, ``backward`` or ``inference``) through
    ``graph_pass`` (a ``LeanGraphPass``) and ``compiler``: ``run(args) -> outputs`` on the
    flat inputs as a list, or None when there is no graph."""
    run = _compiled(graph, phase, compiler, graph_pass)
    if run is None:
        return None
    label = f"leancompile.{phase}_graph"  # a profiler range per graph run (traces)
    profiling = torch._C._autograd._profiler_enabled

    def traced(args):
        if not profiling():  # (opening a range costs ~20 us, as much as a small graph)
            return run(args)
        with torch.profiler.record_function(label):
            return run(args)
    return traced


def _compiled(graph, phase, compiler, graph_pass):
    if graph is None:
        return None
    if compiler == "aot_eager":
        graph.graph.eliminate_dead_code()
        graph_pass.run_previous(graph.graph, is_inference=phase == "inference")
        graph_pass.run(graph, phase=phase)  # regenerates the code once, after the passes
        run = frameless(graph)  # no Python frame per op (runtime/frameless.py)
        return lambda args: run(*args)
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    from ..passes import inductor_patches

    fakes = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in fakes if hasattr(v, "fake_mode")), None)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    with V.set_fake_mode(fake_mode), inductor_config.patch(inductor_patches(graph_pass)):
        out = compile_fx_inner(graph, fakes, is_backward=phase == "backward",
                               is_inference=phase == "inference")
    if counters["inductor"]["fxgraph_cache_hit"] > hits:
        # Inductor's FX graph cache served the code (its key covers the graph and our
        # pass's uuid: options, sources, rank), so our pipeline did not run: run it here on
        # the graph as Inductor hands it to its post-grad passes (views as reshapes, dead code
        # out), for what it records (the report, the LeanGRPO stage's row layouts) and not
        # for the code.
        view_to_reshape(graph)
        graph.graph.eliminate_dead_code()
        graph_pass.run_previous(graph.graph, is_inference=phase == "inference")
        graph_pass.run(graph, phase=phase, recompile=False).cached = True
    return lambda args: out(list(args))
