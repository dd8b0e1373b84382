"""``passes.structure.Structure``: the cheap copy reports and FlashOverlap's restore keep."""

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.passes.structure import Structure


def _graph() -> fx.GraphModule:
    """A graph with what real graphs hold: tuples from multi-output ops read by getitem,
    lists of nodes (cat), kwargs, ints, dtypes and None in the arguments."""

    def f(x, w):
        y = F.layer_norm(x, (8,), weight=w)
        a, b = y.split(4, dim=-1)
        return torch.cat([a, b * 2], dim=0).to(torch.float64), y.sum(dim=1, keepdim=True)

    return make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(8))


def _code(graph: fx.Graph) -> str:
    return graph.python_code(root_module="self", verbose=True).src


def test_rebuilt_graph_is_the_graph_it_was_taken_from():
    gm = _graph()
    kept = Structure(gm.graph)
    rebuilt = kept.graph()
    assert _code(rebuilt) == _code(gm.graph)
    assert [n.name for n in rebuilt.nodes] == [n.name for n in gm.graph.nodes]
    for old, new in zip(gm.graph.nodes, rebuilt.nodes):
        assert new.meta.keys() == old.meta.keys()
        assert new.meta.get("val") is old.meta.get("val")  # shared values, as graph_copy
        assert new.meta is not old.meta
    rebuilt.lint()
    x, w = torch.randn(3, 8), torch.randn(8)
    expected = gm(x, w)
    actual = fx.GraphModule(gm, rebuilt)(x, w)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_structure_is_not_changed_by_later_edits_and_restores_in_place():
    gm = _graph()
    before = _code(gm.graph)
    kept = Structure(gm.graph)
    graph = gm.graph
    # a pass edits the graph: a node's metadata, a new node, an erased use
    mul = next(n for n in graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    mul.meta["added_by_a_pass"] = True
    with graph.inserting_after(mul):
        neg = graph.call_function(torch.ops.aten.neg.default, (mul,))
    mul.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
    gm.recompile()
    assert _code(gm.graph) != before
    assert "added_by_a_pass" not in kept.graph().find_nodes(
        op="call_function", target=torch.ops.aten.mul.Tensor)[0].meta
    kept.restore(graph)
    assert gm.graph is graph and _code(graph) == before
    gm.recompile()
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(gm(x, w)[0], _graph()(x, w)[0])
    # names stay free for the next rewrite: a new node gets a fresh name, not a clash
    restored_mul = graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)[0]
    assert restored_mul.name == mul.name and "added_by_a_pass" not in restored_mul.meta
    with graph.inserting_after(restored_mul):
        fresh = graph.call_function(torch.ops.aten.neg.default, (restored_mul,))
    assert fresh.name not in {n.name for n in kept.graph().nodes}
