"""Capture a step module into forward, backward and inference graphs through AOTAutograd.

``capture_step(module, args)`` traces ``module(*args)`` once with gradients and once without,
with Inductor's decompositions and the min-cut partitioner, and returns the three graphs with
their calling conventions made explicit:

- ``forward``: ``(*params_and_buffers, *args) -> (*outputs, *saved)``
- ``backward``: ``(*saved, *cotangents of the differentiable outputs) -> (*grads of params and
  buffers, *grads of args)`` (``None`` where an input needs no gradient)
- ``inference``: ``(*params_and_buffers, *args) -> (*outputs,)``

Runtime code calls these graphs directly: that is what lets a schedule run the forward now and
the backward later (Retain), or the backward at once with a provisional cotangent (Reweight).
The saved tensors are described from the graph's own metadata (shape, dtype, bytes, and
whether a saved value is an input or a view of one, which costs no memory of its own).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["SavedTensor", "CapturedStep", "capture_step", "RandomOpInGraphError",
           "module_input_names", "module_inputs"]

log = logging.getLogger("leancompile")

_VIEW_TARGETS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.permute.default, torch.ops.aten.t.default,
    torch.ops.aten.transpose.int, torch.ops.aten.expand.default, torch.ops.aten.alias.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.as_strided.default, torch.ops.aten.detach.default,
}


class RandomOpInGraphError(RuntimeError):
    """The captured step draws random numbers: two runs of it would not be the same forward."""


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    """One tensor the forward graph saves for the backward graph."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    """Bytes of the tensor itself (numel * element size)."""
    aliases_input: str | None
    """The input placeholder this tensor is, or is a view of; such a tensor costs no memory
    beyond the input, which the caller holds anyway."""
    root: str
    """The node whose storage this tensor lives in (itself, unless it is a view)."""
    root_nbytes: int
    """Bytes of that storage: what keeping this tensor alive really holds."""


@dataclass(kw_only=True)
class CapturedStep:
    """The graphs of one step module for one set of input shapes."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    inference: fx.GraphModule
    input_names: list[str]
    """Primal order: ``named_parameters()``, then ``named_buffers()``, then ``arg<i>``."""
    num_module_inputs: int
    """How many leading primals are parameters and buffers."""
    num_outputs: int
    differentiable_outputs: list[int]
    """Indices of the outputs that get a cotangent in the backward graph, in order."""
    saved: list[SavedTensor]
    memory_budget: float | None = None
    random_ops: list[str] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        """Activation bytes a kept step holds: the storages of the saved tensors that are not
        inputs or views of inputs, each storage counted once."""
        roots = {s.root: s.root_nbytes for s in self.saved if s.aliases_input is None}
        return sum(roots.values())

    @property
    def saved_input_bytes(self) -> int:
        """Bytes of saved tensors that are inputs (or views of them): held by the caller."""
        roots = {s.root: s.root_nbytes for s in self.saved if s.aliases_input is not None}
        return sum(roots.values())


def module_input_names(module: torch.nn.Module) -> list[str]:
    """The leading primals of the captured graphs, in AOTAutograd's order: parameters, then
    buffers, duplicates (tied weights) kept under each name."""
    return (list(dict(module.named_parameters(remove_duplicate=False)))
            + list(dict(module.named_buffers(remove_duplicate=False))))


def module_inputs(module: torch.nn.Module, replace: dict | None = None) -> list[torch.Tensor]:
    """The tensors for those primals, optionally with some replaced by name (a reference
    model's weights, say)."""
    named = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    if replace:
        named.update(replace)
    return list(named.values())


def _nbytes(value) -> int:
    return value.numel() * value.element_size()


def _alias_root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEW_TARGETS:
        node = node.args[0]
    return node


def _draws_random(node: fx.Node) -> bool:
    """A seeded op draws random numbers unless its dropout probability is 0 (attention ops
    carry the tag for their ``dropout_p``) or it runs with ``train=False``."""
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


def _describe(node: fx.Node) -> str:
    text = f"{node.name} ({node.target})"
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].strip("'>"))
        text += f" in {path} ({cls_name})"
    return text


