"""What a reused forward needs at run time: row fingerprints, row gathering, and the autograd
node that stands for a forward that did not run again.

``row_hashes(t, batch)`` gives one 64-bit fingerprint per sample of a batch-major tensor (the
raw bits of its rows, weighted and summed in integer arithmetic on the tensor's device); equal
rows always hash alike, and a match is confirmed with ``torch.equal`` before anything is
reused, so a collision can cost a lookup but never a wrong value.

``gather_rows(pieces, outer, inner)`` builds a batch from rows of kept tensors: each piece is a
``(tensor, batch, rows)`` triple, the tensor's dim 0 laid out as ``outer`` blocks of ``batch``
samples of ``inner`` rows (``passes/row_layout.py``); the result has the pieces' rows, in order,
in the same layout. ``RowGather`` is the same gather planned once for every tensor of a call
(a regrouped update gathers dozens of saved tensors from the same kept calls, the same rows).

``Reused.apply(backward_fn, outputs, *inputs)`` returns ``outputs`` as the outputs of an
autograd node whose backward is ``backward_fn(cotangents) -> grads of inputs``: the update's
loss differentiates through what the rollout kept.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

__all__ = ["row_hashes", "whole_hash", "gather_rows", "RowGather", "Reused", "storage_bytes",
           "values_digest"]

_WEIGHTS: dict = {}


def _weights(n: int, device) -> Tensor:
    key = (n, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED + n)
        w = torch.randint(1, 2 ** 62, (n,), generator=g, dtype=torch.int64).to(device)
        _WEIGHTS[key] = w
    return w


def _words(as_bytes: Tensor, sizes=((torch.int32, 4), (torch.int16, 2))) -> Tensor:
    """``as_bytes`` (uint8, last dim contiguous) viewed as the widest word of ``sizes`` that
    its last dim and its offset allow (a view of a flat buffer may start at an offset no word
    size divides); bytes otherwise."""
    for dtype, size in sizes:
        if as_bytes.shape[-1] % size == 0 and as_bytes.storage_offset() % size == 0:
            return as_bytes.view(dtype)
    return as_bytes


def _as_words(t: Tensor, rows: int) -> Tensor:
    """The bits of ``t`` as ``[rows, words]`` int64 (whatever its dtype)."""
    flat = t.detach().contiguous().reshape(rows, -1)
    return _words(flat.view(torch.uint8)).to(torch.int64)


def row_hashes(t: Tensor, batch: int) -> list[int]:
    """One fingerprint per sample of ``t``, whose dim 0 holds ``batch`` samples (any number of
    rows each, sample-major)."""
    if batch == 0:
        return []
    words = _as_words(t, batch)
    if words.shape[1] == 0:
        return [0] * batch
    return (words * _weights(words.shape[1], words.device)).sum(1).tolist()


def whole_hash(t: Tensor) -> int:
    """One fingerprint of a whole tensor (with its shape and dtype)."""
    words = _as_words(t, 1)
    body = int((words * _weights(words.shape[1], words.device)).sum()) if words.shape[1] else 0
    return hash((body, tuple(t.shape), str(t.dtype)))


def values_digest(tensors) -> Tensor:
    """One int64 per tensor: the sum of its bits as 64-bit words (wrapping; 32- or 16-bit
    words when the size does not divide), read in place (no copy of a contiguous tensor). A
    write that changes the values changes it but for a coincidence: a cheap check, not a proof
    (``LeanStep`` compares it to notice parameters written through ``.data``, which version
    counters do not see). On this CPU, 58 ms for 134M fp32 values (a float sum: 39 ms)."""
    sums = []
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's part
        if t.is_meta or t.layout != torch.strided:
            continue  # (no values to read)
        words = _words(t.detach().reshape(-1).view(torch.uint8),
                       ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)))
        sums.append(words.sum(dtype=torch.int64))
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([x.to(sums[0].device) for x in sums])  # (parameters on several devices)


class RowGather:
    """The rows of a batch taken from several sources (kept calls), planned once and applied to
    each tensor of those sources alike: ``RowGather(batches, pieces)`` with ``batches`` the
    samples of each source and ``pieces`` the ``(source, rows)`` runs of the result in order;
    ``plan(tensors, outer, inner)`` gathers from one tensor per source (dim 0: ``outer`` blocks
    of ``batch`` samples of ``inner`` rows, as ``gather_rows``).

    Where each sample is one contiguous slab of memory (``outer`` 1, the tensor dense with dim 0
    outermost in memory, whatever the order of its other dims: attention's ``[B, heads, S, D]``
    views of ``[B, S, heads, D]`` buffers), the rows are copied slab by slab into a buffer laid
    out as the sources are, so the result has the sources' strides (the ones the forward
    traced, which the backward graph expects) and no second copy restrides it; otherwise they
    are gathered in the tensor's logical order and the result is contiguous.

    A small tensor (at most ``SMALL_BYTES`` of its sources' rows unused) is gathered with two
    ops, whatever the order of its rows: the sources concatenated whole, then one
    ``index_select`` (on small models each op's dispatch costs more than its copy; FlowGRPO's
    shuffled re-batching makes 8 runs of one row out of two kept calls). A larger one is
    gathered run by run (``gather_rows``, or one slab copy per run), copying no unused row::

        sources a (4 samples), b (4); pieces [(a, [1]), (b, [0]), (a, [3]), (b, [2])]
        small:  index_select(cat([a, b], 1), 1, [1, 4, 3, 6])
        large:  cat([a[:, [1]], b[:, [0]], a[:, [3]], b[:, [2]]], 1)
    """

    SMALL_BYTES = 1 << 18

    __slots__ = ("batches", "pieces", "rows", "index", "identity", "runs")

    def __init__(self, batches: list[int], pieces: list[tuple[int, list[int]]]):
        self.batches = list(batches)
        self.pieces = [(s, list(rows)) for s, rows in pieces]
        offsets = [0]
        for b in self.batches[:-1]:
            offsets.append(offsets[-1] + b)
        self.index = tuple(offsets[s] + r for s, rows in self.pieces for r in rows)
        self.rows = len(self.index)
        self.identity = self.index == tuple(range(sum(self.batches)))
        """The result is the sources concatenated whole, in order."""
        self.runs = []
        """``(source, first row, rows)``: the result's consecutive rows from one source."""
        for s, rows in self.pieces:
            for r in rows:
                last = self.runs[-1] if self.runs else None
                if last is not None and last[0] == s and last[1] + last[2] == r:
                    self.runs[-1] = (s, last[1], last[2] + 1)
                else:
                    self.runs.append((s, r, 1))

    def __call__(self, tensors: list[Tensor], outer: int, inner) -> Tensor:
        first = tensors[0]
        if self.identity and len(tensors) == 1:
            return first
        inner = rows_per_sample(inner, tensors, outer, self.batches)
        slab = _slab_layout(tensors, self.batches, inner) if outer == 1 else None
        small = self.identity or (
            first.numel() * first.element_size() // max(1, self.batches[0])
            * (sum(self.batches) - self.rows) <= self.SMALL_BYTES)
        if slab is not None:
            return self._by_slab(tensors, slab, small)
        if not small:
            return gather_rows([(tensors[s], self.batches[s], rows)
                                for s, rows in self.pieces], outer, inner)
        blocks = [t.reshape(outer, b, inner, *t.shape[1:]) for t, b in zip(tensors, self.batches)]
        joined = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if not self.identity:
            joined = joined.index_select(1, _row_index(self.index, joined.device))
        return joined.reshape(-1, *joined.shape[3:]).contiguous()

    def _by_slab(self, tensors: list[Tensor], slab: tuple, small: bool) -> Tensor:
        """The gather on sample slabs (``_slab_layout``), the result strided as the sources."""
        per_sample, shape, stride = slab
        flats = [t.as_strided((b, per_sample), (per_sample, 1))
                 for t, b in zip(tensors, self.batches)]
        if small:
            joined = flats[0] if len(flats) == 1 else torch.cat(flats)
            out = joined if self.identity else joined.index_select(
                0, _row_index(self.index, joined.device))
        else:
            out = torch.empty((self.rows, per_sample), dtype=tensors[0].dtype,
                              device=tensors[0].device)
            at = 0
            for s, r, n in self.runs:
                out[at:at + n].copy_(flats[s][r:r + n])
                at += n
        return out.as_strided((self.rows * shape[0], *shape[1:]), stride)


def _slab_layout(tensors: list[Tensor], batches: list[int], inner: int):
    """``(elements per sample, sizes per sample, strides)`` when every source is dense with
    dim 0 outermost in memory (each sample one contiguous slab) and all lay a sample out
    alike; None otherwise. The sizes per sample are ``(inner, *shape[1:])``."""
    layout = None
    for t, batch in zip(tensors, batches):
        this = _sample_slab(tuple(t.shape), t.stride(), batch, inner)
        if this is None or (layout is not None and this != layout):
            return None
        layout = this
    return layout


@functools.lru_cache(maxsize=4096)
def _sample_slab(shape: tuple, stride: tuple, batch: int, inner: int):
    """``_slab_layout`` for one tensor, from its sizes and strides (cached: a regrouped update
    asks it for dozens of saved tensors per call, the same few layouts)."""
    if not shape or shape[0] != batch * inner or batch == 0 or 0 in shape:
        return None
    dense = 1
    for st, size in sorted((st, size) for st, size in zip(stride[1:], shape[1:]) if size != 1):
        if st != dense:
            return None  # overlapping or with gaps: not one slab per row
        dense *= size
    if shape[0] != 1 and stride[0] != dense:
        return None  # dim 0 is not the outermost dim in memory
    return dense * inner, (inner, *shape[1:]), (dense, *stride[1:])


def gather_rows(pieces: list[tuple[Tensor, int, list[int]]], outer: int, inner) -> Tensor:
    """The rows ``rows`` of each ``(tensor, batch, rows)`` piece, concatenated in order, for
    tensors whose dim 0 is ``outer`` blocks of ``batch`` samples of ``inner`` rows."""
    if not isinstance(inner, int):
        inner = rows_per_sample(inner, [t for t, _, _ in pieces], outer,
                                [b for _, b, _ in pieces])
    parts = []
    for tensor, batch, rows in pieces:
        blocks = tensor.reshape(outer, batch, inner, *tensor.shape[1:])
        rows = tuple(rows)
        if rows == tuple(range(batch)):
            parts.append(blocks)
        else:
            parts.append(blocks.index_select(1, _row_index(rows, tensor.device)))
    joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return joined.reshape(-1, *joined.shape[3:]).contiguous()


def rows_per_sample(inner, tensors: list[Tensor], outer: int, batches: list[int]) -> int:
    """A row layout's ``inner`` (rows per sample in each of ``outer`` blocks) for ``tensors``
    of ``batches`` samples each: the int itself, or, where it is a count of other sizes the
    graph holds dynamic (``RowLayout.inner`` a sympy expression), that count read off the
    tensors' dim 0, which every tensor must agree on."""
    if isinstance(inner, int):
        return inner
    counts = set()
    for t, batch in zip(tensors, batches):
        count, rest = divmod(t.shape[0], outer * batch) if outer * batch else (0, 1)
        if rest or count <= 0:
            raise RuntimeError(
                f"leancompile: a kept tensor of shape {tuple(t.shape)} is not {outer} block(s) "
                f"of {batch} samples of {inner} rows; this is a bug in leancompile, please "
                f"report it (the update call can run with schedule='recompute')")
        counts.add(count)
    if len(counts) != 1:
        raise RuntimeError(
            f"leancompile: kept calls disagree on {inner} rows per sample ({sorted(counts)}); "
            f"this is a bug in leancompile, please report it (schedule='recompute' avoids it)")
    return counts.pop()


@functools.lru_cache(maxsize=1024)
def _row_index(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """The index tensor of ``rows`` on ``device``, made once: an update call gathers the same
    rows from every saved tensor of its kept calls (dozens per call), and a host-to-device
    index per tensor cost more than the gather on small models. Made outside inference mode
    whatever the caller's mode: a cached index first made under ``torch.inference_mode()``
    would be an inference tensor, which a later gather that autograd records could not save."""
    with torch.inference_mode(False):
        return torch.tensor(rows, device=device)


def storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those shared with any
    tensor in ``exclude`` (inputs and parameters the caller holds anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude if isinstance(t, Tensor)}
    seen = {}
    for t in tensors:
        if isinstance(t, Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _BackwardFn:
    """Holds a ``Reused`` node's backward function (and through it what the rollout kept)
    until autograd frees the node's saved state: after a backward without ``retain_graph``,
    or when the graph is dropped."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn):
        self.fn = fn

    def drop(self) -> None:
        self.fn = None


class Reused(torch.autograd.Function):
    """Outputs of a forward that did not run again; backward through ``backward_fn``.

    It behaves as a graph autograd recorded: ``backward(retain_graph=True)`` (or
    ``autograd.grad(..., retain_graph=True)`` for logging) leaves it for a second backward; a
    second backward without it raises autograd's own "backward through the graph a second
    time" error (a token saved for backward is what autograd frees, and freeing it drops the
    backward function with what it holds); ``create_graph=True`` raises, as
    ``torch.compile``'s compiled backward does (the graphs are not differentiable twice)."""

    @staticmethod
    def forward(ctx, backward_fn, outputs, *inputs):
        holder = _BackwardFn(backward_fn)
        ctx.holder = holder
        token = torch.empty(0)
        ctx.save_for_backward(token)
        weakref.finalize(token, holder.drop)
        ctx.set_materialize_grads(False)
        results = tuple(o.detach() if isinstance(o, Tensor) else o for o in outputs)
        non_diff = [o for o in results if isinstance(o, Tensor) and not o.is_floating_point()
                    and not o.is_complex()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return results

    @staticmethod
    def backward(ctx, *cotangents):
        ctx.saved_tensors  # autograd's error if a backward without retain_graph freed it
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a double backward (create_graph=True, e.g. a gradient penalty) through a "
                "lean_compile step: its compiled backward graphs are not differentiable "
                "themselves (as torch.compile's are not). Compute the penalty from an "
                "uncompiled call of the function")
        return (None, None, *ctx.holder.fn(list(cotangents)))
