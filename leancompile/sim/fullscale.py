"""Full-size graphs without the memory or the GPUs: trace on the meta device under a fake
process group, then run our passes on the traced post-grad graphs.

``fake_group(world_size)`` is a context in which ``torch.distributed`` has a process group of
``world_size`` ranks that moves no data (torch's ``"fake"`` backend; this process is rank 0).
``trace_graphs(fn, *args)`` compiles ``fn`` with a backend that keeps the post-grad forward and
backward graphs AOTAutograd produces (nothing is compiled further; with meta tensors nothing is
computed either), and ``rewrite(gm, phase, **options)`` runs leancompile's pipeline on a copy.
``tp_mlp(...)`` is the tensor + sequence parallel MLP block of the FlashOverlap paper: all-gather
of the sequence-sharded input, column-parallel matmul, GELU, row-parallel matmul,
reduce-scatter back to sequence shards. ``fake_mesh(dp, tp)`` gives rank 0's two groups of a
``dp x tp`` mesh, on which ``llama_2d_block`` traces a Llama block with FSDP over ``dp`` and
TP+SP over ``tp``.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.fx as fx

__all__ = ["fake_group", "fake_mesh", "trace_graphs", "rewrite", "tp_mlp", "fsdp_mlp",
           "llama_tp_block", "llama_2d_block", "tp_attention"]


@contextlib.contextmanager
def fake_group(world_size: int):
    """A fake process group of ``world_size`` ranks for tracing (this process is rank 0);
    refused when a real one is already initialized (tracing would use it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; trace "
                           "full-size graphs in a process of their own")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_mesh(dp: int, tp: int):
    """``(dp_group, tp_group)``: rank 0's groups of a fake ``dp x tp`` mesh (rank ``i * tp + j``
    at data-parallel index ``i``, tensor-parallel index ``j``, as ``init_device_mesh`` lays out
    ``("dp", "tp")``): the tensor-parallel group is ranks ``0 .. tp-1``, the data-parallel one
    ranks ``0, tp, 2 tp, ...``."""
    if dp < 2 or tp < 2:
        raise ValueError(f"dp={dp} and tp={tp}: a 2-D mesh needs at least 2 ranks on each axis")
    with fake_group(dp * tp):
        yield (dist.new_group(list(range(0, dp * tp, tp))), dist.new_group(list(range(tp))))