def _random_ops(gm: fx.GraphModule) -> list[str]:
    return [_describe(n) for n in gm.graph.nodes if n.op == "call_function" and _draws_random(n)]


def capture_step(module: torch.nn.Module, args, *, memory_budget: float | None = None,
                 allow_random: bool = False) -> CapturedStep:
    """Trace ``module(*args)`` (tensors only) into forward/backward/inference graphs.

    ``memory_budget`` (0..1) is the partitioner's activation memory budget: below 1 the
    min-cut partitioner saves less and recomputes more in the backward graph. Random ops in the
    graph raise ``RandomOpInGraphError`` unless ``allow_random``.
    """
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import TracingContext, tracing
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = list(args)
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"capture_step takes tensor arguments only; argument {i} is "
                            f"{type(a).__name__}")
    captured: dict = {}

    def keep(name):
        def compiler(gm, example_inputs):
            captured[name] = gm
            if name == "forward":
                ctx = TracingContext.try_get()
                captured["meta"] = ctx.fw_metadata if ctx is not None else None
            return make_boxed_func(gm.forward)
        return compiler

    def trace(grad: bool):
        patches = {"force_non_lazy_backward_lowering": True, "enable_autograd_cache": False}
        if memory_budget is not None:
            patches["activation_memory_budget"] = memory_budget
        with torch._functorch.config.patch(**patches), \
                tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True))), \
                torch.set_grad_enabled(grad):
            aot_module_simplified(
                module, args, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                inference_compiler=keep("inference"),
                partition_fn=min_cut_rematerialization_partition,
                decompositions=select_decomp_table())

    trace(grad=True)
    if "backward" not in captured:
        raise ValueError("the step has nothing to differentiate: no parameter of the module "
                         "(or argument) that requires grad reaches its outputs")
    trace(grad=False)
    forward, backward, meta = captured["forward"], captured["backward"], captured["meta"]

    random_ops = _random_ops(forward)
    if random_ops and not allow_random:
        dropouts = [f"{name} ({type(m).__name__}, p={m.p})" for name, m in module.named_modules()
                    if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training
                    and m.p > 0]
        where = f"; dropout in training mode at {', '.join(dropouts)}" if dropouts else ""
        raise RandomOpInGraphError(
            f"the captured step draws random numbers ({', '.join(random_ops)}{where}): running it "
            "again would not reproduce the rollout's forward, so its graph cannot be reused. "
            "Call model.eval() (dropout), or pass the noise in as an argument.")

    names = module_input_names(module)
    input_names = names + [f"arg{i}" for i in range(len(args))]
    num_outputs = len(meta.output_info)
    if meta.num_mutated_inp_runtime_indices:
        raise ValueError("the step mutates its inputs in place; capture a function that "
                         "returns new tensors instead")
    aliased = [i for i, o in enumerate(meta.output_info)
               if o.output_type.name not in ("non_alias",)]
    if aliased:
        raise ValueError(f"outputs {aliased} of the step alias an input or another output; "
                         "return fresh tensors (e.g. .clone()) from the step")
    differentiable = [i for i, o in enumerate(meta.output_info) if o.requires_grad]

    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    placeholder_names = {p: input_names[i] for i, p in enumerate(placeholders)}
    fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    saved = []
    for node in fw_out[num_outputs:]:
        value = node.meta["val"]
        root = _alias_root(node)
        root_value = root.meta["val"]
        saved.append(SavedTensor(
            name=node.name, shape=tuple(value.shape), dtype=value.dtype, nbytes=_nbytes(value),
            aliases_input=placeholder_names.get(root), root=root.name,
            root_nbytes=root_value.untyped_storage().nbytes()))
    bw_tangents = [n for n in backward.graph.nodes
                   if n.op == "placeholder" and n.name.startswith("tangents")]
    assert len(bw_tangents) == len(differentiable), (len(bw_tangents), differentiable)
    return CapturedStep(
        forward=forward, backward=backward, inference=captured["inference"],
        input_names=input_names, num_module_inputs=len(names), num_outputs=num_outputs,
        differentiable_outputs=differentiable, saved=saved, memory_budget=memory_budget,
        random_ops=random_ops)
