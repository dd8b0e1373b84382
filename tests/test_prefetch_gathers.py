"""Prefetched gathers (``passes/prefetch_gathers.py``: on with ``overlap=``).

Decisions on graphs traced here with ``make_fx`` (fake tensors, no process group), laid out as
a 2-D mesh's block is after FlashOverlap: FSDP weight gathers over ``"dp"`` waited on at use,
with the TP communication over ``"tp"`` between them. Each weight gather after the first of
its group is issued right after the previous one's wait (with the cast of its part), crossing
the other group's communication, never its own group's; waits stay; an activation's gather
stays with its reason; two layouts of one step (same communication, compute in another order)
issue the same communication in the same order after the pass; ``strict=True`` counts a
prefetched gather as hidden. Values (bitwise: only the order changes) on real ranks:
``tests/test_flash_overlap_safety.py::test_fsdp_plus_tp_on_a_2d_mesh`` and torchtitan's 2-D
block (``tests/test_torchtitan.py``), where the pass is on.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.options import CompileOptions
from leancompile.passes import PASSES
from leancompile.passes.prefetch_gathers import NAME, prefetch_gathers_pass
from leancompile.pipeline import UnrewrittenCollectiveError, check_all_rewritten

c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
RS = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
OPTIONS = CompileOptions(overlap="flash")


def _gather(x, group):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, group))


def _block(x, norm, wq, wo, w1):
    """A norm weight, an attention and an FFN, each weight gathered over dp where it is used
    (w1 cast to bf16 first, as a mixed-precision policy does), the sequence gathered and
    scattered over tp between them."""
    h = _gather(x + x.mean(), "tp") * _gather(norm, "dp")  # norm: the first dp gather
    q = torch.tanh(h @ _gather(wq, "dp").t())
    r = c10d.wait_tensor(c10d.reduce_scatter_tensor(q @ _gather(wo, "dp").t(), "sum", 2, "tp"))
    h2 = _gather(r, "tp")
    return h2 @ _gather(w1.bfloat16(), "dp").float().t()


def _args():
    return (torch.randn(4, 16), torch.randn(8), torch.randn(8, 16), torch.randn(8, 16),
            torch.randn(8, 16))


def _comm(gm):
    """The graph's communication in order: (op, group, input) per collective, (wait, of)."""
    out = []
    for n in gm.graph.nodes:
        if n.target in (AG, RS):
            out.append((n.target.__name__, n.args[-1], n.args[0].name))
        elif n.target is WAIT:
            out.append(("wait", n.args[0].args[0].name))
    return out


def test_each_weight_gather_is_issued_after_the_previous_wait_of_its_group():
    gm = make_fx(_block, tracing_mode="fake")(*_args())
    before = _comm(gm)
    result = prefetch_gathers_pass(gm, OPTIONS)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    at = nodes.index
    gathers = {n.args[0].name: n for n in nodes if n.target is AG}
    waits = {n.args[0].args[0].name: n for n in nodes if n.target is WAIT and n.args[0].target
             is AG}
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    # wq's gather right after the norm weight's wait, wo's right after wq's (before the
    # attention's matmul), w1's (with its bf16 cast) right after wo's, before the tp
    # reduce-scatter and the tp gather it now crosses
    assert at(gathers["wq_1"]) == at(waits["norm_1"]) + 1
    assert at(gathers["wo_1"]) == at(waits["wq_1"]) + 1 < at(mms[0])
    cast = gathers["_to_copy"].args[0]
    assert at(cast) == at(waits["wo_1"]) + 1 and at(gathers["_to_copy"]) == at(cast) + 1
    [rs] = [n for n in nodes if n.target is RS]
    assert at(gathers["_to_copy"]) < at(rs) < at(gathers["wait_tensor_4"])
    assert sorted(s.node for s in result.rewritten) == [
        "all_gather_into_tensor_2", "all_gather_into_tensor_3", "all_gather_into_tensor_5"]
    assert all(s.kind.startswith("all_gather issued after the previous gather's wait")
               for s in result.rewritten)
    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons == {
        "all_gather_into_tensor": "gathers a value the graph computes (an activation), not a "
                                  "graph input: it stays where that value is made",
        "all_gather_into_tensor_1": "the first gather of group 'dp' in this graph: no earlier "
                                    "wait to issue it after",
        "all_gather_into_tensor_4": "gathers a value the graph computes (an activation), not a "
                                    "graph input: it stays where that value is made"}
    # every wait where it was; each group's collectives in their order; nothing else changed
    after = _comm(gm)
    assert [c for c in after if c[0] == "wait"] == [c for c in before if c[0] == "wait"]
    for group in ("dp", "tp"):
        assert [c for c in after if c[1:2] == (group,)] == \
            [c for c in before if c[1:2] == (group,)], group
    gm.graph.lint()
    # a second run finds every gather in place
    again = prefetch_gathers_pass(gm, OPTIONS)
    assert again.rewritten == [] and all(
        "already right after" in s.reason for s in again.skipped
        if s.node in {"all_gather_into_tensor_2", "all_gather_into_tensor_3"}), again.summary()


