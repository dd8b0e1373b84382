"""One AOTAutograd trace of a Dynamo graph into forward, backward and inference graphs
(``aot_trace``), and the inference graph made from the forward (``without_saved``).

``capture_graph`` (``assemble.py``) and ``StepGraphs.fingerprints_at`` (``step_graphs.py``)
both trace through ``aot_trace``, so the fingerprints they take compare.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

__all__ = ["aot_trace", "without_saved"]


def without_saved(forward: fx.GraphModule, num_outputs: int) -> fx.GraphModule:
    """The inference graph of a step that has a backward: a copy of its forward graph that
    returns the first ``num_outputs`` outputs (the function's own) and not the tensors saved for
    the backward, dead code removed. No-grad calls then run the ops of the grad calls, and
    the capture does not trace the function a second time (about a fifth of its
    cost)::

        def forward(primals_1, primals_2):            def forward(primals_1, primals_2):
            mm = aten.mm(primals_2, primals_1)            mm = aten.mm(primals_2, primals_1)
            tanh = aten.tanh(mm)               ->         tanh = aten.tanh(mm)
            return (tanh, primals_2, tanh)                return (tanh,)
    """
    graph = copy.deepcopy(forward)
    output = next(n for n in graph.graph.nodes if n.op == "output")
    total = len(output.args[0])
    output.args = (tuple(output.args[0][:num_outputs]),)
    for key, value in list(output.meta.items()):  # per-output metadata (val, desc, ...)
        if isinstance(value, (list, tuple)) and len(value) == total:
            output.meta[key] = type(value)(value[:num_outputs])
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph


def aot_trace(gm: fx.GraphModule, inputs, patches: dict, regather: set[int] | None = None,
              held: set[int] = frozenset()) -> dict:
    """One AOTAutograd trace of ``gm`` (Inductor's decompositions, the min-cut partitioner),
    with gradients when an input needs them: ``{"forward", "backward", "inference": (graph,
    inputs), "meta": the forward's ViewAndMutationMeta}``, the inference graph
    ``without_saved`` when there is a backward. ``capture_graph`` and
    ``StepGraphs.fingerprints_at`` trace alike, so their fingerprints compare. ``regather``:
    the input positions of parameters whose all-gathers the backward recomputes
    (``passes/regather_params.py``; what it found is ``captured["regather"]``), ``held``
    those of buffers (what the recomputed nodes may read besides)."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import TracingContext
    from torch._inductor.decomposition import select_decomp_table

    captured: dict = {}

    def keep(name):
        def compiler_fn(graph, graph_inputs):
            captured[name] = (graph, graph_inputs)
            if name == "forward":
                ctx = TracingContext.try_get()
                captured["meta"] = ctx.fw_metadata if ctx is not None else None
            return make_boxed_func(graph.forward)
        return compiler_fn

    needs_grad = any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs)
    partition_fn = min_cut_rematerialization_partition
    if regather is not None:
        from ..passes.regather_params import partition_with_regather

        captured["regather"] = []
        partition_fn = partition_with_regather(partition_fn, params=regather,
                                               record=captured["regather"], static=held)
    # Effect tokens (ops with side effects, e.g. linalg.inv's error checks) made and sunk inside
    # the graphs, as Inductor has them: no extra token inputs or outputs to account for.
    # No donated buffers: Inductor's backward would reuse saved tensors' storage as scratch,
    # and a kept call's backward may run again (loss.backward(retain_graph=True) twice reads
    # the same kept tensors; a second backward read overwritten ones).
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                       unlift_effect_tokens=True, donated_buffer=False,
                                       **patches), \
            torch.set_grad_enabled(needs_grad):
        aot_module_simplified(
            gm, list(inputs), fw_compiler=keep("forward"), bw_compiler=keep("backward"),
            inference_compiler=keep("inference"),
            partition_fn=partition_fn, decompositions=select_decomp_table())
    if "backward" in captured and captured.get("meta") is not None:
        forward, fw_inputs = captured["forward"]
        captured["inference"] = (
            without_saved(forward, len(captured["meta"].output_info)), fw_inputs)
    return captured
