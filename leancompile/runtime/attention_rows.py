"""The attention rows a reduce-scatter schedule reads, computed slice by slice
(``AttentionRows``: the FlashOverlap rewrite of ``attention -> matmul -> reduce_scatter``,
``passes/flash/attention_rewrite.py``), and ``cat_like``, a cat that keeps a tensor's memory
layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AttentionRows", "cat_like", "slice_keys", "KEY_BLOCK"]

KEY_BLOCK = 512
"""The block of keys torch's CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``,
torch 2.13's ``FlashAttentionKernel.cpp``) walks in, or all the keys when fewer. A query row's
result depends on that partition (the kernel's blocking and vector reductions follow the key
count): measured on the kernel alone, bf16 and fp32, a row handed only the keys its causal span
reaches differs from the whole attention's row at most sequence lengths (16, 48, 100, 512 split
in 2 or 4), while one handed the whole attention's blocks of keys with its rows of the mask is
bitwise at every length tried (16 to 2048)."""


def slice_keys(reach: int, seq: int) -> int | None:
    """How many keys a causal slice of queries whose last query sees ``reach`` keys (of
    ``seq``) is handed: the whole attention's blocks of ``KEY_BLOCK`` keys that hold them
    (all ``seq`` keys up to one block), so that the kernel partitions them as it does for the
    whole attention; the keys past ``reach`` are masked. None for symbolic sizes."""
    if not (isinstance(reach, int) and isinstance(seq, int)):
        return None
    if seq <= KEY_BLOCK:
        return seq
    return min(seq, -(-reach // KEY_BLOCK) * KEY_BLOCK)


class AttentionRows:
    """The rows of ``h`` (``shape``, the input of a reduce-scatter's matmul) computed when a
    schedule reads them: ``h = reshape(chain(attention(q, k, v, *args)[0]), shape)``, the rows
    along ``dim`` being the query rows of ``q`` ([batch, heads, sequence, head_dim]; with
    ``merged``, the (batch, query) pairs, batch-major). ``narrow(dim, start, length)`` runs the
    attention for those queries alone (every query row attends to all of its batch's keys and
    values on its own, so a slice of queries gives those rows of the output) and ``chain``
    (the layout ops between the attention and the matmul, told the slice's query count). What
    the schedule computed is kept: ``assembled()`` returns the attention's outputs for all
    queries, which the backward graph saves.

    Used by the FlashOverlap rewrite of ``attention -> matmul -> reduce_scatter`` (query-split
    attention: the first partials are sent while the other slices' attention still runs)."""

    def __init__(self, attention, q: Tensor, k: Tensor, v: Tensor, args: tuple, kwargs: dict,
                 chain, shape, dim: int, *, merged: bool = False, causal: bool = False):
        self._attention, self._q, self._k, self._v = attention, q, k, v
        self._causal = causal
        self._args, self._kwargs, self._chain = args, kwargs, chain
        self.shape = tuple(shape)
        self._dim, self._merged = dim, merged
        self.dtype, self.device = q.dtype, q.device
        self._batch, self._seq = q.size(0), q.size(2)
        self._computed: dict[tuple[int, int], tuple] = {}  # (batch, query) start -> outputs

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int):
        return self.shape[d]

    def _block(self, start: int, length: int) -> tuple[int, int, int, int]:
        """(first batch, batches, first query, queries) of rows [start, start + length)."""
        if not self._merged:
            rows = self.shape[self._dim]
            return 0, self._batch, start * self._seq // rows, length * self._seq // rows
        seq = self._seq
        if length % seq == 0 and start % seq == 0:
            return start // seq, length // seq, 0, seq
        if (start % seq) + length > seq:
            raise ValueError(f"AttentionRows: rows [{start}, {start + length}) straddle a batch "
                             f"of {seq} queries")
        return start // seq, 1, start % seq, length

    def narrow(self, d: int, start: int, length: int) -> Tensor:
        if d != self._dim:
            raise ValueError(f"AttentionRows: rows are split along dim {self._dim}, not {d}")
        b0, nb, q0, ql = self._block(start, length)
        q, k, v = self._q, self._k, self._v
        if nb != self._batch:
            q, k, v = q.narrow(0, b0, nb), k.narrow(0, b0, nb), v.narrow(0, b0, nb)
        outs = self._slice_attention(q.narrow(2, q0, ql), k, v, q0, ql)
        self._computed.setdefault((b0, q0), outs)
        shape = list(self.shape)
        shape[d] = length
        return self._chain(outs[0], ql).reshape(shape)

    def _slice_attention(self, q: Tensor, k: Tensor, v: Tensor, q0: int, ql: int):
        """The attention of queries ``q0 .. q0 + ql``. Causal: they see the keys up to the
        last of them, through their rows of the causal mask as an additive mask, handed as
        many keys as keep the kernel's blocks of keys those of the whole attention
        (``slice_keys``), so each row is bitwise the whole attention's row."""
        if not self._causal:
            return self._attention(q, k, v, *self._args, **self._kwargs)
        keys = slice_keys(q0 + ql, self._seq)
        if keys is None:  # symbolic sizes: the keys its span reaches (within rounding)
            keys = q0 + ql
            k, v = k.narrow(2, 0, keys), v.narrow(2, 0, keys)
            if q0 == 0:
                return self._attention(q, k, v, *self._args, **self._kwargs)
        elif keys != self._seq:
            k, v = k.narrow(2, 0, keys), v.narrow(2, 0, keys)
        seen = torch.ones(ql, keys, dtype=torch.bool, device=q.device).tril(q0)
        mask = torch.zeros(ql, keys, dtype=q.dtype, device=q.device).masked_fill(
            seen.logical_not(), float("-inf"))
        args, kwargs = list(self._args), dict(self._kwargs, attn_mask=mask)
        if len(args) > 1:
            args[1] = False  # is_causal
        kwargs.pop("is_causal", None)
        return self._attention(q, k, v, *args, **kwargs)

    def assembled(self, likes) -> list[Tensor]:
        """For each attention output (``likes``: its full-size value, for the memory layout;
        None for an output nobody reads), the computed blocks put together (queries in dim 2,
        batches in dim 0); they must cover every (batch, query) row."""
        starts = sorted(self._computed)
        covered = sum(self._computed[s][0].size(0) * self._computed[s][0].size(2)
                      for s in starts)
        if covered != self._batch * self._seq:
            raise RuntimeError(f"AttentionRows: the schedule computed {covered} of "
                               f"{self._batch * self._seq} (batch, query) rows")
        full = []
        for i, like in enumerate(likes):
            if like is None:
                continue
            batches: dict[int, list[Tensor]] = {}
            for b0, q0 in starts:
                batches.setdefault(b0, []).append(self._computed[b0, q0][i])
            rows = [cat_like(parts, 2, like) for _, parts in sorted(batches.items())]
            full.append(cat_like(rows, 0, like))
        return full


def cat_like(pieces: list[Tensor], dim: int, like: Tensor) -> Tensor:
    """``cat(pieces, dim)`` with the memory layout (stride order) of ``like``, a dense tensor
    the pieces slice along ``dim``."""
    if len(pieces) == 1:
        return pieces[0]
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), -d))
    if order == list(range(like.dim())):
        return torch.cat(pieces, dim)
    inverse = [order.index(d) for d in range(like.dim())]
    return torch.cat([p.permute(order) for p in pieces], order.index(dim)).permute(inverse)