def test_two_layouts_of_one_step_issue_the_same_communication_after_the_pass():
    """A forward and an inference graph of one step may order their compute differently; the
    pass reads the communication only, so both issue the same collectives in the same order."""
    def one(x, a, b, c):
        wa, wb, wc = _gather(a, "dp"), _gather(b, "dp"), _gather(c, "dp")
        return torch.tanh(x @ wa.t()) @ (wb.t() @ wc)

    def other(x, a, b, c):
        wa = _gather(a, "dp")
        y = torch.tanh(x @ wa.t())
        wb = _gather(b, "dp")
        z = wb.t() @ _gather(c, "dp")
        return y @ z

    args = (torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16))
    graphs = [make_fx(f, tracing_mode="fake")(*args) for f in (one, other)]
    for gm in graphs:
        prefetch_gathers_pass(gm, OPTIONS)
    assert _comm(graphs[0]) == _comm(graphs[1])


def test_on_with_overlap_off_with_gather_at_use_or_disable():
    spec = next(s for s in PASSES if s.name == NAME)
    assert spec.active(CompileOptions(overlap="flash"))
    assert spec.active(CompileOptions(overlap="slice"))
    assert not spec.active(CompileOptions())
    # gather_at_use's buckets prefetch one bucket ahead instead
    assert not spec.active(CompileOptions(overlap="flash", gather_at_use=True))
    names = [s.name for s in PASSES]
    assert names.index("flash_overlap") < names.index(NAME) < names.index("gather_at_use")
    assert CompileOptions(overlap="flash", disable=NAME).disable == (NAME,)


def test_strict_counts_a_prefetched_gather_as_hidden():
    gm = make_fx(_block, tracing_mode="fake")(*_args())
    result = prefetch_gathers_pass(gm, OPTIONS)
    with pytest.raises(UnrewrittenCollectiveError) as err:
        check_all_rewritten(gm, [result], phase="forward")
    message = str(err.value)
    # left: the two tp gathers, the tp reduce-scatter and the first dp gather, with reasons
    assert "keeps 4 collective(s)" in message, message
    assert "all_gather_into_tensor_1 (_c10d_functional.all_gather_into_tensor.default): " \
           "prefetch_gathers: the first gather of group 'dp'" in message
    for name in ("all_gather_into_tensor_2", "all_gather_into_tensor_3",
                 "all_gather_into_tensor_5"):
        assert f"{name} (" not in message, message


def _gathered_first(x, a, b, c):
    """Every weight's gather issued first (as a step that gathers its whole model at the top),
    each waited on where its layer reads it."""
    ga, gb, gc = (c10d.all_gather_into_tensor(p, 2, "dp") for p in (a, b, c))
    x = torch.tanh(x @ c10d.wait_tensor(ga).t())
    x = torch.tanh(x @ c10d.wait_tensor(gb).t())
    return x @ c10d.wait_tensor(gc).t()


