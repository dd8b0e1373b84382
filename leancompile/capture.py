"""Capture one Dynamo graph into forward, backward and inference graphs through AOTAutograd,
the pass pipeline and the compiler, with what the LeanGRPO step wrapper needs to know about them.

``capture_graph(gm, example_inputs, ...)`` (called from the Dynamo backend of
``leancompile.lean.LeanStep``) traces the graph once, with gradients, with Inductor's
decompositions and the min-cut partitioner; the inference graph is the forward graph without
what it saves for the backward (``without_saved``). It runs leancompile's pipeline on each
graph and compiles it (``aot_eager``: as it is; ``inductor``: ``compile_fx_inner`` with the
pipeline as its custom post-grad pass). The result, ``StepGraphs``, has the three graphs with
their calling conventions made explicit:

- ``run_forward(args) -> (*outputs, *saved)``
- ``run_backward(saved for the backward, in its order + cotangents) -> one gradient (or None)
  per input``
- ``run_inference(args) -> outputs``

where ``args`` are the flat inputs Dynamo passes (parameters, buffers, arguments, sizes). Runtime
code calls these graphs directly: that is what lets a schedule run the forward now and the
backward later (Retain), or the backward at once with a provisional cotangent (Reweight). Also
recorded: each input's role (its source, whether dim 0 is the batch), what the LeanGRPO stage
found (row layouts of outputs and saved tensors), the bytes the saved tensors hold beyond the
inputs (exactly, as a function of the batch size), a structural fingerprint of what the graph
computes (to match a rollout call with an update call), and any random op.
"""

from __future__ import annotations

import copy

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from .passes.row_layout import size_in_batch
from .runtime.frameless import frameless

__all__ = ["RandomOpInGraphError", "InputRole", "StepGraphs", "capture_graph"]

log = logging.getLogger("leancompile")

_VIEW_TARGETS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.permute.default, torch.ops.aten.t.default,
    torch.ops.aten.transpose.int, torch.ops.aten.expand.default, torch.ops.aten.alias.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.as_strided.default, torch.ops.aten.detach.default,
}


_SAME_VALUE = {torch.ops.aten.alias.default, torch.ops.aten.detach.default}


class RandomOpInGraphError(RuntimeError):
    """The captured step draws random numbers: two runs of it would not be the same forward."""


def _alias_root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEW_TARGETS:
        node = node.args[0]
    return node


def _draws_random(node: fx.Node) -> bool:
    """A seeded op draws random numbers unless its dropout probability is 0 (attention ops
    carry the tag for their ``dropout_p``) or it runs with ``train=False``. A random op that
    activation checkpointing recomputes in the backward is wrapped by the partitioner
    (``run_and_save_rng_state(aten.rand, ...)``): it draws as the op it wraps."""
    if isinstance(node.target, torch._ops.HigherOrderOperator) and \
            "rng_state" in node.target.name():
        op = _wrapped_op(node)
        return op is None or torch.Tag.nondeterministic_seeded in op.tags
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    values = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    if values.get("train") is False:
        return False
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)):
            return values[name] != 0
    return True


def _wrapped_op(node: fx.Node):
    """The op a higher-order wrapper node calls (``run_and_save_rng_state(aten.rand, ...)``)."""
    return next((a for a in node.args if isinstance(a, torch._ops.OpOverload)), None)


def _describe(node: fx.Node) -> str:
    target, meta = node.target, node.meta
    if isinstance(target, torch._ops.HigherOrderOperator):  # a random op checkpointing redraws
        target = _wrapped_op(node) or target
        # The partitioner moved the op's metadata to the getitem that returns its value.
        meta = next((u.meta for u in node.users if u.args[1:] == (1,)), meta)
    text = f"{node.name} ({target})"
    stack = meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].strip("'>"))
        text += f" in {path} ({cls_name})"
    return text


def _random_ops(gm: fx.GraphModule) -> list[str]:
    return [_describe(n) for n in gm.graph.nodes if n.op == "call_function" and _draws_random(n)]


# ---------------------------------------------------------------------------------------------
# Capture of one Dynamo graph, for the LeanGRPO step wrapper (``leancompile/lean``)


@dataclass(frozen=True, kw_only=True)
class InputRole:
    """One flat input of a Dynamo graph (what Dynamo passes its compiled function)."""

    source: str
    """Dynamo's name for where the value comes from (``L['x']``,
    ``L['self']._modules['fc']._parameters['weight']``)."""
    kind: str
    """``param`` (an ``nn.Parameter``), ``buffer``, ``tensor`` (an argument or other tensor),
    ``symint`` (a size) or ``other``."""
    batch_rows: int = 0
    """Rows per sample when dim 0 is the batch (a batch-major input), else 0."""


