"""``leancompile/runtime/vmap_ops.py`` on hand-built graphs (no process group needed: the graphs
are rewritten and inspected, not run; the 2- and 4-rank GRPO tests in test_ulysses.py run them;
the size reads' graph runs under vmap)."""

import pytest
import torch
import torch.fx as fx

from leancompile.runtime.vmap_ops import unbatchable_collectives, vmap_friendly

funcol = torch.ops._c10d_functional


def _graph():
    """backward(per_row, shared): an all-to-all and its wait on a per-row tensor, an
    all-reduce of a per-row value and one of a shared value."""
    g = fx.Graph()
    per_row, shared = g.placeholder("per_row"), g.placeholder("shared")
    a2a = g.call_function(funcol.all_to_all_single.default, (per_row, [1, 1], [1, 1], "0"))
    exchanged = g.call_function(funcol.wait_tensor.default, (a2a,))
    reduced = g.call_function(funcol.wait_tensor.default, (g.call_function(
        funcol.all_reduce.default, (exchanged, "sum", "0")),))
    common = g.call_function(funcol.wait_tensor.default, (g.call_function(
        funcol.all_reduce.default, (shared, "sum", "0")),))
    g.output((reduced, common))
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_all_to_all_and_its_wait_become_one_op_with_a_batching_rule():
    gm = _graph()
    vmap_friendly(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.leancompile.all_to_all_single.default in targets
    assert funcol.all_to_all_single.default not in targets
    # the all-to-all's wait is gone; the all-reduces keep theirs
    assert targets.count(funcol.wait_tensor.default) == 2


def test_collectives_without_a_rule_that_meet_rows_are_named():
    gm = _graph()
    vmap_friendly(gm)
    found = unbatchable_collectives(gm, {0})
    # the all-reduce of the exchanged rows; not the all-to-all (it has a rule) and not the
    # all-reduce of the shared input (vmap runs it once, unbatched)
    assert len(found) == 1 and "all_reduce" in found[0], found
    assert unbatchable_collectives(gm, set()) == []


def test_deferred_reductions_leave_data_movement_in_and_refuse_reductions():
    """fsdp's Reweight takes its gradient reduce-scatters out of the per-row backward; the
    all-to-alls move data and stay, while an all-reduce would sum each row on its own."""
    from leancompile.passes.coalesced_sync import find_gradient_reductions

    gm = _graph()
    found = find_gradient_reductions(gm)
    names = {n.name: str(n.target) for n in gm.graph.nodes}
    assert [names[n] for n in found.compute] == ["_c10d_functional.all_to_all_single.default"]
    stuck = [n for n, _ in found.skipped if n not in found.compute]
    assert [names[n] for n in stuck] == ["_c10d_functional.all_reduce.default"] * 2


def test_size_reads_of_a_symbolic_graph_batch_under_vmap():
    """A backward traced with a symbolic batch may read a size off a tensor
    (``aten.sym_size.int``; found on tiny Wan with CFG, where the order of two ``cat`` calls in
    the policy decided it): vmap has no rule for it; ``vmap_friendly`` reads it per row."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.runtime.vmap_ops import vmap_friendly

    def f(x):
        return x * x.shape[0] + x.reshape(x.shape[0] * x.shape[1]).sum() / x.numel()

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 4))
    assert any(n.target is torch.ops.aten.sym_size.int for n in gm.graph.nodes)
    rows = torch.randn(5, 2, 4)
    with pytest.raises(RuntimeError, match="Batching rule not implemented for aten::sym_size"):
        torch.func.vmap(gm)(rows)
    vmap_friendly(gm)
    torch.testing.assert_close(torch.func.vmap(gm)(rows), torch.stack([f(r) for r in rows]),
                               rtol=0, atol=0)
