"""The canonicalize pass on real traced graphs (make_fx) and on hand-built ones."""

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.passes import canonicalize_pass

aten = torch.ops.aten


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_view_becomes_reshape_and_values_are_unchanged():
    def f(x, w):
        y = aten.mm(x, w)
        return aten.view(y, [2, 4, 16]).sum(1)

    x, w = torch.randn(8, 12), torch.randn(12, 16)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    assert aten.view.default in targets(gm)
    result = canonicalize_pass(gm)
    assert aten.view.default not in targets(gm)
    assert aten.reshape.default in targets(gm)
    assert [s.kind for s in result.rewritten] == ["view->reshape"]
    assert result.skipped == []
    torch.testing.assert_close(gm(x, w), f(x, w), rtol=0, atol=0)
    # meta["val"] stays valid: the rewritten node's recorded shape is the shape it computes.
    node = next(n for n in gm.graph.nodes if n.target is aten.reshape.default)
    assert tuple(node.meta["val"].shape) == (2, 4, 16)


def test_unsafe_view_rewritten_only_where_no_one_can_see_the_alias():
    def f(x, w):
        private = aten.mm(x, w)              # read by the _unsafe_view only
        a = aten._unsafe_view(private, [64])
        shared = aten.mm(x, w)               # read twice
        b = aten._unsafe_view(shared, [64])
        c = aten._unsafe_view(x, [96])       # a graph input
        returned = aten.relu(shared)         # and shared is also... via relu; next: an output
        out_base = aten.mm(x, w)
        d = aten._unsafe_view(out_base, [64])
        return a, b, c, returned, out_base, d

    x, w = torch.randn(8, 12), torch.randn(12, 8)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    result = canonicalize_pass(gm)
    assert len(result.rewritten) == 1 and result.rewritten[0].kind == "view->reshape"
    reasons = sorted(s.reason for s in result.skipped)
    assert len(reasons) == 3
    assert any("graph input" in r for r in reasons)
    assert any("2 readers" in r for r in reasons)
    assert any("graph output" in r for r in reasons)
    assert targets(gm).count(aten._unsafe_view.default) == 3
    for got, want in zip(gm(x, w), f(x, w)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dead_pure_chains_are_dropped_and_side_effects_kept_with_reasons():
    def f(x):
        dead = aten.relu(aten.mul(x, 2.0))   # a dead chain of two nodes
        aten.rand([3])                        # dead, but random: kept
        buf = aten.zeros([4])
        aten.add_(buf, 1.0)                   # dead, but mutates: kept
        return aten.sin(x)

    x = torch.randn(4)
    gm = make_fx(f)(x)
    before = targets(gm)
    assert aten.relu.default in before and aten.mul.Tensor in before
    result = canonicalize_pass(gm)
    after = targets(gm)
    assert aten.relu.default not in after and aten.mul.Tensor not in after
    assert aten.rand.default in after and aten.add_.Tensor in after
    assert sorted(s.node for s in result.rewritten if s.kind == "dead code") == ["mul", "relu"]
    reasons = {s.target: s.reason for s in result.skipped}
    assert "random op" in reasons["aten.rand.default"]
    assert "mutates" in reasons["aten.add_.Tensor"]
    torch.testing.assert_close(gm(x), torch.sin(x))


def test_dead_collective_is_kept_with_reason():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    graph.output(graph.call_function(aten.neg.default, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    result = canonicalize_pass(gm)
    assert torch.ops._c10d_functional.all_reduce.default in targets(gm)
    assert result.rewritten == []
    assert len(result.skipped) == 1 and "collective" in result.skipped[0].reason


def test_graph_without_work_reports_nothing_and_is_untouched():
    gm = make_fx(lambda x: aten.add(x, 1))(torch.randn(3))
    code = gm.code
    result = canonicalize_pass(gm)
    assert result.rewritten == [] and result.skipped == [] and gm.code == code


def test_skipped_site_requires_a_reason():
    from leancompile.passes import PassResult

    with pytest.raises(ValueError, match="reason"):
        PassResult(name="x").skip("node", "kind", "")


def test_copy_into_a_fresh_buffer_is_its_source():
    """``copy(empty(...), src)`` (an in-place c10d collective into a fresh buffer,
    functionalized) reads as ``src``; a buffer of another dtype (a conversion) or one also read
    elsewhere stays, and so does a copy that is a graph output."""

    def f(x, w):
        y = aten.mm(x, w)
        same = aten.copy(aten.empty.memory_format([8, 16], dtype=torch.float32), y)
        cast = aten.copy(aten.empty.memory_format([8, 16], dtype=torch.float64), y)
        shared = aten.empty.memory_format([8, 16], dtype=torch.float32)
        kept = aten.copy(shared, y)
        out = aten.copy(aten.empty.memory_format([8, 16], dtype=torch.float32), y)
        return same.relu() + cast.float() + kept + shared.zero_(), out

    x, w = torch.randn(8, 12), torch.randn(12, 16)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    assert targets(gm).count(aten.copy.default) == 4
    result = canonicalize_pass(gm)
    assert [s.kind for s in result.rewritten if s.kind == "buffer copy"] == ["buffer copy"]
    assert [s.reason for s in result.skipped if s.kind == "buffer copy"] == [
        "the copy is a graph output and its source is not a collective's result; it stays a "
        "copy"]
    assert targets(gm).count(aten.copy.default) == 3
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert relu.args[0].target is aten.mm.default
    for got, want in zip(gm(x, w), f(x, w)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