@dataclass(kw_only=True)
class StepGraphs:
    """The forward, backward and inference graphs of one Dynamo graph, after the pass
    pipeline, with their calling conventions and what the LeanGRPO stage found.

    ``run_forward(args) -> outputs + saved``, ``run_backward(saved_for_bw + cotangents) ->
    one gradient (or None) per input`` and ``run_inference(args) -> outputs`` take the flat
    inputs Dynamo passes (``roles``) as a list."""

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
    layouts: dict = field(default_factory=dict)
    """From the LeanGRPO stage: ``outputs`` and ``saved`` layouts (``RowLayout``, ``Mixed``,
    ``None`` for batch-independent, ``"symint"``) and ``row_local`` (bool) with ``reason``."""
    saved_meta: list = field(default_factory=list)
    """Per saved value, its fake value (shapes with the batch symbol)."""
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
    """Outputs whose gradient flows through the drawn sample (``_sample_gradient_outputs``):
    an update passing the sample back cannot reuse this graph's forward."""
    kept_roots: dict = field(default_factory=dict)
    """Storages the saved tensors live in that are not inputs (or views of inputs): name ->
    bytes (an int, or a sympy expression of ``batch_symbol``)."""
    backward_aten: fx.GraphModule | None = None
    """The backward graph as aten ops that run eagerly (after the pipeline with ``aot_eager``;
    before Inductor's lowering otherwise): what batched Reweight runs under ``torch.func.vmap``
    (one batch-1 backward per row, vectorised)."""
    traced_frozen: list[int] = field(default_factory=list)
    """Tensor inputs that did not require grad when the graphs were traced: the backward
    computes no gradient for them (``leancompile/lean`` refuses a call where one now does)."""
    _kept_bytes_at: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """``kept_bytes`` by batch (substituting into sympy expressions costs milliseconds, and the
    trainer and the wrapper ask on every call)."""

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

    def fingerprints_at(self, args) -> tuple[tuple, tuple]:
        """(fingerprint, sample fingerprint) of this graph traced with concrete ``args`` (real
        tensors): what a graph Dynamo specialised for those sizes (a batch of 1) computes, to
        compare with one."""
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        with tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True))):
            captured = _trace(self.dynamo_graph, args, {"enable_autograd_cache": False})
        graph = captured["inference"][0]
        fingerprint, _ = _structural_hashes(graph, self.roles)
        sample = ()
        if self.sample_output is not None:
            sample, _ = _structural_hashes(graph, self.roles, cut=self.sample_output)
        return fingerprint, sample


_IN_PLACE_OPERATORS = {"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod",
                       "ipow", "imatmul", "iand", "ior", "ixor", "ilshift", "irshift"}
_VIEWS = {"view", "reshape", "getitem", "__getitem__", "transpose", "permute", "unsqueeze",
          "squeeze", "select", "narrow", "expand", "flatten", "unflatten", "t", "view_as",
          "movedim", "swapaxes", "diagonal", "unbind", "split", "chunk", "as_strided"}


def _name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _writes_in_place(node: fx.Node) -> bool:
    """A Dynamo-graph op that writes into its first argument (``x.add_(y)``, ``x += y``)."""
    name = _name(node)
    return node.op in ("call_function", "call_method") and (
        name.strip("_") in _IN_PLACE_OPERATORS or name.endswith("_") and not name.endswith("__"))


