"""Ops that batched Reweight's ``torch.func.vmap`` needs a batching rule for.

Reweight takes one gradient per row: the batch-1 backward graph runs under ``vmap`` over the
rows' own saved tensors. PyTorch has no batching rule for the CPU flash-attention backward
(``aten::_scaled_dot_product_flash_attention_for_cpu_backward``): vmap would fall back to a
Python loop over the rows, one attention backward each. ``leancompile::sdpa_cpu_backward`` is
the same op with a rule: the vmapped dim is folded into the attention's own batch dim (dim 0
of query, key, value, output, log-sum-exp and their gradient), one call for all rows.

Before (a batch-1 backward graph, vmapped over R rows: R calls)::

    gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g_out, q, k, v, out, lse, 0.0, False, scale=s)        # q: [1, H, L, D] per row

After (``vmap_friendly`` swaps the target; under vmap: one call of batch R)::

    gq, gk, gv = leancompile.sdpa_cpu_backward(g_out, q, k, v, out, lse, 0.0, False, scale=s)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["VMAP_REPLACEMENTS"]

_aten = torch.ops.aten


@torch.library.custom_op("leancompile::sdpa_cpu_backward", mutates_args=())
def sdpa_cpu_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                      logsumexp: Tensor, dropout_p: float, is_causal: bool,
                      attn_mask: Tensor | None = None,
                      scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask,
        scale=scale)
    return gq, gk, gv


@sdpa_cpu_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None,
      scale=None):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _fold(t: Tensor, dim: int | None, rows: int, batch: int, rank: int) -> Tensor:
    """``t`` (``rank`` dims per row, the first the attention batch, maybe broadcast) with the
    vmapped dim (``dim``; None: not batched) folded into its dim 0."""
    t = t.unsqueeze(0) if dim is None else t.movedim(dim, 0)
    if t.dim() < rank + 1:  # a mask broadcast over the batch (and maybe the heads)
        t = t.reshape(t.shape[0], *([1] * (rank + 1 - t.dim())), *t.shape[1:])
    t = t.expand(rows, batch, *t.shape[2:])
    return t.reshape(rows * batch, *t.shape[2:])


@sdpa_cpu_backward.register_vmap
def _(info, in_dims, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
      attn_mask=None, scale=None):
    rows = info.batch_size
    dims = list(in_dims)
    q_dim = dims[1]
    batch = query.shape[0 if q_dim is None else (1 if q_dim == 0 else 0)]
    tensors = [_fold(t, d, rows, batch, t.dim() - (d is not None)) for t, d in zip(
        (grad_out, query, key, value, out, logsumexp), dims[:6])]
    mask = None if attn_mask is None else _fold(attn_mask, dims[8], rows, batch, query.dim() - (
        q_dim is not None))
    grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *tensors, dropout_p, is_causal, attn_mask=mask, scale=scale)
    return tuple(g.reshape(rows, batch, *g.shape[1:]) for g in grads), (0, 0, 0)


VMAP_REPLACEMENTS = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        torch.ops.leancompile.sdpa_cpu_backward.default,
}
"""aten op -> the same op with a batching rule (same arguments)."""
