"""``runtime/accumulate.py``: the vectorised row backward made to add into gradient buffers in
place gives the buffers plus the gradients it used to return; weight gradients become in-place
batched matmuls only where the buffer and the matmul's output are the same memory order."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.runtime.accumulate import accumulating

aten = torch.ops.aten


def _rows_backward(x, dy, w):
    """Per-row gradients of ``y = x @ w.T + b`` (rows stacked in dim 0): weight, bias, and a
    gradient every row shares (``w`` is not per row: its "gradient" here is the same for all
    rows, as vmap returns row-independent gradients)."""
    def one(x, dy):
        grad_w = dy.t() @ x                     # [out, in]
        grad_b = dy.sum(0)
        grad_shared = w * 2.0
        return grad_w, grad_b, grad_shared
    return torch.func.vmap(one)(x, dy)


def _graph():
    x, dy, w = torch.randn(3, 5, 4), torch.randn(3, 5, 6), torch.randn(6, 4)
    return make_fx(_rows_backward, tracing_mode="fake")(x, dy, w), (x, dy, w)


def test_adds_into_the_buffers_in_place_like_adding_afterwards():
    traced, inputs = _graph()
    fused, count = accumulating(traced)
    ops = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert count == 1 and aten.baddbmm_.default in ops and aten.bmm.default not in ops
    expected = traced(*inputs)
    buffers = [torch.randn_like(t.contiguous()) for t in expected]
    before = [b.clone() for b in buffers]
    pointers = [b.data_ptr() for b in buffers]
    assert fused(*inputs, *buffers) == ()
    for b, b0, e, p in zip(buffers, before, expected, pointers):
        assert b.data_ptr() == p  # in place
        torch.testing.assert_close(b, b0 + e, rtol=1e-6, atol=1e-6)
    # The row-independent gradient came back as one value for every row: each row's
    # buffer got it once (no row's slice aliases another's).
    torch.testing.assert_close(buffers[2] - before[2], (inputs[2] * 2.0).expand(3, 6, 4))


def test_a_matmul_used_twice_or_seen_non_contiguous_is_added_afterwards():
    def rows_backward(x, dy):
        def one(x, dy):
            g = dy.t() @ x
            return g, g * 3, (dy.t() @ x).t()   # used twice; transposed (not contiguous)
        return torch.func.vmap(one)(x, dy)

    x, dy = torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    traced = make_fx(rows_backward, tracing_mode="fake")(x, dy)
    fused, count = accumulating(traced)
    assert count == 0
    expected = traced(x, dy)
    buffers = [torch.zeros(t.shape) for t in expected]
    fused(x, dy, *buffers)
    for b, e in zip(buffers, expected):
        torch.testing.assert_close(b, e)
