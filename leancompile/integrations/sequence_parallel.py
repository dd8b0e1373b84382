"""Ulysses sequence parallelism for diffusers transformers, with gradients.

``parallelize_ulysses(transformer, group)`` makes every rank of ``group`` hold the whole model
and 1/N of the token sequence (N ranks). Per attention that needs every token, the ranks
exchange query, key and value from "my tokens, all heads" to "all tokens, my heads" with one
all-to-all each, run the model's own attention on H/N heads, and exchange the result back
(DeepSpeed-Ulysses)::

    q, k, v   [B, S/N, H, D]   (this rank's tokens)
      -> all_to_all ->  [B, S, H/N, D]  -> attention  -> [B, S, H/N, D]
      -> all_to_all ->  [B, S/N, H, D]

Everything else in these DiTs is per token (projections, norms, modulation, MLPs, RoPE at the
tokens' own positions), so it runs on the local tokens unchanged. Where the sequence is split
and gathered is the model class's own context-parallel plan (``_cp_plan``, which diffusers keeps
for FLUX, Wan, SD3 and others): inputs named there are cut into N equal pieces along their
sequence dimension on the way in, and the output named there is gathered on the way out.

The collectives are torch's functional collectives, differentiable, so ``torch.compile`` traces
them into the forward graph and AOTAutograd puts their transposes into the backward graph:
FlashOverlap (``overlap="flash"``) then sees the all-to-alls of both directions. The output
gather's backward hands each rank the gradient of its own tokens (every rank computes the same
loss from the gathered output); parameter gradients are then partial sums over each rank's
tokens: ``SequenceParallel.sync_grads()`` (or any data-parallel reduction that sums over
``group``) completes them.

Which attention calls become Ulysses attention is decided the way diffusers decides it for its
own context parallelism: the attention processors pass their ``_parallel_config`` to
``dispatch_attention_fn`` exactly where the attention spans the sequence that is split (FLUX's
joint attention, Wan's self-attention) and ``None`` elsewhere (Wan's cross-attention to the
unsplit text, whose queries are local: no exchange needed). The processor classes run
unchanged; only the ``dispatch_attention_fn`` they call is ours.

Token order: with the sequence split per rank, FLUX's joint sequence becomes
``[text_0; image_0; text_1; image_1; ...]`` after the exchange instead of ``[text; image]``;
attention without a mask does not depend on the order of keys (up to the summation order of
the softmax), and each query's row is its own, so outputs agree with one process within float
tolerance.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..passes.row_layout import declare_same_rows, forget_same_rows

__all__ = ["SequenceParallel", "parallelize_ulysses", "ulysses_attention"]


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """The functional all-gather along dim 0: ``all_gather_single`` (torch 2.13), named
    ``all_gather_tensor`` before (same arguments and traced ops along dim 0)."""
    funcol = _funcol()
    if hasattr(funcol, "all_gather_single"):
        return funcol.all_gather_single(x, 0, group)
    return funcol.all_gather_tensor(x, 0, group)


def _waited(x: torch.Tensor) -> torch.Tensor:
    funcol = _funcol()
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all over dim 0 of a contiguous ``[N, ...]`` tensor: piece j goes to rank j, and
    piece j of the result came from rank j. Differentiable (its transpose is itself)."""
    return _waited(_funcol().all_to_all_single(x.contiguous(), None, None, group))


def seq_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[B, S/N, H, D]`` (local tokens, all heads) -> ``[B, S, H/N, D]`` (all tokens in rank
    order, heads ``r*H/N .. (r+1)*H/N``)."""
    b, s, h, d = x.shape
    pieces = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4)  # [N, B, s, H/N, D]
    out = _exchange(pieces, group)                                         # [N(src), B, s, H/N, D]
    return out.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def heads_to_seq(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[B, S, H/N, D]`` -> ``[B, S/N, H, D]``: the inverse of ``seq_to_heads``."""
    b, s_all, h, d = x.shape
    s = s_all // world
    pieces = x.reshape(b, world, s, h, d).permute(1, 0, 2, 3, 4)  # [N(dst), B, s, H/N, D]
    out = _exchange(pieces, group)                               # [N(src heads), B, s, H/N, D]
    return out.permute(1, 2, 0, 3, 4).reshape(b, s, world * h, d)


def ulysses_attention(query, key, value, group, attention, *, world: int | None = None):
    """``attention(q, k, v)`` over the whole sequence for sequence-sharded ``[B, S/N, H, D]``
    inputs: all-to-all to ``[B, S, H/N, D]``, ``attention`` on this rank's heads, all-to-all
    back. Heads must be divisible by the group size."""
    world = dist.get_world_size(group) if world is None else world
    heads = query.shape[2]
    if heads % world or key.shape[2] % world:
        raise ValueError(f"Ulysses attention splits heads over the {world} ranks of the group: "
                         f"query has {heads} heads and key {key.shape[2]}, not divisible by "
                         f"{world}. Use a group whose size divides the head count.")
    q, k, v = (seq_to_heads(t, group, world) for t in (query, key, value))
    return heads_to_seq(attention(q, k, v), group, world)


