"""FlashOverlap schedules on one rank: a collective next to a matmul, decomposed into P2P steps.

Each function is plain eager code over tensors (torch ops and the P2P ops of ``p2p.py``), with
Python control flow over ints only (sizes, ranks), so the graph rewrite can trace it into a
graph; the rank is baked in, and with symbolic sizes a size test becomes a guard. For a group
of N ranks, rank r (slices named by the rank that owns them, cut into m chunks each with
``chunks_per_rank=m``)::

    flash_all_gather_matmul      Y_j = all_gather(x) @ W_j for every weight; step 0 computes the
                                 own slice and posts it to r+1; step i computes the slice that
                                 came from r-1 while it moves on; the last step sends nothing.
    flash_all_gather_weight_matmul
                                 Y_j = X_j @ all_gather(w).T (FSDP-style: the weight is the
                                 gathered one); the same steps, each computing the output
                                 columns of the weight rows it holds.
    flash_matmul_reduce_scatter  reduce_scatter(h @ w); "ring": partial sums travel r -> r+1 and
                                 grow one partial per hop, the own slice is computed last, one
                                 add exposed; "direct": each partial goes straight to its owner,
                                 the own slice last, a local N-way sum at the end.
    sliced_*                     the data-slicing baseline: k chunks, one async collective each
                                 (``sliced_schedules.py``).

The step tables (``flash_ag_steps``, ``flash_rs_steps``, in ``flash_steps.py``) drive the
schedules, so what a test or ``explain`` reads is what runs; the argument checks and the
matmul of one slice are in ``slice_matmul.py``. Reference: docs/flashoverlap.md, section 1.

Numerics: input all-gather schedules run the same mm/addmm on the same rows of X as the
collective-then-matmul graph, one call per slice instead of one for all rows; on this project's
CPU machines (torch 2.13) that is bitwise equal in float32 and float64 for a contiguous (K, N)
weight and for the layer sizes the tests assert it on, but not for every shape: with a
transposed weight (``x @ w.t()``, ``F.linear``) MKL picks another kernel for slices of 1 row,
and of 2 or 4 rows when K <= 8 (measured 4.8e-7 max abs diff for a (2, 4) @ (4, 4).t()); those
agree within float tolerance (the property tests, ``tests/test_flash_overlap_properties.py``,
draw such shapes). Weight all-gather
schedules compute a few output columns per call: the BLAS may block those differently from the
full matmul (measured here: bitwise for most shapes, 2e-6 max abs diff in float32 for 8 columns
of 32), so they agree within float tolerance, and bitwise for integer-valued data. Reduce-scatter
schedules sum the N partials in another order than the backend's reduce-scatter (ring: received
sum + own partial; direct: rank order), and scattering the last dim slices the columns of ``w``,
which changes the mm's blocking: float32 results agree within rtol=1e-5, atol=1e-5 (measured
max abs diff 6e-6 for values of magnitude ~10 on 4 ranks), float64 likewise in its last bits. With
integer-valued inputs every order is exact and results are bitwise equal.
"""


from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .attention_rows import AttentionRows, cat_like
from .flash_steps import (RS_VARIANTS, P2PStep, ScheduleTrace, Transfer, flash_ag_steps,
                          flash_rs_steps)
from .p2p import group_rank_and_size, start_exchange, wait_exchange
from .slice_matmul import (WEIGHT_LAYOUTS, as_list, bias_list, cat_pieces, check_ag,
                           check_rs_terms, check_weight_gather, input_compute, partial_product,
                           rs_terms, weight_compute)
from .sliced_schedules import (sliced_all_gather_matmul, sliced_all_gather_weight_matmul,
                               sliced_matmul_reduce_scatter)

__all__ = [
    "AttentionRows",
    "P2PStep",
    "RS_VARIANTS",
    "ScheduleTrace",
    "Step",
    "Transfer",
    "WEIGHT_LAYOUTS",
    "flash_ag_steps",
    "flash_all_gather_matmul",
    "flash_all_gather_weight_matmul",
    "flash_matmul_reduce_scatter",
    "flash_rs_steps",
    "sliced_all_gather_matmul",
    "sliced_all_gather_weight_matmul",
    "sliced_matmul_reduce_scatter",
    "cat_like",
]

Step = P2PStep
"""The old name of ``P2PStep`` (one step of a point-to-point schedule), kept for code that
imported it from here."""


# ---------------------------------------------------------------------------------------------
# Flash-AG


