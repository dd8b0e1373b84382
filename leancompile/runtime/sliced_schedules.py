"""The data-slicing baseline of the FlashOverlap schedules (``overlap="slice"``): the data cut
into ``chunks`` pieces, one async collective per piece, each piece's matmul run once its
collective is waited for (the first gather, or the last reduce-scatter, is exposed).

Plain eager code over tensors and functional collectives, traced into the graph like
``flash_schedules.py``; the numerics are those of the flash schedules (module docstring there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .p2p import group_rank_and_size
from .slice_matmul import (as_list, bias_list, cat_pieces, check_ag, check_rs_terms,
                           check_weight_gather, input_compute, partial_product, rs_terms,
                           weight_compute)

__all__ = ["sliced_all_gather_matmul", "sliced_all_gather_weight_matmul",
           "sliced_matmul_reduce_scatter"]


def _c10d():
    return torch.ops._c10d_functional


def sliced_all_gather_matmul(x_shard: Tensor, weights: Sequence[Tensor] | Tensor, *,
                             group_name: str, gather_dim: int = 0, chunks: int = 2,
                             bias: Sequence[Tensor | None] | Tensor | None = None,
                             return_gathered: bool = False) -> tuple[Tensor | None, list[Tensor]]:
    """The data-slicing baseline of ``flash_all_gather_matmul``: cut ``x_shard`` into ``chunks``
    pieces along ``gather_dim``, post one async ``all_gather_into_tensor`` per piece up front,
    then for each piece wait and run the matmuls (the first gather is exposed)."""
    fn = "sliced_all_gather_matmul"
    weights = as_list(weights)
    biases = bias_list(bias, len(weights))
    d = check_ag(fn, x_shard, weights, gather_dim, chunks, "chunks")
    return _sliced_ag(x_shard, d, chunks, group_name, input_compute(weights, biases),
                      out_dim=d, count=len(weights), return_gathered=return_gathered)


def sliced_all_gather_weight_matmul(w_shard: Tensor, inputs: Sequence[Tensor] | Tensor, *,
                                    group_name: str, layout: str = "linear", chunks: int = 2,
                                    bias: Sequence[Tensor | None] | Tensor | None = None,
                                    return_gathered: bool = False
                                    ) -> tuple[Tensor | None, list[Tensor]]:
    """The data-slicing baseline of ``flash_all_gather_weight_matmul``: ``chunks`` async
    all-gathers of pieces of the weight shard, each piece's output columns computed once its
    gather is waited for."""
    xs, biases, d = check_weight_gather("sliced_all_gather_weight_matmul", w_shard, inputs,
                                        bias, layout, chunks, "chunks")
    return _sliced_ag(w_shard, d, chunks, group_name, weight_compute(xs, biases, layout),
                      out_dim=-1, count=len(xs), return_gathered=return_gathered,
                      with_ranges=True)


def _sliced_ag(shard: Tensor, d: int, chunks: int, group_name: str, compute, *, out_dim: int,
               count: int, return_gathered: bool, with_ranges: bool = False
               ) -> tuple[Tensor | None, list[Tensor]]:
    """The data-slicing loop shared by the input and the weight gathers (``compute`` as in
    ``flash_schedules._flash_ag``; a gathered piece holds chunk c of every rank, owner-major)."""
    rank, n = group_rank_and_size(group_name)
    if n == 1:
        return (shard if return_gathered else None,
                compute(shard, [(0, shard.size(d))]) if with_ranges else compute(shard))
    length = shard.size(d) // chunks
    started = [
        _c10d().all_gather_into_tensor(
            shard.narrow(d, c * length, length).movedim(d, 0).contiguous(), n, group_name)
        for c in range(chunks)
    ]
    pieces: list[Tensor] = []  # [chunk] -> gathered piece (N*length along d)
    outs: list[list[list[Tensor]]] = []  # [chunk][output] -> per-owner parts
    for c, g in enumerate(started):
        x = _c10d().wait_tensor(g).movedim(0, d)
        pieces.append(x)
        ys = compute(x, [((j * chunks + c) * length, length) for j in range(n)]) \
            if with_ranges else compute(x)
        outs.append([list(y.split(length, out_dim)) for y in ys])
    ys = [cat_pieces([outs[c][q][j] for j in range(n) for c in range(chunks)], out_dim)
          for q in range(count)]
    gathered = None
    if return_gathered:
        split = [p.split(length, d) for p in pieces]
        gathered = cat_pieces([split[c][j] for j in range(n) for c in range(chunks)], d)
    return gathered, ys


def sliced_matmul_reduce_scatter(h: Tensor | Sequence[Tensor], w: Tensor | Sequence[Tensor], *,
                                 group_name: str, scatter_dim: int = 0, chunks: int = 2,
                                 bias: Tensor | Sequence[Tensor | None] | None = None,
                                 out_dtype: torch.dtype | None = None,
                                 term_dtype: torch.dtype | None = None) -> Tensor:
    """The data-slicing baseline of ``flash_matmul_reduce_scatter`` (``out_dtype`` and
    ``term_dtype`` as there): for each of ``chunks``
    pieces of every rank's output slice, compute that piece's partial (all owners at once) and
    post an async ``reduce_scatter_tensor`` before computing the next piece; wait all at the end
    (the last reduce-scatter is exposed)."""
    fn = "sliced_matmul_reduce_scatter"
    rank, n = group_rank_and_size(group_name)
    terms = rs_terms(fn, h, w, bias)
    d, size = check_rs_terms(fn, terms, scatter_dim, n, chunks, "chunks")
    if n == 1:
        return partial_product(terms, d, [(0, size)], out_dtype, term_dtype)
    length = size // (n * chunks)
    started = []
    for c in range(chunks):
        part = partial_product(terms, d, [((j * chunks + c) * length, length) for j in range(n)],
                               out_dtype, term_dtype)
        started.append(_c10d().reduce_scatter_tensor(
            part.movedim(d, 0).contiguous(), "sum", n, group_name))
    return cat_pieces([_c10d().wait_tensor(t).movedim(0, d) for t in started], d)