def _gather_tokens(x: torch.Tensor, dim: int, group, rank: int, world: int) -> torch.Tensor:
    """All-gather along ``dim``, differentiable as "keep this rank's piece of the gradient":
    every rank computes the same function of the gathered tensor, so nothing is summed. The
    own piece is ``x`` itself (the gathered copy of it is dropped), the others come from the
    collective without a gradient: plain ops, so any tracer (Dynamo, AOTAutograd, the
    LeanGRPO capture) derives the same backward."""
    pieces = x.movedim(dim, 0).contiguous()  # the functional all-gather joins along dim 0
    gathered = _waited(_all_gather_dim0(pieces.detach(), group))
    parts = [pieces if j == rank else part for j, part in enumerate(gathered.chunk(world, 0))]
    return torch.cat(parts, 0).movedim(0, dim)


@dataclass(frozen=True)
class _UlyssesConfig:
    """What our ``dispatch_attention_fn`` finds in a processor's ``_parallel_config``."""

    group: object
    world: int


def _dispatch_for(original):
    """A ``dispatch_attention_fn`` that runs Ulysses attention when the processor hands it our
    config, and ``original`` unchanged otherwise."""

    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        def local(q, k, v, mask=attn_mask):
            return original(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
                            attention_kwargs, backend=backend, parallel_config=None)

        if not isinstance(parallel_config, _UlyssesConfig):
            return local(query, key, value)
        if attn_mask is not None:
            raise NotImplementedError(
                "Ulysses attention with an attention mask: the mask would have to be gathered "
                "along the key sequence and split along the query sequence; not supported. "
                "Run without a mask (FLUX and Wan text-to-image/video need none).")
        return ulysses_attention(query, key, value, parallel_config.group,
                                 lambda q, k, v: local(q, k, v, None), world=parallel_config.world)

    return dispatch


_PROCESSOR_CLASSES: dict[type, type] = {}


def _ulysses_processor_class(cls: type) -> type:
    """A subclass of a diffusers attention processor whose ``__call__`` is the original code
    with our ``dispatch_attention_fn`` in its globals (nothing else changes).

    The globals are those of a module registered under its own name (a copy of the processor's
    module with the one name replaced): ``torch.compile`` finds a function's globals by its
    module's name when it guards on them."""
    if cls in _PROCESSOR_CLASSES:
        return _PROCESSOR_CLASSES[cls]
    call = cls.__call__
    if "dispatch_attention_fn" not in call.__code__.co_names:
        raise NotImplementedError(
            f"{cls.__name__} does not call diffusers' dispatch_attention_fn, so its attention "
            "cannot be made sequence parallel here. Use a processor that does (the default "
            "ones of FLUX, Wan and SD3 in diffusers >= 0.35 do).")
    source = call.__globals__
    name = f"{__name__}._ulysses_{source['__name__'].replace('.', '_')}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in source.items()
                                if k not in ("__name__", "__spec__", "__loader__")})
        module.dispatch_attention_fn = _dispatch_for(source["dispatch_attention_fn"])
        sys.modules[name] = module
    new_call = types.FunctionType(call.__code__, module.__dict__, call.__name__,
                                  call.__defaults__, call.__closure__)
    new_call.__kwdefaults__ = call.__kwdefaults__
    sub = type(f"Ulysses{cls.__name__}", (cls,), {"__call__": new_call, "__module__": name})
    _PROCESSOR_CLASSES[cls] = sub
    return sub


class SequenceParallel:
    """What ``parallelize_ulysses`` did to a model; ``undo()`` takes it back out."""

    def __init__(self, model: nn.Module, group, rank: int, world: int):
        self.model, self.group, self.rank, self.world = model, group, rank, world
        self.handles: list = []
        self.processors: dict[str, object] = {}  # attention module name -> original processor
        self.declared = False
        """Whether ``group`` is declared to hold the same rows (``declare_same_rows``)."""

    def sync_grads(self, params=None) -> None:
        """Sum the parameters' ``.grad`` over the group (each rank's holds its tokens' part):
        after it every rank has the gradient one process computes on the whole sequence."""
        params = self.model.parameters() if params is None else params
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)

    def undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        modules = dict(self.model.named_modules())
        for name, processor in self.processors.items():
            modules[name].processor = processor
        self.handles, self.processors = [], {}
        if self.declared:
            forget_same_rows(self.group)
            self.declared = False
        self.model._leancompile_sequence_parallel = None


def _split(x: torch.Tensor, dim: int, rank: int, world: int, where: str) -> torch.Tensor:
    if x.shape[dim] % world:
        raise ValueError(f"{where}: dimension {dim} has {x.shape[dim]} tokens, not divisible "
                         f"by the {world} ranks of the sequence-parallel group. Pick a "
                         "resolution / text length whose token counts divide the group size.")
    return x.chunk(world, dim=dim)[rank]


def _applies(x, plan) -> bool:
    return torch.is_tensor(x) and (plan.expected_dims is None or x.dim() == plan.expected_dims)


