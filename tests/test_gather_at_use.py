"""Gathers at use (``CompileOptions(gather_at_use=True)``, ``passes/gather_at_use.py``).

Decisions on graphs traced here with ``make_fx`` (fake tensors, no process group): a step that
gathers every parameter first, as ``GRPOTrainer(parallel="fsdp")`` traces, gets each gather
moved to its weight's first reader with the slice and transpose computed from it; a cast of the
part before its gather stays; an activation's gather stays with its reason; the graph holds one
gathered weight at a time instead of all (``peak_gathered_bytes``). With buckets, each bucket
is issued one ahead: right after the previous bucket is unpacked, before that bucket's first
reader. The communication keeps its order: two layouts of one step (as Inductor lays out a
forward and an inference graph) issue the same gathers in the same order after both passes; a
gather does not move past a mutation of its part; a fused weight split in pieces moves with its
pieces. Values: the fsdp trainer's tests (``tests/test_grpo_fsdp.py``) run with the pass on.
"""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.options import CompileOptions
from leancompile.passes.bucket_collectives import bucket_collectives_pass
from leancompile.passes.gather_at_use import gather_at_use_pass, peak_gathered_bytes

c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default


def _gather(x, ranks=2):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, ranks, "0"))


def _layers(x, a, b, c, d):
    """The features of a value computed from x gathered (an activation), then four
    parameters' parts (c cast to bf16 before its gather), then four layers reading them in
    order."""
    h = _gather((x + x.mean()).t().contiguous()).t()  # an activation's features: [B, 16]
    w = [_gather(a)[:15].t(), _gather(b).t(), _gather(c.bfloat16()).float().t(), _gather(d).t()]
    for weight in w:
        h = torch.tanh(h @ weight)
    return h


def _args():
    return (torch.randn(4, 8), torch.randn(8, 16), torch.randn(8, 15), torch.randn(8, 16),
            torch.randn(8, 16))


def _order(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_each_gather_moves_to_its_first_reader_and_the_peak_falls():
    gm = make_fx(_layers, tracing_mode="fake")(*_args())
    before = peak_gathered_bytes(gm)
    result = gather_at_use_pass(gm, CompileOptions(gather_at_use=True))
    after = peak_gathered_bytes(gm)
    nodes = _order(gm)
    gathers = [n for n in nodes if n.target is AG]
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    # the four weights' gathers, each between the previous layer's matmul and its own
    param_gathers = [g for g in gathers if g.name in {s.node for s in result.rewritten}]
    assert len(param_gathers) == 4 and len(mms) == 4, result.summary()
    for i, (gather, mm) in enumerate(zip(param_gathers, mms)):
        assert nodes.index(gather) < nodes.index(mm), (gather, mm)
        if i:
            assert nodes.index(mms[i - 1]) < nodes.index(gather), (gather, mms[i - 1])
    # the cast of c before its gather stayed where it was (before every matmul)
    cast = next(n for n in nodes if n.target is torch.ops.aten._to_copy.default
                and n.kwargs.get("dtype") is torch.bfloat16)
    assert nodes.index(cast) < nodes.index(mms[0])
    # the activation's gather is left alone, with the reason
    reasons = {s.node: s.reason for s in result.skipped}
    assert len(reasons) == 1 and "not a graph input" in next(iter(reasons.values())), reasons
    # all four gathered weights alive at once before; one (the largest, with its transposed
    # copy where a transpose copies) after
    fp32 = 16 * 16 * 4
    assert before >= 3 * fp32 + 16 * 16 * 2, before
    assert after <= 2 * fp32 + 16 * 16 * 2 and after < before, (before, after)
    gm.graph.lint()


def test_collectives_keep_their_order():
    def two(x, a, b):  # b's weight is read first, and another gather comes after both
        wa, wb = _gather(a).t(), _gather(b).t()
        y = _gather((x + 1).contiguous())
        return torch.tanh(y[:4] @ wb) @ wa

    gm = make_fx(two, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16),
                                           torch.randn(8, 16))
    result = gather_at_use_pass(gm, CompileOptions(gather_at_use=True))
    nodes = _order(gm)
    gathers = [n.args[0].name for n in nodes if n.target is AG]
    # a, b and the third gather (of x + 1, a graph input through one op) in their traced
    # order: the third is already at its first reader, so a and b go no further than it
    # (though b's weight is read first and a's last)
    assert gathers == ["a_1", "b_1", "add"], gathers
    assert [s.reason for s in result.skipped] == ["already right before its first reader (mm)"]
    moved = ("all_gather moved down to the next collective or other effectful node, which "
             "comes first")
    assert sorted(s.kind for s in result.rewritten) == [
        f"{moved} (all_gather_into_tensor_1)", f"{moved} (all_gather_into_tensor_2)"]


