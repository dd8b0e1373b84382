"""``runtime/reuse.gather_rows`` and ``RowGather``: the rows of kept tensors put together,
against plain indexing, and the cached row indices whatever mode they were first made in."""

import pytest
import torch

from leancompile.runtime.reuse import RowGather, gather_rows


def test_gathered_rows_equal_indexing_and_carry_gradients():
    a = torch.randn(2 * 3 * 2, 5, requires_grad=True)  # outer 2, batch 3, inner 2
    b = torch.randn(2 * 2 * 2, 5, requires_grad=True)  # outer 2, batch 2, inner 2
    got = gather_rows([(a, 3, [2, 0]), (b, 2, [1])], 2, 2)
    blocks_a, blocks_b = a.view(2, 3, 2, 5), b.view(2, 2, 2, 5)
    want = torch.cat([blocks_a[:, [2, 0]], blocks_b[:, [1]]], 1).reshape(-1, 5)
    assert torch.equal(got, want)
    got.sum().backward()
    assert a.grad.view(2, 3, 2, 5)[:, 1].abs().sum() == 0
    assert b.grad.view(2, 2, 2, 5)[:, 0].abs().sum() == 0


def test_an_index_first_made_under_inference_mode_serves_a_recorded_gather():
    # A rollout under torch.inference_mode() may gather first; the cached index must still
    # be usable by a gather that autograd records (it saves the index for its backward).
    t = torch.randn(4, 3)
    with torch.inference_mode():
        gather_rows([(t, 4, [3, 1])], 1, 1)
    x = torch.randn(4, 3, requires_grad=True)
    y = gather_rows([(x, 4, [3, 1])], 1, 1)
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[0.0] * 3, [1.0] * 3, [0.0] * 3, [1.0] * 3]))


@pytest.mark.parametrize("small", [True, False])
def test_a_planned_gather_equals_indexing_on_both_of_its_paths(small, monkeypatch):
    """FlowGRPO's shuffled re-batching: rows alternating between two kept calls, one of them
    used twice, outer 2 x inner 3 rows per sample; the small path (the sources concatenated,
    one index_select) and the large one (run by run) give the same tensor, with the strides
    of a fresh one."""
    if not small:
        monkeypatch.setattr(RowGather, "SMALL_BYTES", 0)
    a, b = torch.randn(2 * 4 * 3, 5), torch.randn(2 * 3 * 3, 5)  # batches 4 and 3
    pieces = [(0, [1]), (1, [0]), (0, [3, 2]), (1, [2]), (0, [1])]
    got = RowGather([4, 3], pieces)([a, b], 2, 3)
    blocks = [a.view(2, 4, 3, 5), b.view(2, 3, 3, 5)]
    want = torch.cat([blocks[s][:, rows] for s, rows in pieces], 1).reshape(-1, 5)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(got, gather_rows([([a, b][s], [4, 3][s], rows) for s, rows in pieces],
                                        2, 3))
    # every row of the sources in order: the concatenation itself (one source: the tensor)
    whole = RowGather([4, 3], [(0, [0, 1, 2, 3]), (1, [0, 1, 2])])([a, b], 1, 6)
    assert torch.equal(whole, torch.cat([a, b]))
    same = RowGather([4], [(0, [0, 1, 2, 3])])([a], 2, 3)
    assert torch.equal(same, a) and same.data_ptr() == a.data_ptr()  # (no copy)


@pytest.mark.parametrize("small", [True, False])
def test_a_gather_of_permuted_attention_layouts_keeps_their_strides(small, monkeypatch):
    """Attention saves ``[B, heads, S, D]`` views of ``[B, S, heads, D]`` buffers: each sample
    is one slab of memory but the tensor is not contiguous. The gathered rows equal indexing and
    come out with the sources' strides (the ones the backward graph was traced with), on both
    paths; a source with gaps between its samples (a slice) is gathered in logical order."""
    if not small:
        monkeypatch.setattr(RowGather, "SMALL_BYTES", 0)
    a = torch.randn(4, 6, 2, 3).transpose(1, 2)  # batch 4: [4, 2, 6, 3], strides (36, 3, 6, 1)
    b = torch.randn(3, 6, 2, 3).transpose(1, 2)  # batch 3
    pieces = [(0, [1]), (1, [0]), (0, [3, 2]), (1, [2]), (0, [1])]
    plan = RowGather([4, 3], pieces)
    got = plan([a, b], 1, 1)
    want = torch.cat([[a, b][s][rows] for s, rows in pieces])
    assert torch.equal(got, want) and got.stride() == (36, 3, 6, 1)
    assert torch.equal(plan([a.contiguous(), b.contiguous()], 1, 1), want)
    gappy = torch.randn(4, 2, 6, 4)[..., :3]  # each sample's rows end in an unused column
    other = torch.randn(3, 2, 6, 4)[..., :3]
    got = plan([gappy, other], 1, 1)
    assert torch.equal(got, torch.cat([[gappy, other][s][rows] for s, rows in pieces]))
    assert got.is_contiguous()
    # two rows per sample (inner 2), the other dims permuted: still one slab per sample
    a2 = torch.randn(4 * 2, 6, 3).transpose(1, 2)  # [8, 3, 6], strides (18, 1, 3)
    b2 = torch.randn(3 * 2, 6, 3).transpose(1, 2)
    got = plan([a2, b2], 1, 2)
    blocks = [a2.reshape(4, 2, 3, 6), b2.reshape(3, 2, 3, 6)]
    want = torch.cat([blocks[s][rows] for s, rows in pieces]).reshape(-1, 3, 6)
    assert torch.equal(got, want) and got.stride() == (18, 1, 3)
