"""``runtime/reuse.gather_rows``: the rows of kept tensors put together, against plain
indexing, and its cached row indices whatever mode they were first made in."""

import torch

from leancompile.runtime.reuse import gather_rows


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