def flash_all_gather_matmul(x_shard: Tensor, weights: Sequence[Tensor] | Tensor, *,
                            group_name: str, gather_dim: int = 0, chunks_per_rank: int = 1,
                            bias: Sequence[Tensor | None] | Tensor | None = None,
                            return_gathered: bool = False) -> tuple[Tensor | None, list[Tensor]]:
    """``all_gather_into_tensor(x_shard, gather_dim) @ W`` for every W in ``weights`` (+ the
    matching entry of ``bias``), with the gather decomposed into N-1 ring hops that overlap the
    per-slice matmuls (``flash_ag_steps``). One communication feeds all weights (Q, K and V).

    ``x_shard``: (..., K), this rank's shard along ``gather_dim`` (not the last dim); weights
    (K, N_j). Returns (the gathered X if ``return_gathered`` else None, [Y_j]). With world
    size 1, a plain matmul.
    """
    fn = "flash_all_gather_matmul"
    weights = as_list(weights)
    biases = bias_list(bias, len(weights))
    d = check_ag(fn, x_shard, weights, gather_dim, chunks_per_rank, "chunks_per_rank")
    return _flash_ag(x_shard, d, chunks_per_rank, group_name, input_compute(weights, biases),
                     out_dim=d, count=len(weights), return_gathered=return_gathered)


def flash_all_gather_weight_matmul(w_shard: Tensor, inputs: Sequence[Tensor] | Tensor, *,
                                   group_name: str, layout: str = "linear",
                                   chunks_per_rank: int = 1,
                                   bias: Sequence[Tensor | None] | Tensor | None = None,
                                   return_gathered: bool = False
                                   ) -> tuple[Tensor | None, list[Tensor]]:
    """The FSDP-style parameter gather: ``X_j @ all_gather(w_shard)`` (as its layout says) for
    every X_j in ``inputs``, with the gather decomposed like ``flash_all_gather_matmul``. The
    gathered rows of the weight are columns of every output, so step i computes the output
    columns owned by rank (r - i) % N from the weight slice that just arrived.

    ``layout="linear"``: ``w_shard`` is a ``Shard(0)`` piece of an ``nn.Linear`` weight
    (out/N, in); Y_j = X_j @ W.T (+ b_j), as ``F.linear``. ``layout="kn"``: ``w_shard`` is a
    (K, N/N_ranks) piece of a (K, N) matrix gathered on dim 1; Y_j = X_j @ W (+ b_j). ``bias``:
    one full (N,) bias (or None) per input. Returns (the gathered weight if ``return_gathered``
    else None, [Y_j]).

    Numerics: each slice's matmul reads fewer weight columns than the full matmul, which can
    change the BLAS kernel's blocking; results equal the gather-then-matmul graph within float
    tolerance (bitwise on this project's CPUs for most shapes, and always for integer-valued
    data; see the module docstring).
    """
    xs, biases, d = check_weight_gather("flash_all_gather_weight_matmul", w_shard, inputs,
                                        bias, layout, chunks_per_rank, "chunks_per_rank")

    return _flash_ag(w_shard, d, chunks_per_rank, group_name, weight_compute(xs, biases, layout),
                     out_dim=-1, count=len(xs), return_gathered=return_gathered,
                     with_ranges=True)


def _flash_ag(shard: Tensor, d: int, m: int, group_name: str, compute, *, out_dim: int,
              count: int, return_gathered: bool, with_ranges: bool = False
              ) -> tuple[Tensor | None, list[Tensor]]:
    """The Flash-AG step loop shared by the input and the weight gathers: ``compute(piece)``
    (``compute(piece, ranges)`` with ``with_ranges``: [(start, length)] of the piece along ``d``
    in the gathered tensor) returns ``count`` outputs, each the slice's part along ``out_dim``."""
    rank, n = group_rank_and_size(group_name)
    length = shard.size(d) // m

    def run(piece: Tensor, s: tuple[int, int]) -> list[Tensor]:
        if with_ranges:
            return compute(piece, [((s[0] * m + s[1]) * length, piece.size(d))])
        return compute(piece)

    if n == 1:
        return shard if return_gathered else None, run(shard, (0, 0))
    data = {(rank, c): shard.narrow(d, c * length, length) if m > 1 else shard  # whole: as is
            for c in range(m)}
    shape = tuple(data[(rank, 0)].shape)
    pending = {}  # tag -> (exchange, outputs computed since it was posted)
    outs = {}
    for step in flash_ag_steps(rank, n, m).steps:
        for t in step.wait:
            exchange, overlapped = pending.pop(t.tag)
            data[t.slice] = wait_exchange(exchange, after=overlapped)
        if step.send is not None:
            pending[step.recv.tag] = (start_exchange(
                data[step.send.slice], shape, step.send.peer, step.recv.peer, group_name,
                tag=step.send.tag), [])
        outs[step.compute] = run(data[step.compute], step.compute)
        for _, overlapped in pending.values():
            overlapped.extend(outs[step.compute])
    assert not pending, "flash_ag_steps left an exchange unwaited"
    order = [(j, c) for j in range(n) for c in range(m)]
    ys = [cat_pieces([outs[s][q] for s in order], out_dim) for q in range(count)]
    gathered = cat_pieces([data[s] for s in order], d) if return_gathered else None
    return gathered, ys