def parallelize_ulysses(transformer: nn.Module, group=None) -> SequenceParallel:
    """Make a diffusers transformer sequence parallel over ``group`` (default: the world).

    Before (one process)::

        out = transformer(hidden_states=x, encoder_hidden_states=text, ...)   # all tokens

    After, on every rank of ``group`` with the same inputs::

        sp = parallelize_ulysses(transformer, group)
        out = transformer(hidden_states=x, encoder_hidden_states=text, ...)   # same ``out``
        loss(out).backward(); sp.sync_grads()                                 # same grads

    Inside, each rank computes 1/N of the tokens and each full-sequence attention exchanges
    heads and tokens with two all-to-alls per tensor. Needs the model class's ``_cp_plan``
    (diffusers' context-parallel plan), head counts and the split token counts divisible by N.
    Returns a ``SequenceParallel`` (``sync_grads``, ``undo``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("parallelize_ulysses needs torch.distributed initialized "
                           "(torchrun, or dist.init_process_group) with the ranks to split over.")
    model = transformer
    plan = getattr(type(model), "_cp_plan", None)
    if not plan:
        raise NotImplementedError(
            f"{type(model).__name__} has no _cp_plan (diffusers' context-parallel plan that says "
            "where the sequence is split and gathered); supported: FLUX, Wan, SD3 and the other "
            "diffusers transformers that define one.")
    if getattr(model, "_leancompile_sequence_parallel", None) is not None:
        raise RuntimeError("this model is already sequence parallel; call undo() on the first "
                           "SequenceParallel before parallelizing it again")
    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    from diffusers.models._modeling_parallel import ContextParallelOutput

    sp = SequenceParallel(model, group, rank, world)
    modules = dict(model.named_modules())
    for name, entry in plan.items():
        if name not in modules:
            raise ValueError(f"{type(model).__name__}._cp_plan names module {name!r}, which "
                             "this model does not have")
        module = modules[name]
        where = f"{type(model).__name__}.{name or 'forward'}"
        if isinstance(entry, (ContextParallelOutput, list, tuple)):
            outs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
            sp.handles.append(module.register_forward_hook(_gather_hook(outs, sp)))
            continue
        inputs = {k: v for k, v in entry.items() if not v.split_output}
        outputs = {k: v for k, v in entry.items() if v.split_output}
        if inputs:
            sp.handles.append(module.register_forward_pre_hook(
                _split_inputs_hook(module, inputs, sp, where), with_kwargs=True))
        if outputs:
            sp.handles.append(module.register_forward_hook(_split_outputs_hook(outputs, sp, where)))
    config = _UlyssesConfig(group, world)
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(type(processor), "_parallel_config"):
            continue
        heads = getattr(module, "heads", None)
        if heads is not None and heads % world:
            sp.undo()
            raise ValueError(f"{name}: {heads} attention heads are not divisible by the {world} "
                             "ranks of the sequence-parallel group (Ulysses gives each rank "
                             "heads/N heads). Use a group whose size divides the head count.")
        sp.processors[name] = processor
        cls = _ulysses_processor_class(type(processor))
        new = cls.__new__(cls)  # the same state, the subclass's __call__
        new.__dict__.update(processor.__dict__)
        new._parallel_config = config
        module.processor = new
    # Its ranks run the same samples: LeanGRPO may follow rows through its all-to-alls.
    declare_same_rows(group)
    sp.declared = True
    model._leancompile_sequence_parallel = sp
    return sp


def _split_inputs_hook(module: nn.Module, inputs: dict, sp: SequenceParallel, where: str):
    import inspect

    names = list(inspect.signature(module.forward).parameters)

    def hook(mod, args, kwargs):
        args = list(args)
        for name, plan in inputs.items():
            if name in kwargs:
                if _applies(kwargs[name], plan):
                    kwargs[name] = _split(kwargs[name], plan.split_dim, sp.rank, sp.world,
                                          f"{where}({name})")
            elif name in names and names.index(name) < len(args):
                i = names.index(name)
                if _applies(args[i], plan):
                    args[i] = _split(args[i], plan.split_dim, sp.rank, sp.world,
                                     f"{where}({name})")
        return tuple(args), kwargs

    return hook


def _split_outputs_hook(outputs: dict, sp: SequenceParallel, where: str):
    def hook(mod, args, output):
        single = torch.is_tensor(output)
        out = [output] if single else list(output)
        for index, plan in outputs.items():
            if _applies(out[index], plan):
                out[index] = _split(out[index], plan.split_dim, sp.rank, sp.world,
                                    f"{where} output {index}")
        return out[0] if single else type(output)(out)

    return hook


def _gather_hook(outs: list, sp: SequenceParallel):
    def hook(mod, args, output):
        single = torch.is_tensor(output)
        out = [output] if single else list(output)
        for i, plan in enumerate(outs):
            if plan is not None and _applies(out[i], plan):
                out[i] = _gather_tokens(out[i], plan.gather_dim, sp.group, sp.rank, sp.world)
        return out[0] if single else type(output)(out)

    return hook