def test_only_the_order_changes():
    traced = make_fx(_layers, tracing_mode="fake")(*_args())
    moved = make_fx(_layers, tracing_mode="fake")(*_args())
    gather_at_use_pass(moved, CompileOptions(gather_at_use=True))
    assert [n.format_node() for n in traced.graph.nodes] != \
        [n.format_node() for n in moved.graph.nodes]
    assert sorted(n.format_node() for n in traced.graph.nodes) == \
        sorted(n.format_node() for n in moved.graph.nodes)


def _fp32_layers(x, a, b, c, d):
    w = [_gather(p).t() for p in (a, b, c, d)]
    for weight in w:
        x = torch.tanh(x @ weight)
    return x


def test_buckets_after_gather_at_use_are_issued_one_ahead():
    args = (torch.randn(4, 16),) + tuple(torch.randn(8, 16) for _ in range(4))
    gm = make_fx(_fp32_layers, tracing_mode="fake")(*args)
    # two parts (2 x 512 bytes) per bucket
    options = CompileOptions(gather_at_use=True, bucket_cap_mb=2 * 8 * 16 * 4 / 2 ** 20)
    gather_at_use_pass(gm, options)
    result = bucket_collectives_pass(gm, options)
    assert [s.kind for s in result.rewritten] == ["all_gather into bucket 0"] * 2 + \
        ["all_gather into bucket 1"] * 2, result.summary()
    nodes = _order(gm)
    gathers = [n for n in nodes if n.target is AG]
    waits = [n for n in nodes if n.target is c10d.wait_tensor.default]
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    at = nodes.index
    # bucket 0 at the first layer; bucket 1 issued after bucket 0's wait, before layer 0
    # computes (one ahead), waited on right before layer 2, its first reader
    assert len(gathers) == 2 and at(gathers[0]) < at(waits[0]) < at(gathers[1]) < at(mms[0])
    assert at(mms[1]) < at(waits[1]) < at(mms[2]), [n.name for n in nodes]
    # without gather_at_use the buckets stay where their first members were (the top)
    plain = make_fx(_fp32_layers, tracing_mode="fake")(*args)
    bucket_collectives_pass(plain, CompileOptions(bucket_cap_mb=options.bucket_cap_mb))
    nodes = _order(plain)
    gathers = [n for n in nodes if n.target is AG]
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert nodes.index(gathers[1]) < nodes.index(mms[0])
    assert peak_gathered_bytes(gm) < peak_gathered_bytes(plain)
    gm.graph.lint()


# -- the order of communication (a second review's reproductions) ---------------------------

def _shapes(gm):
    return [(str(n.args[0].meta["val"].dtype), tuple(n.args[0].meta["val"].shape))
            for n in gm.graph.nodes if n.target is AG]


