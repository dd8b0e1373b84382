"""Row layouts (``leancompile/passes/row_layout.py``) of graphs traced with a symbolic batch:
the spellings real models produce, checked node by node."""

import pytest
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


def test_rows_picked_out_of_the_batch_are_named_as_picked_not_reduced():
    """An op that takes the batch dim out: a reduction, or picked rows (``x[0]``, ``x[:2]``,
    ``x[idx]``), which every row's output would then share. Both are "rows meet", each said as
    what it is (the pick was worded "reduces over the batch")."""
    def picks(x):
        return (x[0] * 2, x[:2] + 1, x[torch.tensor([1, 0])], x.index_select(0, torch.tensor([1])),
                x.sum(0))

    layouts = _layouts(picks, (4, 3))
    assert all(isinstance(m, Mixed) for m in layouts), layouts
    reasons = [m.reason for m in layouts]
    assert "aten.select.int" in reasons[0] and "picks row 0 of the batch" in reasons[0]
    assert "picks 2 fixed rows of the batch" in reasons[1] and "slice" in reasons[1]
    assert "picks 2 fixed rows of the batch" in reasons[2] and "aten.index.Tensor" in reasons[2]
    assert "picks 1 fixed row of the batch" in reasons[3]
    assert "aten.sum" in reasons[4] and "reduces over the batch" in reasons[4]


def test_rows_per_sample_that_are_a_dynamic_size():
    """``torch.compile(dynamic=True)`` (here: every size symbolic): a linear layer on
    ``[B, L, D]`` flattens to ``[B*L, D]``, ``L`` rows per sample with ``L`` a symbol; every
    such row was "dim 0 is s0*s1, not a multiple of the batch size", and no update call of a
    ``lean_compile(..., dynamic=True)`` step was served. A count that may not be a whole
    number of rows per sample stays mixed."""
    def tokens(x):
        b, length, d = x.shape
        flat = x.reshape(b * length, d) @ torch.ones(d, d)
        return flat, flat.reshape(b, length, d) + 1, x.reshape(-1, 2 * d), torch.cat([flat, flat])

    flat, back, halves, doubled = _layouts(tokens, (4, 6, 8))
    # L's symbol (sympy), not the batch's
    assert isinstance(flat, RowLayout) and flat.outer == 1 and flat.inner.is_Symbol, flat
    assert back == RowLayout(1, 1)
    assert isinstance(halves, Mixed), halves
    assert doubled == RowLayout(2, flat.inner), doubled


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
    """Sequence parallelism's spellings without the collectives (below with them): a permute
    that moves the batch to dim 1 behind the pieces, a split and a cat of whole pieces, and the
    permute back."""
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

    def batch_moved_on_to_dim_2(x):
        return x.permute(1, 0, 2).permute(0, 2, 1).permute(2, 1, 0)

    summed, left = _layouts(reduced, (4, 6))
    assert isinstance(summed, Mixed) and isinstance(left, Mixed)
    assert "outside dim 0" in left.reason
    (moved,) = _layouts(batch_moved_on_to_dim_2, (4, 6, 3))
    assert isinstance(moved, Mixed)


def test_one_projection_for_query_key_and_value_picked_out_of_a_dim_of_pieces():
    """``qkv(x).unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)`` puts the three projections
    in dim 0 and the batch in dim 1; ``unbind(0)`` or ``[i]`` brings each back with the rows in
    dim 0. Picking along dim 1, summing the pieces of the batch, or unbinding a later dim (the
    rows stay in dim 1) is still Mixed."""
    def unbound(x):
        q, k, v = x.unflatten(-1, (3, 2, 2)).permute(2, 0, 3, 1, 4).unbind(0)
        return q * k + v

    def selected(x):
        qkv = x.unflatten(-1, (3, 2, 2)).permute(2, 0, 3, 1, 4)
        return qkv[0] + qkv[2], qkv[:, 0], qkv.sum(1)

    def unbound_later(x):  # (the adversarial review's find: a later dim leaves them in dim 1)
        return x.unflatten(-1, (3, 2, 2)).permute(2, 0, 3, 1, 4).unbind(2)[0]

    assert _layouts(unbound, (4, 5, 12)) == [RowLayout(1, 1)]
    picked, across, summed = _layouts(selected, (4, 5, 12))
    assert picked == RowLayout(1, 1)
    assert isinstance(across, Mixed) and isinstance(summed, Mixed)
    (later,) = _layouts(unbound_later, (4, 5, 12))
    assert isinstance(later, Mixed) and "outside dim 0" in later.reason


@pytest.fixture
def group():
    """A fake two-rank process group (traces collectives, runs nothing), declared to hold the
    same rows on both ranks as a sequence-parallel group is; `undeclared` is another."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from leancompile.passes.row_layout import declare_same_rows, forget_same_rows

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        declared, undeclared = dist.group.WORLD, dist.new_group([0, 1])
        declare_same_rows(declared)
        yield declared, undeclared
        forget_same_rows(declared)
    finally:
        dist.destroy_process_group()


def _layouts_dim0(fn, *shapes):
    """Traced with only dim 0 symbolic (what capture's ``mark_dynamic(x, 0)`` gives)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())
    inputs = [mode.from_tensor(torch.randn(s), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (len(s) - 1)))
        for s in shapes]
    with mode:
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    state = find_row_layouts(gm, {0: 1}, x.meta["val"].shape[0].node.expr)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [state[o] for o in out]


def test_collectives_keep_rows_only_over_whole_pieces_of_a_same_rows_group(group):
    import torch.distributed._functional_collectives as funcol

    declared, undeclared = group

    def exchange(x, g):
        out = funcol.all_to_all_single(x.contiguous(), None, None, g)
        return out.wait() if hasattr(out, "wait") else out

    def ulysses(x):                                   # [B, S, 2, H/2, D], as seq_to_heads
        heads = exchange(x.permute(2, 0, 1, 3, 4), declared).permute(1, 0, 2, 3, 4)
        other = exchange(x.permute(2, 0, 1, 3, 4), undeclared).permute(1, 0, 2, 3, 4)
        gathered = funcol.all_gather_tensor(x.movedim(1, 0).contiguous(), 0, declared)
        return heads.clone(), other.clone(), gathered.movedim(0, 1).clone()

    def batch_major(x):                               # [B, 2, D] -> [2B, D]: rows in dim 0
        return (exchange(x.reshape(-1, x.shape[-1]), declared) * 2,)

    heads, other, gathered = _layouts_dim0(ulysses, (3, 4, 2, 2, 5))
    assert heads == RowLayout(1, 1) and gathered == RowLayout(1, 1), (heads, gathered)
    assert isinstance(other, Mixed) and "declare_same_rows" in other.reason, other
    # The exchange moves another rank's rows in: rank 0's sample 1 would get rank 1's
    # sample 0 (a probe on 2 ranks: whole batch [0, 1, 100, 101], row by row [0, 100, 2, 102])
    (rows,) = _layouts_dim0(batch_major, (3, 2, 5))
    assert isinstance(rows, Mixed) and "batch dim" in rows.reason, rows