def _sample_gradient_outputs(gm: fx.GraphModule, sample_output: int | None) -> list[int]:
    """The outputs (other than ``sample_output``) that the drawn sample reaches through values
    that require grad, in the Dynamo graph ``gm`` (traced with gradients on): their gradient
    flows through the sample. An update that passes the sample back holds it constant, so such
    a rollout graph's backward is not the update's (FlowGRPO's and DanceGRPO's steps detach the
    sample where the log-prob reads it; a step that does not must be recomputed).

    Conservative: a value that requires grad and reads a reached value is reached (an op that
    does not differentiate through that input still counts), and an in-place op on a reached
    value marks the tensor it writes into."""
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if sample_output is None or sample_output >= len(outs) or \
            not isinstance(outs[sample_output], fx.Node):
        return []

    def requires_grad(node) -> bool:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value.requires_grad
        # a tuple of tensors (split, chunk): its getitems decide; sizes and flags carry none
        return isinstance(value, (list, tuple)) and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in value)

    sample = outs[sample_output]
    reached = {sample} if requires_grad(sample) else set()
    for node in gm.graph.nodes:
        if not reached:
            break
        if node in reached or node.op in ("placeholder", "output"):
            continue
        if not any(a in reached for a in node.all_input_nodes):
            continue
        if requires_grad(node):
            reached.add(node)
        if _writes_in_place(node):  # (x[i] = sample returns nothing, and writes into x)
            # later readers of the written tensor (and of what it views) see the sample
            written = node.args[0] if node.args else None
            while isinstance(written, fx.Node):
                reached.add(written)
                written = written.args[0] if _name(written) in _VIEWS and written.args \
                    else None
    return [i for i, o in enumerate(outs)
            if i != sample_output and isinstance(o, fx.Node) and o in reached]


def _role(node: fx.Node, value) -> InputRole:
    arg = node.meta.get("grapharg")
    source = arg.source.name if arg is not None and getattr(arg, "source", None) is not None \
        else node.name
    if node.meta.get("leancompile_sample"):  # the update's sample argument (leancompile/lean)
        source = "<sample>"
    if isinstance(value, torch.nn.Parameter):
        kind = "param"
    elif isinstance(value, torch.Tensor):
        kind = "buffer" if "_buffers" in source else "tensor"
    elif isinstance(value, (int, torch.SymInt)):
        kind = "symint"
    else:
        kind = "other"
    return InputRole(source=source, kind=kind)


def _fake(node: fx.Node, value):
    """A placeholder's value as Dynamo traced it (symbolic sizes), else the example value."""
    fake = node.meta.get("example_value")
    return fake if fake is not None else value


def _batch_symbol(fakes, roles):
    for value, role in zip(fakes, roles):
        if role.kind == "tensor" and isinstance(value, torch.Tensor) and value.dim():
            d0 = value.shape[0]
            if isinstance(d0, torch.SymInt) and d0.node.expr.is_Symbol:
                return d0.node.expr
    return None