def test_two_layouts_of_one_step_issue_the_same_collectives_in_the_same_order():
    """A compiler may lay out a step's forward and inference graphs differently (Inductor
    does): independent compute in another order, the same gathers. After both passes, with
    and without buckets, the two issue the same gathers in the same order."""
    def gathered(a, b, e, c, d):
        return [_gather(p) for p in (a, b, e, c, d)]

    def bf16_branch_first(x, a, b, e, c, d):
        wa, wb, we, wc, wd = gathered(a, b, e, c, d)
        y = (x.bfloat16() @ we).float()
        for w in (wa, wb, wc, wd):
            x = torch.tanh(x @ w)
        return x + y

    def bf16_branch_later(x, a, b, e, c, d):
        wa, wb, we, wc, wd = gathered(a, b, e, c, d)
        for w in (wa, wb):
            x = torch.tanh(x @ w)
        y = (x.bfloat16() @ we).float()
        for w in (wc, wd):
            x = torch.tanh(x @ w)
        return x + y

    args = (torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16),
            torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 16), torch.randn(8, 16))
    for cap in (None, 2 * 8 * 16 * 4 / 2 ** 20):
        options = CompileOptions(gather_at_use=True, bucket_cap_mb=cap)
        orders = []
        for layout in (bf16_branch_first, bf16_branch_later):
            gm = make_fx(layout, tracing_mode="fake")(*args)
            gather_at_use_pass(gm, options)
            if cap is not None:
                bucket_collectives_pass(gm, options)
            gm.graph.lint()
            orders.append(_shapes(gm))
        assert orders[0] == orders[1], (cap, orders)


def test_a_gather_stops_before_a_mutation_and_split_weights_move_with_their_pieces():
    def mutated(x, a):
        w = _gather(a).t()
        x = torch.tanh(x)
        a.copy_(a * 2)  # the part changes after its gather: the gather must read it before
        return x @ w

    gm = make_fx(mutated, tracing_mode="fake")(torch.randn(4, 16), torch.randn(8, 16))
    gather_at_use_pass(gm, CompileOptions(gather_at_use=True))
    nodes = _order(gm)
    copy = next(n for n in nodes if n.target is torch.ops.aten.copy_.default)
    gather = next(n for n in nodes if n.target is AG)
    assert nodes.index(gather) < nodes.index(copy), [n.name for n in nodes]

    def fused(x, qkv, o):  # one gathered weight cut in three (getitem of a split)
        wq, wk, wv = _gather(qkv).split(16)
        wo = _gather(o)
        q, k, v = x @ wq.t(), x @ wk.t(), x @ wv.t()
        return (torch.softmax(q @ k.t(), -1) @ v) @ wo.t()

    gm = make_fx(fused, tracing_mode="fake")(torch.randn(4, 16), torch.randn(24, 16),
                                             torch.randn(8, 16))
    before = peak_gathered_bytes(gm)
    result = gather_at_use_pass(gm, CompileOptions(gather_at_use=True))
    assert len(result.rewritten) == 2, result.summary()
    # qkv [48, 16] and o [16, 16] fp32 both alive at the start before; qkv alone after
    assert (before, peak_gathered_bytes(gm)) == (48 * 16 * 4 + 16 * 16 * 4, 48 * 16 * 4)


def test_gathers_issued_first_and_waited_on_late_stay_before_their_readers():
    """Inductor's graphs issue every gather first and wait on each late, where a reader needs
    it: here five gathers are waited on for one reader (a concatenation), the first gather for
    an earlier one. Each gather moves down only as far as the next one's new place allows, and
    that place is right before the node they all stack before (the graph stays valid)."""
    def fn(x, p0, p1, p2, p3, p4, p5):
        issued = [c10d.all_gather_into_tensor(p, 2, "0") for p in (p0, p1, p2, p3, p4, p5)]
        late = [c10d.wait_tensor(g) for g in issued[1:]]
        y = x + c10d.wait_tensor(issued[0])  # the first gather's reader, before the others'
        return y, torch.cat(late)

    parts = [torch.randn(8) for _ in range(7)]
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(16), *parts[1:])
    gather_at_use_pass(gm, CompileOptions(gather_at_use=True))
    gm.graph.lint()  # every input defined before its reader
    nodes = _order(gm)
    gathers = [n for n in nodes if n.target is AG]
    add = next(n for n in nodes if n.target is torch.ops.aten.add.Tensor)
    assert [g.args[0].name for g in gathers] == [f"p{i}_1" for i in range(6)]
    assert nodes.index(gathers[0]) < nodes.index(add) < nodes.index(gathers[1])
