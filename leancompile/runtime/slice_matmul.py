"""What every FlashOverlap schedule (``flash_schedules.py``) and its data-slicing baseline
(``sliced_schedules.py``) share: the checks of their arguments, with the fix in each message,
and the matmul of one slice (``partial_product``, ``input_compute``, ``weight_compute``) as
the mm/addmm a post-grad graph holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .flash_steps import check_positive

__all__ = ["WEIGHT_LAYOUTS", "as_list", "bias_list", "cat_pieces", "check_ag", "check_rs_terms",
           "check_weight_gather", "input_compute", "partial_product", "rs_terms",
           "weight_compute"]

WEIGHT_LAYOUTS = ("linear", "kn")


def as_list(tensors, name: str = "weights", what: str = "(K, N) weight") -> list[Tensor]:
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


def bias_list(bias, count: int) -> list[Tensor | None]:
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


def cat_pieces(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def check_ag(fn: str, x: Tensor, weights: list[Tensor], gather_dim: int, pieces: int,
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
    check_positive(pieces_name, pieces)
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
    check_positive(pieces_name, pieces)
    size = w.size(1) if d == h.dim() - 1 else h.size(d)
    total = n * pieces
    if size % total:
        per_rank = f"; or use {pieces_name} dividing {size // n}" if size % n == 0 else ""
        raise ValueError(f"{fn}: the output has size {size} along scatter_dim {d}, not "
                         f"divisible by world size {n} x {pieces_name} {pieces} = {total}; pad "
                         f"it to {-(-size // total) * total}{per_rank}")
    return d, size


def check_rs_terms(fn: str, terms, scatter_dim: int, n: int, pieces: int,
                   pieces_name: str) -> tuple[int, int]:
    """``_check_rs`` of every term; the terms' products must have one shape."""
    shapes = [(*h.shape[:-1], w.size(1)) for h, w, _ in terms]
    if any(shape != shapes[0] for shape in shapes[1:]):
        raise ValueError(f"{fn}: the matmuls of a sum have different output shapes {shapes}")
    for h, w, _ in terms:
        d, size = _check_rs(fn, h, w, scatter_dim, n, pieces, pieces_name)
    return d, size


def partial_product(terms: list[tuple[Tensor, Tensor, Tensor | None]], d: int, ranges,
                    out_dtype: torch.dtype | None = None,
                    term_dtype: torch.dtype | None = None) -> Tensor:
    """The rows (or, for the last dim, the columns) ``ranges`` = [(start, length)] of
    h_0 @ w_0 + b_0 + h_1 @ w_1 + b_1 + ... (summed left to right) along output dim d,
    concatenated in that order, each term cast to ``term_dtype`` before the sum and the sum to
    ``out_dtype``, when given."""
    total = None
    for h, w, b in terms:
        if d == h.dim() - 1:
            wc = cat_pieces([w.narrow(1, s, n) for s, n in ranges], 1)
            bc = None if b is None else cat_pieces([b.narrow(-1, s, n) for s, n in ranges], -1)
            y = _linear(h, wc, bc)
        else:
            y = _linear(cat_pieces([h.narrow(d, s, n) for s, n in ranges], d), w, b)
        if term_dtype is not None:
            y = y.to(term_dtype)
        total = y if total is None else total + y
    return total if out_dtype is None else total.to(out_dtype)


def rs_terms(fn: str, h, w, bias) -> list[tuple[Tensor, Tensor, Tensor | None]]:
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



def check_weight_gather(fn: str, w_shard: Tensor, inputs, bias, layout: str, pieces: int,
                        pieces_name: str):
    """(inputs as a list, biases as a list, gather dim) after checking them."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"{fn}: unknown layout {layout!r}; use one of {WEIGHT_LAYOUTS}")
    xs = as_list(inputs, "inputs", "(..., K) input")
    biases = bias_list(bias, len(xs))
    if w_shard.dim() != 2:
        raise ValueError(f"{fn}: w_shard must be a 2-D weight, got shape {tuple(w_shard.shape)}")
    d = 0 if layout == "linear" else 1
    k = w_shard.size(1 - d)
    for j, x in enumerate(xs):
        if x.dim() < 1 or x.size(-1) != k:
            raise ValueError(f"{fn}: inputs[{j}] has shape {tuple(x.shape)} but the weight's K "
                             f"dim is {k} (layout={layout!r}); the last dim must match")
    check_positive(pieces_name, pieces)
    _check_divisible(fn, "w_shard", w_shard.size(d), d, pieces, pieces_name)
    return xs, biases, d


def input_compute(weights: list[Tensor], biases: list[Tensor | None]):
    """compute(piece) for input gathers: the gathered rows in ``piece`` times every weight."""

    def compute(x: Tensor) -> list[Tensor]:
        return [_linear(x, w, b) for w, b in zip(weights, biases)]

    return compute


def weight_compute(xs: list[Tensor], biases: list[Tensor | None], layout: str):
    """compute(piece, ranges) for weight gathers: every input times the gathered weight rows in
    ``piece``, plus the bias columns ``ranges`` = [(start, length)] they are."""

    def compute(piece: Tensor, ranges) -> list[Tensor]:
        b_mat = piece.t() if layout == "linear" else piece
        return [_linear(x, b_mat, None if b is None else
                        cat_pieces([b.narrow(-1, s, n) for s, n in ranges], -1))
                for x, b in zip(xs, biases)]

    return compute