def _structural_hashes(gm: fx.GraphModule, roles: list[InputRole], cut: int | None = None):
    """(hash of each output, indices of the inputs the outputs depend on): a Merkle hash of the
    computation behind every output, placeholders named by their role's source, so that two
    traces of the same code hash alike whatever their node names. With ``cut``, that output's
    node counts as an input named ``<sample>`` (what it computes is not compared) and is not
    followed to the inputs."""
    import hashlib

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {p: i for i, p in enumerate(placeholders)}
    outs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    cut_node = outs[cut] if cut is not None and isinstance(outs[cut], fx.Node) else None
    memo: dict[fx.Node, str] = {}

    def value(a) -> str:
        if isinstance(a, fx.Node):
            return memo[a]
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(value(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{value(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, torch.SymInt):
            return f"sym({a.node.expr})"
        return repr(a)

    for node in gm.graph.nodes:  # topological: every input is hashed before its users
        if node.op == "output":
            continue
        if node is cut_node:
            memo[node] = "<sample>"
        elif node.op == "call_function" and node.target in _SAME_VALUE:
            memo[node] = memo[node.args[0]]  # an alias computes nothing
        elif node.op == "placeholder":
            source = roles[index[node]].source
            memo[node] = source if source == "<sample>" else f"in({source})"
        else:
            text = f"{node.op}:{node.target}:{value(node.args)}:{value(node.kwargs)}"
            memo[node] = hashlib.sha256(text.encode()).hexdigest()[:32]
    hashes = tuple(value(o) for o in outs)
    reached, seen = set(), set()
    stack = [o for o in outs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or node is cut_node:
            continue
        seen.add(node)
        if node.op == "placeholder":
            reached.add(index[node])
        stack.extend(node.all_input_nodes)
    return hashes, sorted(reached)


def _backward_saved_order(saved: list, bw_names: list[str]) -> list[int]:
    """For each saved input of the backward (its placeholders but the cotangents), the index
    of that value among the forward's saved outputs. The partitioner names them alike, except
    the generator states of random ops that activation checkpointing recomputes: the forward
    returns ``getitem(run_and_save_rng_state(...), 0)`` and the backward takes
    ``rng_state_output_<k>``, in the same order."""
    position = {node.name: i for i, node in enumerate(saved)}
    states = iter([i for i, node in enumerate(saved)
                   if node.op == "call_function" and node.args
                   and isinstance(node.args[0], fx.Node)
                   and isinstance(node.args[0].target, torch._ops.HigherOrderOperator)
                   and node.args[0].target.name() == "run_and_save_rng_state"
                   and node.args[1] == 0])
    order = []
    for name in bw_names:
        if name in position:
            order.append(position[name])
        elif name.startswith("rng_state_output_"):
            order.append(next(states))
        else:
            raise RuntimeError(
                f"the backward graph takes {name!r}, which is not among what the forward "
                f"saves ({[n.name for n in saved]}); please report this graph")
    return order


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


def _trace(gm: fx.GraphModule, inputs, patches: dict, regather: set[int] | None = None,
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
        from .passes.regather_params import partition_with_regather

        captured["regather"] = []
        partition_fn = partition_with_regather(partition_fn, params=regather,
                                               record=captured["regather"], static=held)
    # Effect tokens (ops with side effects, e.g. linalg.inv's error checks) made and sunk inside
    # the graphs, as Inductor has them: no extra token inputs or outputs to account for.
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                       unlift_effect_tokens=True, **patches), \
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


def capture_graph(gm: fx.GraphModule, example_inputs, *, graph_pass, compiler: str,
                  sample_output: int | None = None,
                  memory_budget: float | None = None,
                  reshard_after_forward: bool = False) -> StepGraphs:
    """Trace a Dynamo graph through AOTAutograd into forward + backward graphs and an inference
    graph (the forward without what it saves, ``without_saved``; a traced one when nothing
    needs gradients), run ``graph_pass`` (leancompile's pipeline, a
    ``LeanGraphPass``) on each and compile them with ``compiler`` (``aot_eager``: as they are;
    ``inductor``: ``compile_fx_inner``, our pipeline as its custom post-grad pass).

    A symbolic dim 0 of the tensor arguments is the batch: the LeanGRPO stage of the pipeline
    finds which saved tensors hold it row by row (``passes/row_layout.py``).

    ``reshard_after_forward``: parameters all-gathered inside the step are gathered again in
    the backward instead of saved full-size (``passes/regather_params.py``; ``regather`` in
    the result says which)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roles = [_role(p, v) for p, v in zip(placeholders, example_inputs)]
    fakes = [_fake(p, v) for p, v in zip(placeholders, example_inputs)]
    symbol = _batch_symbol(fakes, roles)
    if symbol is not None:
        roles = [InputRole(source=r.source, kind=r.kind, batch_rows=1)
                 if r.kind == "tensor" and isinstance(v, torch.Tensor) and v.dim()
                 and isinstance(v.shape[0], torch.SymInt) and v.shape[0].node.expr == symbol
                 # The batch size itself: one name whichever argument Dynamo read it from.
                 else InputRole(source="<batch>", kind=r.kind)
                 if isinstance(v, torch.SymInt) and v.node.expr == symbol
                 else r for r, v in zip(roles, fakes)]
    patches = {"enable_autograd_cache": False}
    if memory_budget is not None:  # the partitioner saves less and recomputes more
        patches["activation_memory_budget"] = memory_budget
    params = {i for i, r in enumerate(roles) if r.kind == "param"}
    captured = _trace(gm, example_inputs, patches,
                      regather=params if reshard_after_forward else None,
                      held={i for i, r in enumerate(roles) if r.kind == "buffer"})
    regather = captured["regather"][-1] if captured.get("regather") else None
    inference, inf_inputs = captured["inference"]
    fingerprint, reached = _structural_hashes(inference, roles)
    sample_fp, sample_keys = (), []
    if sample_output is not None and sample_output < len(fingerprint):
        sample_fp, sample_reached = _structural_hashes(inference, roles, cut=sample_output)
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
    random_ops: list[str] = []
    if "backward" in captured and fw_meta is not None:
        forward, _ = captured["forward"]
        backward, _ = captured["backward"]
        if fw_meta.num_mutated_inp_runtime_indices or fw_meta.num_intermediate_bases:
            raise ValueError(
                "the wrapped function mutates an input in place or returns a view of an "
                "intermediate; return fresh tensors (e.g. .clone()) and do not write into its "
                "arguments")
        num_outputs = len(fw_meta.output_info)
        for i, info in enumerate(fw_meta.output_info):
            kind = info.output_type.name
            if kind in ("non_alias", "unsafe_view_alias", "custom_function_view"):
                continue
            if kind == "is_input":
                output_types[i], output_bases[i] = "input", info.base_idx
            elif kind == "alias_of_input":
                output_types[i], output_bases[i] = "view", info.base_idx
            else:
                raise ValueError(f"output {i} of the wrapped function aliases an intermediate "
                                 f"({kind}); return a fresh tensor (e.g. .clone())")
        differentiable = [i for i, info in enumerate(fw_meta.output_info) if info.requires_grad]
        fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        saved_names = [n.name for n in fw_out[num_outputs:]]
        bw_placeholders = [n.name for n in backward.graph.nodes if n.op == "placeholder"
                           and not n.name.startswith("tangents")]
        bw_saved = _backward_saved_order(fw_out[num_outputs:], bw_placeholders)
        random_ops = _random_ops(forward)
        forward.meta["lean_grpo"] = {
            "num_outputs": num_outputs, "batch_symbol": symbol,
            "batch_inputs": {i: r.batch_rows for i, r in enumerate(roles) if r.batch_rows}}
    else:
        random_ops = _random_ops(inference)

    def compiled(graph, inputs, phase):
        run = _compiled(graph, inputs, phase)
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

    def _compiled(graph, inputs, phase):
        if graph is None:
            return None
        if compiler == "aot_eager":
            graph.graph.eliminate_dead_code()
            graph_pass.run_previous(graph.graph, is_inference=phase == "inference")
            graph_pass.run(graph, phase=phase)  # regenerates the code once, after the passes
            run = frameless(graph)  # no Python frame per op (runtime/frameless.py)
            return lambda args: run(*args)
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.virtualized import V

        from torch._dynamo.utils import counters

        fakes = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
        fake_mode = next((v.fake_mode for v in fakes if hasattr(v, "fake_mode")), None)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        with V.set_fake_mode(fake_mode), inductor_config.patch(
                post_grad_custom_pre_pass=graph_pass):
            out = compile_fx_inner(graph, fakes, is_backward=phase == "backward",
                                   is_inference=phase == "inference")
        if counters["inductor"]["fxgraph_cache_hit"] > hits:
            # Inductor's FX graph cache served the code (its key covers the graph and our
            # pass's uuid: options, sources, rank), so our pipeline did not run: run it here on
            # the same graph, as Inductor would have (dead code out first), for what it records
            # (the report, the LeanGRPO stage's row layouts) and not for the code.
            graph.graph.eliminate_dead_code()
            graph_pass(graph.graph, is_inference=phase == "inference")
        return lambda args: out(list(args))

    run_forward = compiled(forward, None, "forward")
    layouts = dict(forward.meta.get("lean_grpo", {}).get("layouts", {})) \
        if forward is not None else {}
    saved_meta, kept_roots = [], {}
    if forward is not None:
        fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        saved_meta = [n.meta.get("val") for n in fw_out[num_outputs:]]
        for node in fw_out[num_outputs:]:
            if not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            root = _alias_root(node)
            if root.op != "placeholder":
                kept_roots[root.name] = size_in_batch(
                    root.meta["val"].untyped_storage().nbytes(), symbol)
    # The backward as AOTAutograd made it, before the pipeline's passes (Inductor rewrites the
    # graph it lowers; aot_eager's passes rewrite it in place): what Reweight's per-row
    # backward is traced from. FlashOverlap's P2P schedules have no batching rule, and under
    # parallel="fsdp" Reweight takes the gradient reductions out of this graph instead.
    backward_aten = copy.deepcopy(backward) if backward is not None else None
    run_backward = compiled(backward, None, "backward")
    run_inference = compiled(inference, inf_inputs, "inference")
    return StepGraphs(
        roles=roles, num_outputs=num_outputs, output_types=output_types,
        output_bases=output_bases, differentiable=differentiable, saved_names=saved_names,
        bw_saved=bw_saved, run_forward=run_forward, run_backward=run_backward,
        run_inference=run_inference, forward=forward, backward=backward, inference=inference,
        batch_symbol=symbol, layouts=layouts, saved_meta=saved_meta, fingerprint=fingerprint,
        sample_fingerprint=sample_fp, key_inputs=key_inputs, sample_key_inputs=sample_keys,
        random_ops=random_ops, dynamo_graph=gm, sample_output=sample_output,
        sample_grad_outputs=_sample_gradient_outputs(gm, sample_output),
        kept_roots=kept_roots, backward_aten=backward_aten, regather=regather,
        traced_frozen=[i for i, v in enumerate(example_inputs)
                       if isinstance(v, torch.Tensor) and not v.requires_grad])