def trace_graphs(fn, *args, backward: bool = True, loss=None,
                 inference: bool = False) -> dict[str, fx.GraphModule]:
    """The post-grad ``"forward"`` (and ``"backward"``) graphs of ``fn(*args)``, as the
    compiler would receive them (one graph each: a graph break raises). ``loss``: what is
    backpropagated from the output (default ``out.sum()``). ``inference``: run under
    ``torch.no_grad()`` and return the inference graph as ``"forward"``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: dict[str, list] = {}

    def keep(phase):
        def compiler(gm, example_inputs):
            graphs.setdefault(phase, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    with torch.no_grad() if inference else contextlib.nullcontext():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    if backward and not inference:
        (out.sum() if loss is None else loss(out)).backward()
    torch._dynamo.reset()
    if any(len(v) != 1 for v in graphs.values()):
        raise RuntimeError(f"expected one graph per phase, got { {k: len(v) for k, v in graphs.items()} }")
    return {phase: gms[0] for phase, gms in graphs.items()}


def rewrite(gm: fx.GraphModule, phase: str, **options):
    """(rewritten copy of ``gm``, the pipeline's ``GraphRecord``) under ``CompileOptions``
    ``options`` (e.g. ``overlap="flash"``)."""
    from ..options import CompileOptions
    from ..pipeline import Pipeline

    gm = copy.deepcopy(gm)
    record = Pipeline(CompileOptions(**options)).run(gm, phase=phase)
    return gm, record


def tp_mlp(tp: int, shape: tuple[int, int, int], *, dtype=torch.bfloat16, hidden: int | None = None,
           backward: bool = False, group=None) -> dict[str, fx.GraphModule]:
    """The TP+SP MLP block's graphs for one rank of ``tp``: ``shape`` = (batch, sequence,
    model dim), hidden = 4 x model dim unless given; inputs on the meta device (call inside
    ``fake_group(tp)``)."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    b, s, d = shape
    hidden = 4 * d if hidden is None else hidden
    if (b * s) % tp or hidden % tp:
        raise ValueError(f"tokens {b * s} and hidden {hidden} must divide by tp={tp}")
    group = dist.group.WORLD if group is None else group
    x = torch.empty(b * s // tp, d, device="meta", dtype=dtype, requires_grad=backward)
    w1 = torch.empty(d, hidden // tp, device="meta", dtype=dtype, requires_grad=backward)
    w2 = torch.empty(hidden // tp, d, device="meta", dtype=dtype, requires_grad=backward)

    def block(x, w1, w2):
        gathered = funcol.all_gather_tensor(x, 0, group)
        return funcol.reduce_scatter_tensor(F.gelu(gathered @ w1) @ w2, "sum", 0, group)

    return trace_graphs(block, x, w1, w2, backward=backward)


def fsdp_mlp(world: int, shape: tuple[int, int, int], *, dtype=torch.bfloat16,
             hidden: int | None = None, backward: bool = False,
             group=None) -> dict[str, fx.GraphModule]:
    """An FSDP-style MLP block for one rank of ``world``: the rank's own batch (``shape`` =
    its batch, sequence, model dim), each weight stored as this rank's dim-0 shard and
    all-gathered before its matmul (in the backward: the weight gradients reduce-scattered)."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    b, s, d = shape
    hidden = 4 * d if hidden is None else hidden
    if hidden % world or d % world:
        raise ValueError(f"hidden {hidden} and dim {d} must divide by world={world}")
    group = dist.group.WORLD if group is None else group
    x = torch.empty(b * s, d, device="meta", dtype=dtype, requires_grad=backward)
    w1 = torch.empty(hidden // world, d, device="meta", dtype=dtype, requires_grad=backward)
    w2 = torch.empty(d // world, hidden, device="meta", dtype=dtype, requires_grad=backward)

    def block(x, w1, w2):
        up = funcol.all_gather_tensor_autograd(w1, 0, group)
        down = funcol.all_gather_tensor_autograd(w2, 0, group)
        return F.linear(F.gelu(F.linear(x, up)), down)

    return trace_graphs(block, x, w1, w2, backward=backward)


def llama_tp_block(tp: int, shape: tuple[int, int, int], *, heads: int = 32,
                   dtype=torch.bfloat16, backward: bool = False,
                   group=None) -> dict[str, fx.GraphModule]:
    """A Llama-style transformer block under tensor + sequence parallelism (Megatron-style,
    as torchtitan's TP plan lays it out): the sequence-sharded input is all-gathered before the
    column-parallel QKV and gate/up projections, the row-parallel output and down projections
    are reduce-scattered back to sequence shards; attention (SDPA, causal) and SwiGLU run on
    this rank's heads and hidden columns. ``shape`` = (batch, sequence, model dim), hidden =
    8/3 x dim rounded to a multiple of 256 (Llama 3)."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    b, s, d = shape
    hidden = 256 * ((8 * d // 3 + 255) // 256)
    if heads % tp or hidden % tp or (b * s) % tp:
        raise ValueError(f"heads {heads}, hidden {hidden} and tokens {b * s} must divide by "
                         f"tp={tp}")
    group = dist.group.WORLD if group is None else group
    hd, local_heads = d // heads, heads // tp

    def param(*size):
        return torch.empty(*size, device="meta", dtype=dtype, requires_grad=backward)

    x = torch.empty(b * s // tp, d, device="meta", dtype=dtype, requires_grad=backward)
    weights = [param(3 * local_heads * hd, d), param(d, local_heads * hd),
               param(2 * hidden // tp, d), param(d, hidden // tp)]

    def block(x, wqkv, wo, wgu, wd):
        h = funcol.all_gather_tensor(F.rms_norm(x, (d,)), 0, group)
        q, k, v = F.linear(h, wqkv).view(b, s, 3, local_heads, hd).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        att = att.transpose(1, 2).reshape(b * s, local_heads * hd)
        x = x + funcol.reduce_scatter_tensor(F.linear(att, wo), "sum", 0, group)
        h = funcol.all_gather_tensor(F.rms_norm(x, (d,)), 0, group)
        gate, up = F.linear(h, wgu).chunk(2, dim=-1)
        return x + funcol.reduce_scatter_tensor(F.linear(F.silu(gate) * up, wd), "sum", 0,
                                                group)

    return trace_graphs(block, x, *weights, backward=backward)


def llama_2d_block(dp: int, tp: int, shape: tuple[int, int, int], *, heads: int = 32,
                   dtype=torch.bfloat16, backward: bool = False, dp_group=None,
                   tp_group=None) -> dict[str, fx.GraphModule]:
    """``llama_tp_block`` on a ``dp x tp`` mesh (``fake_mesh``) as SimpleFSDP + TP lays it out:
    each weight's tensor-parallel part is further sharded on dim 0 over ``dp`` and all-gathered
    inside the graph right before its projection (in the backward: its gradient
    reduce-scattered over ``dp``), while the sequence-sharded activations are gathered and the
    projections' outputs reduce-scattered over ``tp``. So the QKV, gate/up, output and down
    projections each read two collectives: an FSDP weight gather and a TP activation gather or
    reduce-scatter. ``shape`` = one data-parallel rank's (batch, sequence, model dim)."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    b, s, d = shape
    hidden = 256 * ((8 * d // 3 + 255) // 256)
    if heads % tp or hidden % tp or (b * s) % tp:
        raise ValueError(f"heads {heads}, hidden {hidden} and tokens {b * s} must divide by "
                         f"tp={tp}")
    hd, local_heads = d // heads, heads // tp
    sizes = [(3 * local_heads * hd, d), (d, local_heads * hd), (2 * hidden // tp, d),
             (d, hidden // tp)]
    if any(rows % dp for rows, _ in sizes):
        raise ValueError(f"the weights' tensor-parallel parts {sizes} must divide by dp={dp} "
                         "on dim 0")

    x = torch.empty(b * s // tp, d, device="meta", dtype=dtype, requires_grad=backward)
    weights = [torch.empty(rows // dp, cols, device="meta", dtype=dtype, requires_grad=backward)
               for rows, cols in sizes]

    def full(w):  # SimpleFSDP: the weight gathered where it is read
        return funcol.all_gather_tensor_autograd(w, 0, dp_group)

    def block(x, wqkv, wo, wgu, wd):
        h = funcol.all_gather_tensor(F.rms_norm(x, (d,)), 0, tp_group)
        q, k, v = F.linear(h, full(wqkv)).view(b, s, 3, local_heads, hd).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        att = att.transpose(1, 2).reshape(b * s, local_heads * hd)
        x = x + funcol.reduce_scatter_tensor(F.linear(att, full(wo)), "sum", 0, tp_group)
        h = funcol.all_gather_tensor(F.rms_norm(x, (d,)), 0, tp_group)
        gate, up = F.linear(h, full(wgu)).chunk(2, dim=-1)
        return x + funcol.reduce_scatter_tensor(F.linear(F.silu(gate) * up, full(wd)), "sum",
                                                0, tp_group)

    return trace_graphs(block, x, *weights, backward=backward)


def tp_attention(tp: int, shape: tuple[int, int, int], *, heads: int = 32,
                 dtype=torch.bfloat16, backward: bool = False,
                 group=None) -> dict[str, fx.GraphModule]:
    """A self-attention layer under tensor + sequence parallelism, as in a DiT block (no
    causal mask): the sequence-sharded input all-gathered before the column-parallel QKV
    projection, attention on this rank's heads, the row-parallel output projection
    reduce-scattered back (rows ``[batch * sequence]``, as torchtitan lays them out). The
    attention is the CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
    has meta kernels) so that the traced graph keeps it whole, as a GPU trace keeps its flash
    kernel; the simulator counts it as flash attention."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    b, s, d = shape
    if heads % tp or (b * s) % tp or d % heads:
        raise ValueError(f"heads {heads} and tokens {b * s} must divide by tp={tp}, and dim "
                         f"{d} by heads")
    group = dist.group.WORLD if group is None else group
    hd, local = d // heads, heads // tp
    x = torch.empty(b * s // tp, d, device="meta", dtype=dtype, requires_grad=backward)
    wqkv = torch.empty(3 * local * hd, d, device="meta", dtype=dtype, requires_grad=backward)
    wo = torch.empty(d, local * hd, device="meta", dtype=dtype, requires_grad=backward)
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def layer(x, wqkv, wo):
        h = funcol.all_gather_tensor(x, 0, group)
        q, k, v = F.linear(h, wqkv).view(b, s, 3, local, hd).unbind(2)
        att = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0]
        att = att.transpose(1, 2).reshape(b * s, local * hd)
        return funcol.reduce_scatter_tensor(F.linear(att, wo), "sum", 0, group)

    return trace_graphs(layer, x, wqkv, wo, backward=backward)