def test_gathers_issued_all_at_once_move_down_to_one_ahead_and_the_peak_falls():
    from leancompile.passes.gather_at_use import peak_gathered_bytes

    args = (torch.randn(4, 16),) + tuple(torch.randn(8, 16) for _ in range(3))
    gm = make_fx(_gathered_first, tracing_mode="fake")(*args)
    before, comm = peak_gathered_bytes(gm), _comm(gm)
    result = prefetch_gathers_pass(gm, OPTIONS)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    gathers = [n for n in nodes if n.target is AG]
    waits = [n for n in nodes if n.target is WAIT]
    assert [nodes.index(g) for g in gathers[1:]] == [nodes.index(w) + 1 for w in waits[:2]]
    assert len(result.rewritten) == 2 and peak_gathered_bytes(gm) < before
    # the group's collectives in their order, the waits where they were
    assert [c for c in _comm(gm) if c[0] != "wait"] == [c for c in comm if c[0] != "wait"]
    assert [c for c in _comm(gm) if c[0] == "wait"] == [c for c in comm if c[0] == "wait"]
    gm.graph.lint()


def test_left_alone_a_gather_waited_on_first_or_a_move_across_its_own_group():
    def read_in_another_order(x, a, b):
        wa, wb = _gather(a, "dp"), _gather(b, "dp")  # traced: wait(a), then wait(b)
        return torch.tanh(x @ wb.t()) @ wa

    def a_reduction_of_its_group_between(x, a, b):
        wa = _gather(a, "dp")
        y = torch.tanh(x @ wa.t())
        s = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "dp"))
        return (s @ _gather(b, "dp").t()).sum() + y.sum()

    args = (torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16))
    gm = make_fx(read_in_another_order, tracing_mode="fake")(*args)
    # reorder the waits as a compiler laying the graph out by first use would
    waits = [n for n in gm.graph.nodes if n.target is WAIT]
    waits[0].prepend(waits[1])
    result = prefetch_gathers_pass(gm, OPTIONS)
    assert result.rewritten == [] and "before the previous gather of its group" in \
        result.skipped[-1].reason, result.summary()

    gm = make_fx(a_reduction_of_its_group_between, tracing_mode="fake")(*args)
    result = prefetch_gathers_pass(gm, OPTIONS)
    [skip] = [s for s in result.skipped if "would cross" in s.reason]
    assert "reduce_scatter_tensor, a collective of its own group" in skip.reason, skip.reason
    assert result.rewritten == []


