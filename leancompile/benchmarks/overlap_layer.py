"""The tensor + sequence parallel MLP layer of ``leancompile bench overlap`` and a compiled
forward + backward step of it, shared by the benchmarks that time, trace, validate or soak it
(``overlap``, ``overlap_validate``, ``trace``, ``soak``, ``compile_overhead``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["layer_step", "mlp_layer"]


def mlp_layer(world, seq, dim, hidden):
    """``(layer, [w1, w2])``: all-gather the sequence shard, ``gelu(g @ w1) @ w2`` with this
    rank's columns of ``w1`` and rows of ``w2``, reduce-scatter back to sequence shards."""
    import torch.distributed._functional_collectives as funcol

    torch.manual_seed(0)
    w1 = (torch.randn(dim, hidden // world) / dim ** 0.5).requires_grad_()
    w2 = (torch.randn(hidden // world, dim) / hidden ** 0.5).requires_grad_()
    group = dist.group.WORLD

    def layer(x):
        g = funcol.all_gather_tensor(x, 0, group)
        return funcol.reduce_scatter_tensor(F.gelu(g @ w1) @ w2, "sum", 0, group)

    return layer, [w1, w2]


def layer_step(layer, params, x, **options):
    """``layer`` compiled by leancompile with ``options`` (``aot_eager``) and a function that
    runs one forward + backward of it on ``x`` (loss: sum of squares) and returns the output
    and the gradients of ``x`` and ``params`` (taken out of ``.grad``)."""
    from ..compiler import backend

    compiled = torch.compile(layer, backend=backend(compiler="aot_eager", **options))

    def step():
        y = compiled(x)
        y.square().sum().backward()
        values = [y.detach()] + [t.grad for t in [x] + list(params)]
        x.grad = None
        for p in params:
            p.grad = None
        return values

    return step
