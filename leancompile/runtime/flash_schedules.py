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
    sliced_*                     the data-slicing baseline: k chunks, one async collective each.

The step lists (``flash_ag_steps``, ``flash_rs_steps``) drive the schedules, so what a test or
``explain`` reads is what runs. Reference: docs/flashoverlap.md, section 1.

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
from dataclasses import dataclass

import torch
from torch import Tensor

from .p2p import group_rank_and_size, start_exchange, wait_exchange

__all__ = [
    "AttentionRows",
    "ScheduleTrace",
    "Step",
    "Transfer",
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

RS_VARIANTS = ("ring", "direct")
WEIGHT_LAYOUTS = ("linear", "kn")


# ---------------------------------------------------------------------------------------------
# Step lists


@dataclass(frozen=True)
class Transfer:
    """One message: ``slice`` = (owning rank, chunk) of the data it carries, ``peer`` = the
    group rank it goes to (send) or comes from (receive), ``tag`` = unique per message of a
    schedule and the same on both ends."""

    slice: tuple[int, int]
    peer: int
    tag: int


@dataclass(frozen=True)
class Step:
    """One step of one rank.

    ``compute``: the (owner, chunk) slice whose matmul runs in this step. ``wait``: receives
    completed in this step. ``send``/``recv``: the exchange posted in this step (one
    ``p2p_start``). Order inside a step: all-gather: wait, post, compute (the waited slice is the
    compute's input, the posted send forwards it); ring reduce-scatter: compute, wait, add the
    received partial sum, post the new sum; direct: compute, post its partial to the owner; its
    last steps: compute the own slice, wait, sum.
    """

    index: int
    compute: tuple[int, int]
    wait: tuple[Transfer, ...] = ()
    send: Transfer | None = None
    recv: Transfer | None = None

    def describe(self) -> str:
        parts = [f"step {self.index}: compute slice {_name(self.compute)}"]
        if self.wait:
            parts.append("wait " + ", ".join(f"{_name(t.slice)} from {t.peer}"
                                             for t in self.wait))
        if self.send is not None:
            parts.append(f"send {_name(self.send.slice)} to {self.send.peer}")
        if self.recv is not None:
            parts.append(f"recv {_name(self.recv.slice)} from {self.recv.peer}")
        return "; ".join(parts)


def _name(s: tuple[int, int]) -> str:
    return f"{s[0]}.{s[1]}"


@dataclass(frozen=True)
class ScheduleTrace:
    """The steps one rank runs: ``kind`` is "flash_ag", "flash_rs" (ring) or "direct_rs"."""

    kind: str
    rank: int
    world_size: int
    chunks_per_rank: int
    steps: tuple[Step, ...]

    def sends(self) -> list[Transfer]:
        return [s.send for s in self.steps if s.send is not None]

    def recvs(self) -> list[Transfer]:
        return [s.recv for s in self.steps if s.recv is not None]

    def format(self) -> str:
        head = (f"{self.kind} rank {self.rank}/{self.world_size}, "
                f"chunks_per_rank={self.chunks_per_rank}, {len(self.steps)} steps")
        return "\n".join([head] + ["  " + s.describe() for s in self.steps])


def _check_rank_world(rank: int, world: int, m: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world} ranks")
    _check_positive("chunks_per_rank", m)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an int >= 1")


def flash_ag_steps(rank: int, world: int, m: int = 1) -> ScheduleTrace:
    """Flash-AG on ``rank`` of ``world``: step i*m + c computes chunk c of slice (rank-i) % world.
    Round 0 is the rank's own data (no wait); each slice is forwarded to rank+1 while its matmul
    runs and waited for one round (m steps) later; the last round sends nothing."""
    _check_rank_world(rank, world, m)
    n, r = world, rank
    steps = []
    for i in range(n):
        for c in range(m):
            owner = (r - i) % n
            wait = (Transfer((owner, c), (r - 1) % n, (i - 1) * m + c),) if i > 0 else ()
            send = recv = None
            if i < n - 1:
                send = Transfer((owner, c), (r + 1) % n, i * m + c)
                recv = Transfer(((r - i - 1) % n, c), (r - 1) % n, i * m + c)
            steps.append(Step(i * m + c, (owner, c), wait, send, recv))
    return ScheduleTrace("flash_ag", r, n, m, tuple(steps))


def flash_rs_steps(rank: int, world: int, m: int = 1, variant: str = "ring") -> ScheduleTrace:
    """Flash-RS on ``rank`` of ``world``. Ring: step i*m + c computes the partial of chunk c of
    slice (rank-1-i) % world, adds the sum received from rank-1 (i > 0) and posts the result to
    rank+1 (i < world-1); the last round is the rank's own slice. Direct: step (k-1)*m + c
    computes the partial of slice (rank+k) % world and sends it to that rank, receiving rank-k's
    partial of the own slice; the last m steps compute the own slice and sum."""
    _check_rank_world(rank, world, m)
    if variant not in RS_VARIANTS:
        raise ValueError(f"unknown reduce-scatter variant {variant!r}; use one of {RS_VARIANTS}")
    n, r = world, rank
    steps = []
    if variant == "ring":
        for i in range(n):
            for c in range(m):
                owner = (r - 1 - i) % n
                wait = (Transfer((owner, c), (r - 1) % n, (i - 1) * m + c),) if i > 0 else ()
                send = recv = None
                if i < n - 1:
                    send = Transfer((owner, c), (r + 1) % n, i * m + c)
                    recv = Transfer(((r - 2 - i) % n, c), (r - 1) % n, i * m + c)
                steps.append(Step(i * m + c, (owner, c), wait, send, recv))
        return ScheduleTrace("flash_rs", r, n, m, tuple(steps))
    recvs: dict[int, list[Transfer]] = {c: [] for c in range(m)}
    for k in range(1, n):
        for c in range(m):
            tag = (k - 1) * m + c
            send = Transfer(((r + k) % n, c), (r + k) % n, tag)
            recv = Transfer((r, c), (r - k) % n, tag)
            recvs[c].append(recv)
            steps.append(Step(tag, ((r + k) % n, c), (), send, recv))
    for c in range(m):
        steps.append(Step((n - 1) * m + c, (r, c), tuple(recvs[c])))
    return ScheduleTrace("direct_rs", r, n, m, tuple(steps))


# ---------------------------------------------------------------------------------------------
# Input checks and the per-slice matmul


def _as_list(tensors, name: str = "weights", what: str = "(K, N) weight") -> list[Tensor]:
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{name} is empty; pass at least one {what}")
    return tensors


def _check_weight(name: str, w: Tensor, k: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D (K, N) matrix, got shape {tuple(w.shape)}")
    if w.size(0) != k:
        raise ValueError(f"{name} has {w.size(0)} rows but the input's last dim (K) is {k}; "
                         "pass the weight as (K, N), e.g. linear.weight.t()")


def _bias_list(bias, count: int) -> list[Tensor | None]:
    if bias is None:
        return [None] * count
    if isinstance(bias, Tensor):
        bias = [bias]
    bias = list(bias)
    if len(bias) != count:
        raise ValueError(f"got {len(bias)} biases for {count} weights; pass one per weight "
                         "(None for a weight without bias)")
    return bias


def _dim(name: str, dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (..., K) @ w (K, N) (+ b) as the mm/addmm of a post-grad graph."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.size(-1))
    y = torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.size(1))


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _check_ag(fn: str, x: Tensor, weights: list[Tensor], gather_dim: int, pieces: int,
              pieces_name: str) -> int:
    if x.dim() < 2:
        raise ValueError(f"{fn}: x_shard must have a row dim and a K dim, got shape "
                         f"{tuple(x.shape)}")
    d = _dim("gather_dim", gather_dim, x.dim())
    if d == x.dim() - 1:
        raise ValueError(f"{fn}: gather_dim={gather_dim} is the contraction (K) dim of the "
                         "matmul; gathering it is a reduction, not a gather of rows")
    for j, w in enumerate(weights):
        _check_weight(f"weights[{j}]", w, x.size(-1))
    _check_positive(pieces_name, pieces)
    _check_divisible(fn, "x_shard", x.size(d), d, pieces, pieces_name)
    return d


def _check_divisible(fn: str, name: str, size: int, d: int, pieces: int,
                     pieces_name: str) -> None:
    if size % pieces:
        good = [q for q in range(1, size + 1) if size % q == 0 and q <= pieces]
        raise ValueError(f"{fn}: {name} has size {size} along gather_dim {d}, not divisible "
                         f"by {pieces_name}={pieces}; pad it to {-(-size // pieces) * pieces} "
                         f"or use {pieces_name}={good[-1]}")


def _check_rs(fn: str, h: Tensor, w: Tensor, scatter_dim: int, n: int, pieces: int,
              pieces_name: str) -> tuple[int, int]:
    if h.dim() < 2:
        raise ValueError(f"{fn}: h must have a row dim and a K dim, got shape {tuple(h.shape)}")
    _check_weight("w", w, h.size(-1))
    d = _dim("scatter_dim", scatter_dim, h.dim())
    _check_positive(pieces_name, pieces)
    size = w.size(1) if d == h.dim() - 1 else h.size(d)
    total = n * pieces
    if size % total:
        per_rank = f"; or use {pieces_name} dividing {size // n}" if size % n == 0 else ""
        raise ValueError(f"{fn}: the output has size {size} along scatter_dim {d}, not "
                         f"divisible by world size {n} x {pieces_name} {pieces} = {total}; pad "
                         f"it to {-(-size // total) * total}{per_rank}")
    return d, size


def _check_rs_terms(fn: str, terms, scatter_dim: int, n: int, pieces: int,
                    pieces_name: str) -> tuple[int, int]:
    """``_check_rs`` of every term; the terms' products must have one shape."""
    shapes = [(*h.shape[:-1], w.size(1)) for h, w, _ in terms]
    if any(shape != shapes[0] for shape in shapes[1:]):
        raise ValueError(f"{fn}: the matmuls of a sum have different output shapes {shapes}")
    for h, w, _ in terms:
        d, size = _check_rs(fn, h, w, scatter_dim, n, pieces, pieces_name)
    return d, size


def _partial(terms: list[tuple[Tensor, Tensor, Tensor | None]], d: int, ranges,
             out_dtype: torch.dtype | None = None) -> Tensor:
    """The rows (or, for the last dim, the columns) ``ranges`` = [(start, length)] of
    h_0 @ w_0 + b_0 + h_1 @ w_1 + b_1 + ... (summed left to right) along output dim d,
    concatenated in that order, cast to ``out_dtype`` when given."""
    total = None
    for h, w, b in terms:
        if d == h.dim() - 1:
            wc = _cat([w.narrow(1, s, n) for s, n in ranges], 1)
            bc = None if b is None else _cat([b.narrow(-1, s, n) for s, n in ranges], -1)
            y = _linear(h, wc, bc)
        else:
            y = _linear(_cat([h.narrow(d, s, n) for s, n in ranges], d), w, b)
        total = y if total is None else total + y
    return total if out_dtype is None else total.to(out_dtype)


def _rs_terms(fn: str, h, w, bias) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """(h_i, w_i, bias_i) of a reduce-scatter schedule's sum of matmuls: ``h``/``w`` a tensor
    each (one matmul) or sequences of equal length (``bias`` then None or a sequence)."""
    if isinstance(w, Tensor) and not isinstance(h, (list, tuple)):  # a tensor or AttentionRows
        return [(h, w, bias)]
    hs, ws = list(h), list(w)
    bs = [None] * len(hs) if bias is None else list(bias)
    if not hs or not (len(hs) == len(ws) == len(bs)):
        raise ValueError(f"{fn}: a sum of matmuls takes as many h, w (and bias) as terms, got "
                         f"{len(hs)} h, {len(ws)} w, {len(bs)} bias")
    return list(zip(hs, ws, bs))


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
    weights = _as_list(weights)
    biases = _bias_list(bias, len(weights))
    d = _check_ag(fn, x_shard, weights, gather_dim, chunks_per_rank, "chunks_per_rank")
    return _flash_ag(x_shard, d, chunks_per_rank, group_name, _input_compute(weights, biases),
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
    xs, biases, d = _check_weight_gather("flash_all_gather_weight_matmul", w_shard, inputs,
                                         bias, layout, chunks_per_rank, "chunks_per_rank")

    return _flash_ag(w_shard, d, chunks_per_rank, group_name, _weight_compute(xs, biases, layout),
                     out_dim=-1, count=len(xs), return_gathered=return_gathered,
                     with_ranges=True)


def _check_weight_gather(fn: str, w_shard: Tensor, inputs, bias, layout: str, pieces: int,
                         pieces_name: str):
    """(inputs as a list, biases as a list, gather dim) after checking them."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"{fn}: unknown layout {layout!r}; use one of {WEIGHT_LAYOUTS}")
    xs = _as_list(inputs, "inputs", "(..., K) input")
    biases = _bias_list(bias, len(xs))
    if w_shard.dim() != 2:
        raise ValueError(f"{fn}: w_shard must be a 2-D weight, got shape {tuple(w_shard.shape)}")
    d = 0 if layout == "linear" else 1
    k = w_shard.size(1 - d)
    for j, x in enumerate(xs):
        if x.dim() < 1 or x.size(-1) != k:
            raise ValueError(f"{fn}: inputs[{j}] has shape {tuple(x.shape)} but the weight's K "
                             f"dim is {k} (layout={layout!r}); the last dim must match")
    _check_positive(pieces_name, pieces)
    _check_divisible(fn, "w_shard", w_shard.size(d), d, pieces, pieces_name)
    return xs, biases, d


def _input_compute(weights: list[Tensor], biases: list[Tensor | None]):
    """compute(piece) for input gathers: the gathered rows in ``piece`` times every weight."""

    def compute(x: Tensor) -> list[Tensor]:
        return [_linear(x, w, b) for w, b in zip(weights, biases)]

    return compute


def _weight_compute(xs: list[Tensor], biases: list[Tensor | None], layout: str):
    """compute(piece, ranges) for weight gathers: every input times the gathered weight rows in
    ``piece``, plus the bias columns ``ranges`` = [(start, length)] they are."""

    def compute(piece: Tensor, ranges) -> list[Tensor]:
        b_mat = piece.t() if layout == "linear" else piece
        return [_linear(x, b_mat, None if b is None else
                        _cat([b.narrow(-1, s, n) for s, n in ranges], -1))
                for x, b in zip(xs, biases)]

    return compute


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
    ys = [_cat([outs[s][q] for s in order], out_dim) for q in range(count)]
    gathered = _cat([data[s] for s in order], d) if return_gathered else None
    return gathered, ys


# ---------------------------------------------------------------------------------------------
# Flash-RS


def flash_matmul_reduce_scatter(h: Tensor | Sequence[Tensor], w: Tensor | Sequence[Tensor], *,
                                group_name: str, scatter_dim: int = 0, variant: str = "ring",
                                chunks_per_rank: int = 1,
                                bias: Tensor | Sequence[Tensor | None] | None = None,
                                out_dtype: torch.dtype | None = None) -> Tensor:
    """``reduce_scatter_tensor(h @ w (+ bias), "sum", scatter_dim)`` with the reduce-scatter
    decomposed into P2P steps (``flash_rs_steps``): ``variant="ring"`` accumulates along the
    ring, ``"direct"`` sends every partial to its owner and sums locally. Every rank adds
    ``bias`` before the sum, as ``addmm -> reduce_scatter`` does. ``out_dtype``: each partial
    product is cast to it before it is sent or summed (autocast's fp32 reduce-scatter of a
    bf16 matmul: ``reduce_scatter((h @ w).float())``). Sequences ``h``, ``w`` (and ``bias``)
    reduce-scatter a sum of matmuls, ``h[0] @ w[0] + h[1] @ w[1] + ...`` summed left to right
    (the input gradient of a gate/up or Q/K/V projection pair sharing one gather).

    ``h``: (..., K), ``w``: (K, N). ``scatter_dim`` is a dim of the output (the last one slices
    the columns of ``w``). The result equals the collective up to float summation order (see
    the module docstring). With world size 1, a plain matmul.
    """
    fn = "flash_matmul_reduce_scatter"
    if variant not in RS_VARIANTS:
        raise ValueError(f"{fn}: unknown variant {variant!r}; use one of {RS_VARIANTS}")
    rank, n = group_rank_and_size(group_name)
    m = chunks_per_rank
    terms = _rs_terms(fn, h, w, bias)
    d, size = _check_rs_terms(fn, terms, scatter_dim, n, m, "chunks_per_rank")
    if n == 1:
        return _partial(terms, d, [(0, size)], out_dtype)
    length = size // (n * m)

    def partial(s: tuple[int, int]) -> Tensor:
        return _partial(terms, d, [((s[0] * m + s[1]) * length, length)], out_dtype)

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
    return _cat([result[(rank, c)] for c in range(m)], d)


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
        last of them, the first slice through the kernel's own causal mask (a square one),
        the others through their rows of it as an additive mask."""
        if not self._causal:
            return self._attention(q, k, v, *self._args, **self._kwargs)
        keys = q0 + ql
        k, v = k.narrow(2, 0, keys), v.narrow(2, 0, keys)
        if q0 == 0:
            return self._attention(q, k, v, *self._args, **self._kwargs)
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


# ---------------------------------------------------------------------------------------------
# Data slicing (the baseline)


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
    weights = _as_list(weights)
    biases = _bias_list(bias, len(weights))
    d = _check_ag(fn, x_shard, weights, gather_dim, chunks, "chunks")
    return _sliced_ag(x_shard, d, chunks, group_name, _input_compute(weights, biases),
                      out_dim=d, count=len(weights), return_gathered=return_gathered)


def sliced_all_gather_weight_matmul(w_shard: Tensor, inputs: Sequence[Tensor] | Tensor, *,
                                    group_name: str, layout: str = "linear", chunks: int = 2,
                                    bias: Sequence[Tensor | None] | Tensor | None = None,
                                    return_gathered: bool = False
                                    ) -> tuple[Tensor | None, list[Tensor]]:
    """The data-slicing baseline of ``flash_all_gather_weight_matmul``: ``chunks`` async
    all-gathers of pieces of the weight shard, each piece's output columns computed once its
    gather is waited for."""
    xs, biases, d = _check_weight_gather("sliced_all_gather_weight_matmul", w_shard, inputs,
                                         bias, layout, chunks, "chunks")
    return _sliced_ag(w_shard, d, chunks, group_name, _weight_compute(xs, biases, layout),
                      out_dim=-1, count=len(xs), return_gathered=return_gathered,
                      with_ranges=True)


def _sliced_ag(shard: Tensor, d: int, chunks: int, group_name: str, compute, *, out_dim: int,
               count: int, return_gathered: bool, with_ranges: bool = False
               ) -> tuple[Tensor | None, list[Tensor]]:
    """The data-slicing loop shared by the input and the weight gathers (``compute`` as in
    ``_flash_ag``; a gathered piece holds chunk c of every rank, owner-major)."""
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
    ys = [_cat([outs[c][q][j] for j in range(n) for c in range(chunks)], out_dim)
          for q in range(count)]
    gathered = None
    if return_gathered:
        split = [p.split(length, d) for p in pieces]
        gathered = _cat([split[c][j] for j in range(n) for c in range(chunks)], d)
    return gathered, ys


def sliced_matmul_reduce_scatter(h: Tensor | Sequence[Tensor], w: Tensor | Sequence[Tensor], *,
                                 group_name: str, scatter_dim: int = 0, chunks: int = 2,
                                 bias: Tensor | Sequence[Tensor | None] | None = None,
                                 out_dtype: torch.dtype | None = None) -> Tensor:
    """The data-slicing baseline of ``flash_matmul_reduce_scatter``: for each of ``chunks``
    pieces of every rank's output slice, compute that piece's partial (all owners at once) and
    post an async ``reduce_scatter_tensor`` before computing the next piece; wait all at the end
    (the last reduce-scatter is exposed)."""
    fn = "sliced_matmul_reduce_scatter"
    rank, n = group_rank_and_size(group_name)
    terms = _rs_terms(fn, h, w, bias)
    d, size = _check_rs_terms(fn, terms, scatter_dim, n, chunks, "chunks")
    if n == 1:
        return _partial(terms, d, [(0, size)], out_dtype)
    length = size // (n * chunks)
    started = []
    for c in range(chunks):
        part = _partial(terms, d, [((j * chunks + c) * length, length) for j in range(n)],
                        out_dtype)
        started.append(_c10d().reduce_scatter_tensor(
            part.movedim(d, 0).contiguous(), "sum", n, group_name))
    return _cat([_c10d().wait_tensor(t).movedim(0, d) for t in started], d)
