"""Row layouts (``leancompile/passes/row_layout.py``) of graphs traced with a symbolic batch:
the spellings real models produce, checked node by node."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.passes.row_layout import Mixed, RowLayout, find_row_layouts


def _layouts(fn, *shapes):
    # Functional, as AOTAutograd hands its graphs to the passes (in-place writes become
    # slice_scatter and friends).
    gm = make_fx(torch.func.functionalize(fn, remove="mutations"),
                 tracing_mode="symbolic")(*[torch.randn(s) for s in shapes])
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    symbol = x.meta["val"].shape[0].node.expr
    state = find_row_layouts(gm, {i: 1 for i in range(len(shapes))}, symbol)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [state[o] for o in (out if isinstance(out, (list, tuple)) else [out])]


def test_cat_of_a_tensor_with_itself_as_decompositions_spell_it():
    """Classifier-free guidance doubles the latents; decompositions turn ``cat([x, x])`` into
    unsqueeze -> expand -> clone -> view: two blocks of x's rows."""
    def cfg(x):
        doubled = x.unsqueeze(0).expand(2, *x.shape).clone().view(2 * x.shape[0], *x.shape[1:])
        uncond, cond = (doubled * 3).chunk(2)
        return doubled, uncond + 2 * (cond - uncond)

    doubled, guided = _layouts(cfg, (4, 3, 5))
    assert doubled == RowLayout(2, 1)
    assert guided == RowLayout(1, 1)


def test_the_batch_left_outside_dim_0_is_mixed():
    def lifted_and_reduced(x):
        return (x.unsqueeze(0).expand(2, *x.shape) * 2).sum(0), x.unsqueeze(0).clone()

    reduced, lifted = _layouts(lifted_and_reduced, (4, 3))
    assert isinstance(reduced, Mixed) and "outside dim 0" in reduced.reason
    assert isinstance(lifted, Mixed) and "outside dim 0" in lifted.reason


def test_a_fill_fits_the_layout_it_is_combined_with():
    """RoPE written into an ``empty`` buffer by strided copies (Wan's attention): the buffer
    has no rows of its own, the copies bring two blocks of the batch."""
    def rope(x):
        doubled = torch.cat([x, x * 2])                      # 2 blocks of 1 row per sample
        out = torch.empty(doubled.shape[0], 3, 4)
        out[..., 0::2] = doubled
        out[..., 1::2] = -doubled
        return out

    (out,) = _layouts(rope, (4, 3, 2))
    assert out == RowLayout(2, 1)


def test_the_batch_moved_behind_a_dim_of_pieces_and_back():
    """Sequence parallelism's spellings (without the collectives, which need a group; the
    2-rank GRPO test in test_ulysses.py runs them): a permute that moves the batch to dim 1
    behind the pieces, a split and a cat of whole pieces, and the permute back."""
    def gather_tokens(x):                                       # [B, S, D]
        pieces = x.movedim(1, 0).contiguous()                   # [S, B, D]: rows in dim 1
        parts = list(pieces.chunk(2, 0))
        return torch.cat(parts[::-1], 0).movedim(0, 1)

    def heads(x):                                               # [B, S, 2, H/2, D]
        pieces = x.permute(2, 0, 1, 3, 4)                       # [2, B, S, H/2, D]
        return pieces[1:].clone().permute(1, 0, 2, 3, 4)

    (gathered,) = _layouts(gather_tokens, (4, 6, 3))
    assert gathered == RowLayout(1, 1)
    (half,) = _layouts(heads, (5, 6, 2, 4, 3))
    assert half == RowLayout(1, 1)


def test_the_batch_behind_a_dim_of_pieces_is_mixed_when_rows_meet_or_it_stays_there():
    def reduced(x):
        return x.movedim(1, 0).sum(1), x.movedim(1, 0).clone()

    def batch_first_behind_a_symbolic_dim(x):
        return x.permute(1, 0, 2).permute(0, 2, 1).permute(2, 1, 0)

    summed, left = _layouts(reduced, (4, 6))
    assert isinstance(summed, Mixed) and isinstance(left, Mixed)
    assert "outside dim 0" in left.reason
    (moved,) = _layouts(batch_first_behind_a_symbolic_dim, (4, 6, 3))
    assert isinstance(moved, Mixed)
