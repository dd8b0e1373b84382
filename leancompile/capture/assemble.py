"""``capture_graph``: one Dynamo graph traced through AOTAutograd (``trace.py``), its inputs'
roles and fingerprints taken (``roles.py``, ``fingerprint.py``), its calling conventions read
(``conventions.py``), each graph through the pipeline and compiled (``compile.py``), all
gathered in a ``StepGraphs`` (``step_graphs.py``)::

    Dynamo graph --aot_trace--> forward, backward, inference (the forward without_saved)
        --> roles, fingerprints, output aliases, saved order, random ops
        --compile_graph (pipeline + aot_eager / Inductor), each graph on its first use
            (``StepGraphs.compile``)--> run_forward, run_backward, run_inference; the row
            layouts and kept bytes the pipeline's LeanGRPO stage found in the forward
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from .compile import compile_graph
from .conventions import output_aliases, saved_order
from .fingerprint import sample_gradient_outputs, structural_hashes
from .random_ops import random_ops
from .roles import input_roles
from .step_graphs import StepGraphs
from .trace import aot_trace

__all__ = ["capture_graph"]


def capture_graph(gm: fx.GraphModule, example_inputs, *, graph_pass, compiler: str,
                  sample_output: int | None = None,
                  memory_budget: float | None = None,
                  reshard_after_forward: bool = False,
                  batch: int | None = None) -> StepGraphs:
    """Trace a Dynamo graph through AOTAutograd into forward + backward graphs and an inference
    graph (the forward without what it saves, ``without_saved``; a traced one when nothing
    needs gradients), each to run ``graph_pass`` (leancompile's pipeline, a ``LeanGraphPass``)
    and compile with ``compiler`` (``aot_eager``: as they are; ``inductor``:
    ``compile_fx_inner``, our pipeline as its custom post-grad pass) on its first run, or
    at ``StepGraphs.compile()``.

    A symbolic dim 0 of the tensor arguments is the batch: the LeanGRPO stage of the pipeline
    finds which saved tensors hold it row by row (``passes/row_layout.py``).

    ``reshard_after_forward``: parameters all-gathered inside the step are gathered again in
    the backward instead of saved full-size (``passes/regather_params.py``; ``regather`` in
    the result says which). ``batch``: the traced call's batch size, where known (a symbolic
    dim 0 of another size is then not taken for the batch: ``input_roles``)."""
    roles, symbol = input_roles(gm, example_inputs, batch=batch)
    _refuse_wrapper_subclasses(example_inputs, roles)
    patches = {"enable_autograd_cache": False}
    if memory_budget is not None:  # the partitioner saves less and recomputes more
        patches["activation_memory_budget"] = memory_budget
    params = {i for i, r in enumerate(roles) if r.kind == "param"}
    captured = aot_trace(gm, example_inputs, patches,
                         regather=params if reshard_after_forward else None,
                         held={i for i, r in enumerate(roles) if r.kind == "buffer"})
    regather = captured["regather"][-1] if captured.get("regather") else None
    inference, inf_inputs = captured["inference"]
    fingerprint, reached = structural_hashes(inference, roles)
    sample_fp, sample_keys = (), []
    if sample_output is not None and sample_output < len(fingerprint):
        sample_fp, sample_reached = structural_hashes(inference, roles, cut=sample_output)
        sample_keys = [i for i in sample_reached if roles[i].kind != "param"]
    key_inputs = [i for i in reached if roles[i].kind != "param"]

    fw_meta = captured.get("meta")
    forward = backward = None
    num_outputs = len(next(n for n in inference.graph.nodes if n.op == "output").args[0])
    output_types: list[str] = ["fresh"] * num_outputs
    output_bases: list[int | None] = [None] * num_outputs
    differentiable: list[int] = []
    saved_names: list[str] = []
    bw_saved: list[int] = []
    if "backward" in captured and fw_meta is not None:
        forward, _ = captured["forward"]
        backward, _ = captured["backward"]
        output_types, output_bases = output_aliases(fw_meta, [r.source for r in roles])
        num_outputs = len(fw_meta.output_info)
        differentiable = [i for i, info in enumerate(fw_meta.output_info) if info.requires_grad]
        saved_names, bw_saved = saved_order(forward, backward, num_outputs)
        drawn = random_ops(forward)
        forward.meta["lean_grpo"] = {
            "num_outputs": num_outputs, "batch_symbol": symbol,
            "batch_inputs": {i: r.batch_rows for i, r in enumerate(roles) if r.batch_rows}}
    else:
        drawn = random_ops(inference)

    # The graphs compile on first use (``StepGraphs.compile``): an update graph whose calls all
    # reuse the rollout's never runs its own forward or backward, and a step never called
    # under no_grad never runs its inference graph.
    # The backward as AOTAutograd made it, before the pipeline's passes (Inductor rewrites the
    # graph it lowers; aot_eager's passes rewrite it in place): what Reweight's per-row
    # backward is traced from. FlashOverlap's P2P schedules have no batching rule, and under
    # parallel="fsdp" Reweight takes the gradient reductions out of this graph instead.
    backward_aten = copy.deepcopy(backward) if backward is not None else None
    graphs = StepGraphs(
        roles=roles, num_outputs=num_outputs, output_types=output_types,
        output_bases=output_bases, differentiable=differentiable, saved_names=saved_names,
        bw_saved=bw_saved, run_forward=None, run_backward=None,
        run_inference=None, forward=forward, backward=backward, inference=inference,
        batch_symbol=symbol, fingerprint=fingerprint,
        sample_fingerprint=sample_fp, key_inputs=key_inputs, sample_key_inputs=sample_keys,
        random_ops=drawn, dynamo_graph=gm, sample_output=sample_output,
        sample_grad_outputs=sample_gradient_outputs(gm, sample_output),
        backward_aten=backward_aten, regather=regather,
        traced_frozen=[i for i, v in enumerate(example_inputs)
                       if isinstance(v, torch.Tensor) and not v.requires_grad])
    graphs.defer_compile(lambda graph, phase: compile_graph(
        graph, phase, compiler=compiler, graph_pass=graph_pass))
    return graphs


def _refuse_wrapper_subclasses(example_inputs, roles) -> None:
    """A tensor subclass that wraps inner tensors (``__tensor_flatten__``: DTensor, torch's
    ``TwoTensor``) reaches the traced graphs as its inner tensors, one graph input each, where
    the step keys rows, fingerprints and kept tensors by the call's own inputs (it raised an
    internal ``IndexError``). Refused with the inputs named and the fix."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    wrapped = [f"{roles[i].source} ({type(v).__name__})" for i, v in enumerate(example_inputs)
               if is_traceable_wrapper_subclass(v)]
    if wrapped:
        raise TypeError(
            f"LeanGRPO's step takes plain tensors; {', '.join(wrapped[:4])} "
            f"{'is a tensor subclass' if len(wrapped) == 1 else 'are tensor subclasses'} "
            "that wraps inner tensors: pass the plain tensors (a DTensor's .to_local() or "
            ".full_tensor()), or compile with plain torch.compile")