# ---------------------------------------------------------------------------------------------
# Flash-RS


def flash_matmul_reduce_scatter(h: Tensor | Sequence[Tensor], w: Tensor | Sequence[Tensor], *,
                                group_name: str, scatter_dim: int = 0, variant: str = "ring",
                                chunks_per_rank: int = 1,
                                bias: Tensor | Sequence[Tensor | None] | None = None,
                                out_dtype: torch.dtype | None = None,
                                term_dtype: torch.dtype | None = None) -> Tensor:
    """``reduce_scatter_tensor(h @ w (+ bias), "sum", scatter_dim)`` with the reduce-scatter
    decomposed into P2P steps (``flash_rs_steps``): ``variant="ring"`` accumulates along the
    ring, ``"direct"`` sends every partial to its owner and sums locally. Every rank adds
    ``bias`` before the sum, as ``addmm -> reduce_scatter`` does. ``out_dtype``: each partial
    product is cast to it before it is sent or summed (autocast's fp32 reduce-scatter of a
    bf16 matmul: ``reduce_scatter((h @ w).float())``). Sequences ``h``, ``w`` (and ``bias``)
    reduce-scatter a sum of matmuls, ``h[0] @ w[0] + h[1] @ w[1] + ...`` summed left to right
    (the input gradient of a gate/up or Q/K/V projection pair sharing one gather);
    ``term_dtype``: each term's product is cast to it before the terms are summed (autocast's
    input gradient of bf16 projections of one fp32 input, ``mm_q.float() + mm_k.float() +
    mm_v.float()``).

    ``h``: (..., K), ``w``: (K, N). ``scatter_dim`` is a dim of the output (the last one slices
    the columns of ``w``). The result equals the collective up to float summation order (see
    the module docstring). With world size 1, a plain matmul.
    """
    fn = "flash_matmul_reduce_scatter"
    if variant not in RS_VARIANTS:
        raise ValueError(f"{fn}: unknown variant {variant!r}; use one of {RS_VARIANTS}")
    rank, n = group_rank_and_size(group_name)
    m = chunks_per_rank
    terms = rs_terms(fn, h, w, bias)
    d, size = check_rs_terms(fn, terms, scatter_dim, n, m, "chunks_per_rank")
    if n == 1:
        return partial_product(terms, d, [(0, size)], out_dtype, term_dtype)
    length = size // (n * m)

    def partial(s: tuple[int, int]) -> Tensor:
        return partial_product(terms, d, [((s[0] * m + s[1]) * length, length)], out_dtype,
                               term_dtype)

    trace = flash_rs_steps(rank, n, m, variant)
    pending = {}  # tag -> (exchange, partials computed since it was posted)
    result = {}
    for step in trace.steps:
        part = partial(step.compute)
        for _, overlapped in pending.values():
            overlapped.append(part)
        got = {}
        for t in step.wait:
            exchange, overlapped = pending.pop(t.tag)
            got[t.peer] = wait_exchange(exchange, after=overlapped)
        if variant == "ring":
            acc = part if not got else got[(rank - 1) % n] + part
            result[step.compute] = acc
            out = acc
        else:
            out = part
            if step.wait:  # the own slice: local N-way sum in rank order
                got[rank] = part
                total = got[0]
                for src in range(1, n):
                    total = total + got[src]
                result[step.compute] = total
        if step.send is not None:
            pending[step.recv.tag] = (start_exchange(
                out, tuple(out.shape), step.send.peer, step.recv.peer, group_name,
                tag=step.send.tag), [])
    assert not pending, "flash_rs_steps left an exchange unwaited"
    return cat_pieces([result[(rank, c)] for c in range(m)], d)