def test_inductor_keeps_the_order_the_pass_arranged():
    """Inductor's peak-memory reordering (on by default) moves each gather down to its wait;
    a graph that issues gathers ahead turns it off for its own compile, so the generated code
    issues the gathers as the graph does, and the setting is as before afterwards.
    Graph-only: a fake process group, Inductor's code read back."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._inductor.utils import run_and_get_code
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import leancompile
    from leancompile.passes import inductor_config_patches

    assert inductor_config_patches(OPTIONS) == {"reorder_for_peak_memory": False}
    assert inductor_config_patches(CompileOptions()) == {}
    assert inductor_config_patches(CompileOptions(overlap="flash", disable=NAME)) == {}
    default = torch._inductor.config.reorder_for_peak_memory
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        group = dist.group.WORLD

        def f(x, a, b, c, w):  # weights read elementwise: nothing for FlashOverlap to take
            h = torch.tanh((x * funcol.all_gather_tensor(a, 0, group)) @ w)
            h = torch.tanh((h * funcol.all_gather_tensor(b, 0, group)) @ w)
            return (h * funcol.all_gather_tensor(c, 0, group)) @ w

        args = [torch.randn(64, 64)] + [torch.randn(32, 64) for _ in range(3)] + [
            torch.randn(64, 64)]
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):
            _, [code] = run_and_get_code(torch.compile(f, backend=leancompile.backend(
                overlap="flash")), *args)
        lines = [line.strip() for line in code.splitlines()]
        issue = [i for i, line in enumerate(lines) if "all_gather_into_tensor.default(" in line]
        mms = [i for i, line in enumerate(lines) if "extern_kernels.mm(" in line]
        # (the traced graph issues all three first; with the reordering on, Inductor's code
        # issued each right before its wait, after the previous layer's matmul)
        assert len(issue) == 3 and issue[1] < mms[0] and issue[2] < mms[1], "\n".join(lines)
        # per graph: the setting is back as it was after the compile
        assert torch._inductor.config.reorder_for_peak_memory is default
        # install(): off while installed (an installed pass cannot restore it per graph)
        with leancompile.install(overlap="flash"):
            assert torch._inductor.config.reorder_for_peak_memory is False
        assert torch._inductor.config.reorder_for_peak_memory is default
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_no_move_reorders_a_groups_gathers():
    """Three gathers issued first; a reduction of their group between the first two waits
    keeps the third where it is (a move would cross it), and moving the second down alone
    would issue it after the third: none moves."""
    def f(x, a, b, c):
        ga, gb, gc = (c10d.all_gather_into_tensor(p, 2, "dp") for p in (a, b, c))
        y = torch.tanh(x @ c10d.wait_tensor(ga).t())
        s = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "dp"))
        y = torch.tanh(y @ c10d.wait_tensor(gb).t())
        return (y @ c10d.wait_tensor(gc).t()).sum() + s.sum()

    args = (torch.randn(4, 16),) + tuple(torch.randn(8, 16) for _ in range(3))
    gm = make_fx(f, tracing_mode="fake")(*args)
    comm = _comm(gm)
    result = prefetch_gathers_pass(gm, OPTIONS)
    assert result.rewritten == [] and _comm(gm) == comm, result.summary()
    reasons = [s.reason for s in result.skipped]
    assert any("would cross reduce_scatter_tensor" in r for r in reasons), reasons
    assert any("would change their order" in r for r in reasons), reasons


def test_a_gather_already_one_ahead_counts_as_issued_ahead():
    """Nothing to move (each gather already right after the previous wait): the gathers are
    tagged all the same, so ``strict=True`` takes them as hidden and Inductor keeps them there
    (``passes.issues_ahead``)."""
    from leancompile.passes import issues_ahead

    def f(x, a, b):
        wa = _gather(a, "dp")
        gb = c10d.all_gather_into_tensor(b, 2, "dp")
        y = torch.tanh(x @ wa.t())
        return y @ c10d.wait_tensor(gb).t()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16),
                                         torch.randn(8, 16))
    assert not issues_ahead(gm, OPTIONS)
    result = prefetch_gathers_pass(gm, OPTIONS)
    assert result.rewritten == [] and issues_ahead(gm, OPTIONS)
    with pytest.raises(UnrewrittenCollectiveError) as err:
        check_all_rewritten(gm, [result], phase="forward")
    assert "keeps 1 collective(s)" in str(err.value), str(err.value)  # the first gather only


def test_one_cast_gathered_over_two_groups_moves_once():
    """A parameter cast once and gathered over two groups: the cast moves up with the first
    gather only (a second move would put it below the first gather); the graph stays valid."""
    def f(x, a, b, c):
        wa, wb = _gather(a, "dp"), _gather(b, "tp")
        y = torch.tanh(x @ wa.t()) + torch.tanh(x @ wb.t())
        pc = c.bfloat16()
        return (y @ _gather(pc, "dp").float().t()) + (y @ _gather(pc, "tp").float().t())

    args = (torch.randn(4, 16),) + tuple(torch.randn(8, 16) for _ in range(3))
    gm = make_fx(f, tracing_mode="fake")(*args)
    result = prefetch_gathers_pass(gm, OPTIONS)
    gm.graph.lint()
    assert len(result.rewritten) == 1, result.summary()
    assert any("moves up with another gather" in s.reason for s in result.skipped), \
        result.summary()


def test_a_group_that_cannot_be_read_or_a_subgraph_is_not_crossed():
    """A communication op whose group is an object, not a name (as under
    ``TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK``), and a higher-order op (its subgraph may
    communicate) count as the gather's own group: no move crosses them."""
    for between in ("group object", "subgraph"):
        graph = torch.fx.Graph()
        x, a, b, group = (graph.placeholder(n) for n in ("x", "a", "b", "group"))
        wa = graph.call_function(WAIT, (graph.call_function(AG, (a, 2, "dp")),))
        y = graph.call_function(torch.ops.aten.mm.default, (x, wa))
        if between == "group object":
            graph.call_function(RS, (y, "sum", 2, group))
        else:
            graph.call_function(torch.ops.higher_order.invoke_subgraph, (None, "sub", y))
        gb = graph.call_function(AG, (b, 2, "dp"))
        graph.output(graph.call_function(torch.ops.aten.mm.default,
                                         (y, graph.call_function(WAIT, (gb,)))))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        result = prefetch_gathers_pass(gm, OPTIONS)
        assert result.rewritten == [], (between, result.summary())
        assert any("would cross" in s.reason for s in result.skipped), (between, result.summary())
