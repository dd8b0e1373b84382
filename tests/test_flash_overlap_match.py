"""FlashOverlap matching on real traced graphs: functional collectives and DTensor TP+SP /
FSDP-style parameters, forward and backward, under a fake 4-rank process group (graph-only, no
real ranks).

Every all_gather_into_tensor / reduce_scatter_tensor node of every graph is either a match or a
skipped site with a reason; each skip reason is provoked and asserted on.
"""

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from leancompile.passes.flash.all_gather_match import find_all_gather_matches
from leancompile.passes.flash.reduce_scatter_match import find_reduce_scatter_matches
from leancompile.passes.flash.vocabulary import AG_SITE, RS_SITE
from leancompile.passes.result import PassResult
from compat import TORCH_VERSION, all_gather_single, reduce_scatter_single

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WORLD = 4


@pytest.fixture
def group():
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def compile_graphs(fn, *args, dynamic=None):
    """Run ``fn`` forward and backward under torch.compile; return the post-grad forward and
    backward graphs AOTAutograd handed to the compiler."""
    graphs = {}

    def recorder(phase):
        def compiler(gm, example_inputs):
            graphs.setdefault(phase, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    out.sum().backward()
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1, graphs
    return graphs["forward"][0], graphs["backward"][0]


def find(gm, **kw):
    """Both matchers on one graph; checks that every collective is matched or skipped once."""
    result = PassResult(name="flash_overlap_match")
    rs_kw = {k: v for k, v in kw.items() if k != "allow_other_users"}
    ags = find_all_gather_matches(gm.graph, result, **kw)
    rss = find_reduce_scatter_matches(gm.graph, result, **rs_kw)
    collectives = [n for n in gm.graph.nodes if n.target in (
        c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)]
    seen = [m.all_gather.name for m in ags] + [m.reduce_scatter.name for m in rss] + [
        s.node for s in result.skipped]
    assert sorted(seen) == sorted(n.name for n in collectives)
    return ags, rss, result


def reasons(result, kind):
    return [s.reason for s in result.skipped if s.kind == kind]


def uses(match):
    return [(u.node.target, u.operand, u.dim) for u in match.consumers]


# ----------------------------------------------------------------------------------------------
# Functional collectives, torch.compile forward + backward


def test_functional_ag_mm_and_mm_rs_forward_and_backward(group):
    def f(x, w1, w2):
        h = all_gather_single(x, 0, group) @ w1              # column-parallel
        return reduce_scatter_single(h @ w2, "sum", 0, group)  # row-parallel

    x = torch.randn(8, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    fw, bw = compile_graphs(f, x, w1, w2)

    ags, rss, result = find(fw)
    assert result.skipped == []
    [ag], [rs] = ags, rss
    # all_gather_into_tensor(x, 4, name) -> wait_tensor -> mm(wait, w1): gather dim 0 = rows.
    assert ag.kind == "ag_input" and ag.gather_dim == 0 and ag.reassembly == ()
    assert ag.wait.args[0] is ag.all_gather and ag.gathered is ag.wait
    assert (ag.group_name, ag.group_size) == (group.group_name, WORLD)
    assert ag.shape == (32, 16)
    assert uses(ag) == [(aten.mm.default, "A", "M")]
    assert [n.op for n in ag.other_users] == ["output"]      # saved for the backward
    # mm(h, w2) -> reduce_scatter_tensor(mm, "sum", 4, name) -> wait_tensor.
    assert rs.kind == "rs_output" and rs.reduce_op == "sum" and rs.scatter_dim == 0
    assert rs.reduce_scatter.args[0] is rs.matmul and rs.dim == "M" and rs.via == ()

    ags, rss, result = find(bw)
    assert result.skipped == []
    [ag], [rs] = ags, rss
    # Backward of the reduce-scatter: the gradient is all-gathered and read by the weight
    # gradient (as B, gather dim = contraction K) and by the input gradient (as A, rows M).
    assert ag.shard.name.startswith("tangents")
    assert sorted(uses(ag), key=str) == sorted(
        [(aten.mm.default, "B", "K"), (aten.mm.default, "A", "M")], key=str)
    assert ag.kind == "ag_input"
    # Backward of the all-gather: the input-gradient mm is reduce-scattered.
    assert rs.kind == "rs_output" and rs.matmul.target is aten.mm.default and rs.dim == "M"


def test_qkv_projections_of_one_gather_are_one_site_with_three_consumers(group):
    def qkv(x, wq, wk, wv):
        a = all_gather_single(x, 0, group)                   # (4*2, 5, 16)
        return a @ wq, a @ wk, a @ wv

    args = torch.randn(2, 5, 16), *(torch.randn(16, 16) for _ in range(3))
    gm = make_fx(qkv, tracing_mode="fake")(*args)
    ags, rss, result = find(gm)
    assert result.skipped == [] and rss == []
    [ag] = ags
    assert uses(ag) == [(aten.mm.default, "A", "M")] * 3
    # 3-D matmuls: each projection reads the gather through its own view to 2-D.
    assert [[v.target for v in u.via] for u in ag.consumers] == [[aten.view.default]] * 3
    assert len({u.node for u in ag.consumers}) == 3


def test_gather_on_dim_1_with_batch_1_is_a_view_not_split_cat(group):
    def f(x, w):
        return all_gather_single(x, 1, group) @ w          # shard (1, 6, 16): view form

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1, 6, 16), torch.randn(16, 8))
    [ag], [], result = find(gm, divisor=2)
    assert result.skipped == []
    # all_gather -> wait (4, 6, 16) -> view (1, 24, 16) -> view (24, 16) -> mm
    assert [n.target for n in ag.reassembly] == [aten.view.default]
    assert ag.gather_dim == 1 and ag.shape == (1, 24, 16)
    assert uses(ag) == [(aten.mm.default, "A", "M")]


# ----------------------------------------------------------------------------------------------
# DTensor tensor + sequence parallel


class MLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.norm(x))))


def tp_sp_mlp():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = DeviceMesh("cpu", list(range(WORLD)))
    torch.manual_seed(0)
    return mesh, parallelize_module(MLP(), mesh, {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    })


def test_dtensor_tp_sp_mlp_forward_and_backward(group):
    _, model = tp_sp_mlp()
    x = torch.randn(2, 8, 16, requires_grad=True)           # this rank's sequence shard
    fw, bw = compile_graphs(model, x)
    split_cat = [aten.split.Tensor] + [operator.getitem] * WORLD + [aten.cat.default]

    ags, rss, result = find(fw)
    assert result.skipped == []
    [ag], [rs] = ags, rss
    # SequenceParallel -> ColwiseParallel: gather on the sequence dim 1, spelled as a dim-0
    # all-gather, split into 4, cat on dim 1; then view to 2-D and addmm(bias, x, t(w)).
    assert ag.gather_dim == 1 and ag.shape == (2, 32, 16)
    assert [n.target for n in ag.reassembly] == split_cat
    assert ag.reassembly[0].args[0] is ag.wait and ag.gathered is ag.reassembly[-1]
    assert uses(ag) == [(aten.addmm.default, "A", "M")]
    assert [v.target for v in ag.consumers[0].via] == [aten.view.default]
    assert ag.kind == "ag_input" and [n.op for n in ag.other_users] == ["output"]
    # RowwiseParallel(output Shard(1)): addmm -> view -> split on dim 1 -> cat on dim 0 -> RS.
    assert rs.kind == "rs_output" and rs.matmul.target is aten.addmm.default
    assert rs.scatter_dim == 1 and rs.shape == (2, 32, 16) and rs.dim == "M"
    assert [n.target for n in rs.reassembly] == split_cat

    ags, rss, result = find(bw)
    assert result.skipped == []
    [ag], [rs] = ags, rss
    # Backward of the row-parallel RS: gradient gathered on dim 1, read by the input-gradient
    # mm (A, M), the weight-gradient mm through t() (A, K) and the bias-gradient sum.
    assert ag.gather_dim == 1 and [n.target for n in ag.reassembly] == split_cat
    assert sorted(uses(ag), key=str) == sorted(
        [(aten.mm.default, "A", "M"), (aten.mm.default, "A", "K")], key=str)
    assert [n.target for n in ag.other_users] == [aten.sum.dim_IntList]
    # Backward of the column-parallel AG: input-gradient mm reduce-scattered on dim 1.
    assert rs.kind == "rs_output" and rs.scatter_dim == 1 and rs.dim == "M"
    assert [n.target for n in rs.reassembly] == split_cat

    # The bias-gradient sum is an "other user": skipped when other users are not allowed.
    _, _, strict = find(bw, allow_other_users=False)
    [reason] = reasons(strict, AG_SITE)
    assert reason.startswith("the gathered tensor has other users (aten.sum.dim_IntList at sum")


@pytest.mark.skipif(TORCH_VERSION < (2, 13), reason=(
    "torch < 2.13 DTensor: Shard(1) of 30 over 4 ranks redistributed to Replicate leaves a "
    "non-contiguous local tensor (2, 30, 16) with strides (512, 16, 1) that nn.Linear's view "
    "rejects, in eager as under Dynamo; nothing of leancompile runs before that error"))
def test_dtensor_uneven_sequence_is_skipped_as_uneven_shards(group):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh, model = tp_sp_mlp()
    x = distribute_tensor(torch.randn(2, 30, 16), mesh, [Shard(1)]).requires_grad_()
    fw, bw = compile_graphs(model, x)                       # sequence 30 on 4 ranks
    for gm in (fw, bw):
        for divisor, multiple in ((1, "world size 4)"),
                                  (2, "world size 4 x chunks_per_rank 2 = 8)")):
            ags, rss, result = find(gm, divisor=divisor)
            assert ags == [] and rss == []
            [ag_reason], [rs_reason] = reasons(result, AG_SITE), reasons(result, RS_SITE)
            assert ag_reason.startswith("uneven shards: gather dim 1 holds 30 elements over 4 "
                                        "ranks; DTensor pads each shard to 8 and trims")
            assert rs_reason.startswith("uneven shards: scatter dim 1 holds 30 elements over 4")
            for reason in (ag_reason, rs_reason):
                assert reason.endswith(f"pad dim 1 to 32 (a multiple of {multiple}")


# ----------------------------------------------------------------------------------------------
# FSDP-style: Shard(0) parameters gathered inside the compiled forward


def test_fsdp_style_parameter_gather_and_weight_gradient_reduce_scatter(group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(WORLD)))

    class FSDPLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(distribute_tensor(torch.randn(32, 16), mesh, [Shard(0)]))
            self.w2 = nn.Parameter(distribute_tensor(torch.randn(16, 32), mesh, [Shard(0)]))

        def forward(self, x):
            # Gathered for the forward; gradients are per-rank partials (data parallel).
            w1, w2 = (w.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
                      for w in (self.w1, self.w2))
            return F.linear(F.relu(F.linear(x, w1)), w2)

    fw, bw = compile_graphs(FSDPLinears(), torch.randn(8, 16))
    ags, rss, result = find(fw)
    assert result.skipped == [] and rss == [] and len(ags) == 2
    for ag, rows in zip(ags, (32, 16)):
        # all_gather(w_shard) -> wait -> view -> t -> mm(x, t): the gathered rows of W are the
        # output columns (N) of the matmul.
        assert ag.kind == "ag_weight" and ag.gather_dim == 0 and ag.shape[0] == rows
        assert ag.shard.op == "placeholder"
        assert uses(ag) == [(aten.mm.default, "B", "N")]
        assert [v.target for v in ag.consumers[0].via] == [aten.view.default, aten.t.default]

    ags, rss, result = find(bw)
    assert result.skipped == [] and ags == [] and len(rss) == 2
    for rs in rss:
        # dW = mm(t(dY), X) -> t -> t -> view -> reduce_scatter(dim 0).
        assert rs.kind == "rs_weight_grad" and rs.scatter_dim == 0 and rs.dim == "M"
        assert rs.matmul.args[0].target is aten.t.default
        # torch < 2.13 DTensor (Partial -> Shard(0)) adds no identity view before the RS.
        view = [aten.view.default] if TORCH_VERSION >= (2, 13) else []
        assert [v.target for v in rs.via] == [aten.t.default, aten.t.default] + view


# ----------------------------------------------------------------------------------------------
# Skip reasons


def test_skip_when_no_consumer_is_a_matmul(group):
    def f(x):
        return torch.relu(all_gather_single(x, 0, group))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 8))
    ags, _, result = find(gm)
    assert ags == []
    assert reasons(result, AG_SITE) == ["consumer aten.relu.default at relu is not a matmul "
                                        "(mm/addmm)"]


def test_extra_users_are_recorded_or_skipped(group):
    def other_reader(x, w):
        a = all_gather_single(x, 0, group)
        return a @ w, a + 1

    def feeds_the_other_operand(x):
        a = all_gather_single(x, 0, group)
        return a @ (a.t() * 2)

    x, w = torch.randn(2, 8), torch.randn(8, 4)
    gm = make_fx(other_reader, tracing_mode="fake")(x, w)
    [ag], _, result = find(gm)
    assert result.skipped == [] and [n.target for n in ag.other_users] == [aten.add.Tensor]
    _, _, strict = find(gm, allow_other_users=False)
    assert reasons(strict, AG_SITE) == ["the gathered tensor has other users "
                                        "(aten.add.Tensor at add)"]

    def raw_buffer_also_read(x, w):
        buf = c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, group.group_name))
        return torch.cat(torch.chunk(buf, WORLD), 1) @ w, buf   # gather on dim 1, and raw

    gm = make_fx(raw_buffer_also_read, tracing_mode="fake")(x, torch.randn(32, 4))
    ags, _, result = find(gm)
    assert ags == [] and reasons(result, AG_SITE) == [
        "the all-gather buffer wait_tensor is also read in its rank-major layout by the graph "
        "output (saved for backward or returned), besides the reassembly to gather dim 1"]

    gm = make_fx(feeds_the_other_operand, tracing_mode="fake")(x)
    ags, _, result = find(gm)
    assert ags == []
    [reason] = reasons(result, AG_SITE)
    assert reason.startswith("operand B of mm also depends on the gathered tensor (through mul)")


def test_skip_when_not_divisible_by_world_size_times_chunks(group):
    def f(x, w, v):
        h = all_gather_single(x, 0, group) @ w                     # rows: 4 x 3 = 12
        return reduce_scatter_single(h @ v, "sum", 0, group)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(8, 8), torch.randn(8, 8))
    ags, rss, result = find(gm, divisor=1)
    assert len(ags) == len(rss) == 1 and result.skipped == []     # 12 = 4 x 3: fine

    ags, rss, result = find(gm, divisor=2)                         # 12 is not a multiple of 8
    assert ags == [] and rss == []
    assert reasons(result, AG_SITE) == [
        "gather dim 0 of size 12 is not divisible by world size 4 x chunks_per_rank 2 = 8; "
        "pad dim 0 to 16 or set chunks_per_rank=1"]
    assert reasons(result, RS_SITE) == [
        "scatter dim 0 of size 12 is not divisible by world size 4 x chunks_per_rank 2 = 8; "
        "pad dim 0 to 16 or set chunks_per_rank=1"]

    with pytest.raises(ValueError, match="positive int, got 0"):
        find_all_gather_matches(gm.graph, PassResult(name="x"), divisor=0)

    # overlap="slice": the divisor is its `chunks` option, and the reasons say so (they named
    # chunks_per_rank, which slice mode ignores).
    from leancompile.options import CompileOptions
    from leancompile.passes.flash.driver import flash_overlap_pass

    result = flash_overlap_pass(gm, CompileOptions(compiler="aot_eager", overlap="slice",
                                                   chunks=2))
    assert result.rewritten == []
    assert sorted(s.reason for s in result.skipped) == [
        "gather dim 0 of size 12 is not divisible by world size 4 x chunks 2 = 8; "
        "pad dim 0 to 16 or set chunks=1",
        "scatter dim 0 of size 12 is not divisible by world size 4 x chunks 2 = 8; "
        "pad dim 0 to 16 or set chunks=1"]


def test_skip_unknown_group_and_wrong_group_size(group):
    def f(x, w):
        a = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, "no_such_group"))
        b = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, group.group_name))
        y = a @ w
        rs = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 4, "no_such_group"))
        return rs, b @ w

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 8), torch.randn(8, 8))
    ags, rss, result = find(gm)
    assert ags == [] and rss == []
    assert reasons(result, AG_SITE) == [
        "group 'no_such_group' is unknown: not a registered process group name (unknown group)",
        f"group size argument 2 does not match the size 4 of group '{group.group_name}'"]
    assert reasons(result, RS_SITE) == [
        "group 'no_such_group' is unknown: not a registered process group name (unknown group)"]


def test_skip_unsupported_reduce_op(group):
    def f(x, w):
        return reduce_scatter_single(x @ w, "avg", 0, group)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    _, rss, result = find(gm)
    assert rss == [] and reasons(result, RS_SITE) == [
        "reduce op 'avg' is not supported (sum only)"]


def test_autocast_sum_of_cast_products_is_one_site_and_another_dtype_is_skipped(group):
    """Autocast's input gradient of projections sharing one fp32 input: each bf16 product cast
    to fp32, then summed (``term_casts``). A term cast through float16 first would round where
    the rewrite does not: skipped, with the cast named."""
    def summed(dy1, dy2, w1, w2):
        s = (dy1 @ w1).to(torch.float32) + (dy2 @ w2).to(torch.float32)
        return reduce_scatter_single(s, "sum", 0, group)

    def through_half(dy1, dy2, w1, w2):
        s = (dy1 @ w1).to(torch.float16).to(torch.float32) + (dy2 @ w2).to(torch.float32)
        return reduce_scatter_single(s, "sum", 0, group)

    args = [torch.randn(8, 4, dtype=torch.bfloat16) for _ in range(2)] + [
        torch.randn(4, 16, dtype=torch.bfloat16) for _ in range(2)]
    _, rss, result = find(make_fx(summed, tracing_mode="fake")(*args))
    [rs] = rss
    assert result.skipped == [] and len(rs.terms) == 2 and len(rs.term_casts) == 2
    assert [mm.target for mm, _ in rs.terms] == [aten.mm.default] * 2
    _, rss, result = find(make_fx(through_half, tracing_mode="fake")(*args))
    [reason] = reasons(result, RS_SITE)
    assert rss == [] and "casts a summed matmul's result to torch.float16, not to the sum's " \
        "torch.float32" in reason, reason


def test_skip_reduce_scatter_not_fed_by_an_exclusive_matmul(group):
    def not_a_matmul(x):
        return reduce_scatter_single(torch.relu(x), "sum", 0, group)

    def shared_product(x, w):
        y = x @ w
        return reduce_scatter_single(y, "sum", 0, group), y + 1

    gm = make_fx(not_a_matmul, tracing_mode="fake")(torch.randn(8, 8))
    _, rss, result = find(gm)
    assert rss == [] and reasons(result, RS_SITE) == [
        "the reduce-scatter input is produced by aten.relu.default at relu, not by a matmul "
        "(mm/addmm)"]

    gm = make_fx(shared_product, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    _, rss, result = find(gm)
    [reason] = reasons(result, RS_SITE)
    assert rss == [] and reason.startswith(
        "the matmul result mm has other users (aten.add.Tensor at add)")


def test_skip_when_wait_is_not_the_only_user_of_the_collective(group):
    def f(x, w):
        ag = c10d.all_gather_into_tensor(x, 4, group.group_name)
        return c10d.wait_tensor(ag) @ w, ag

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 8), torch.randn(8, 8))
    ags, _, result = find(gm)
    [reason] = reasons(result, AG_SITE)
    assert ags == [] and reason == (
        "wait_tensor is not the only user of the collective (users: "
        "_c10d_functional.wait_tensor.default at wait_tensor, the graph output (saved for "
        "backward or returned))")


# ----------------------------------------------------------------------------------------------
# Dynamic shapes


def test_dynamic_shapes_divisibility_decided_on_symbolic_sizes(group):
    def f(x, w):
        return all_gather_single(x, 1, group) @ w            # sequence dim 1, split+cat

    x = torch.randn(2, 6, 16, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    fw, bw = compile_graphs(f, x, w, dynamic=True)

    # chunks_per_rank 1: gathered size 4*s is divisible by 4 for every s, no guard.
    [ag], [], _ = find(fw)
    [], [rs], _ = find(bw)       # the backward of the gather: slices on dim 1 + cat -> RS
    seq = ag.shard.meta["val"].shape[1].node.expr              # the shard's sequence symbol
    assert str(ag.shape[1]) == f"4*{seq}" and ag.needs_guard is None
    assert rs.scatter_dim == 1 and rs.needs_guard is None
    assert [n.target for n in rs.reassembly] == [aten.slice.Tensor] * WORLD + [aten.cat.default]

    # chunks_per_rank 2: 4*s divisible by 8 only when s is even: a guard, not a skip.
    [ag], [], _ = find(fw, divisor=2)
    [], [rs], _ = find(bw, divisor=2)
    for match in (ag, rs):
        assert match.needs_guard is not None and match.needs_guard.free_symbols == {seq}
        assert match.needs_guard.subs(seq, 6) and not match.needs_guard.subs(seq, 3)

    # ... or a skip naming the symbol and the guard when guards are not allowed.
    [], [], result = find(fw, divisor=2, allow_guards=False)
    [reason] = reasons(result, AG_SITE)
    assert reason.startswith(f"symbolic size 4*{seq} of gather dim 1 cannot be proven divisible "
                             "by world size 4 x chunks_per_rank 2 = 8: true for the traced "
                             "shapes (= 24) only under the guard")

    # The guard is a condition the shape environment can install.
    shape_env = ag.shard.meta["val"].fake_mode.shape_env
    before = len(shape_env.guards)
    shape_env.evaluate_expr(ag.needs_guard)
    assert len(shape_env.guards) == before + 1


def test_dynamic_shapes_odd_traced_size_is_skipped_not_guarded(group):
    def f(x, w):
        return all_gather_single(x, 1, group) @ w

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(2, 3, 16), torch.randn(16, 8))
    ags, _, result = find(gm, divisor=2)
    [reason] = reasons(result, AG_SITE)
    assert ags == [] and reason.startswith("symbolic size 4*s")
    assert "of gather dim 1 (= 12 for the traced shapes) is not divisible by world size 4 x " \
           "chunks_per_rank 2 = 8" in reason


def test_pass_adds_the_guard_in_a_forward_graph_and_skips_in_a_backward_one(group):
    """The rewrite, not only the matcher: with chunks_per_rank=2 the forward's site is
    rewritten after adding its guard to the shape environment; the backward graph adds no
    guard (here the forward ran without the pass, so nothing proves it): skipped, reason."""
    from leancompile.options import CompileOptions
    from leancompile.passes.flash.driver import flash_overlap_pass

    def f(x, w):
        return all_gather_single(x, 1, group) @ w

    x = torch.randn(2, 6, 16, requires_grad=True)
    fw, bw = compile_graphs(f, x, torch.randn(16, 8, requires_grad=True), dynamic=True)
    options = CompileOptions(compiler="aot_eager", overlap="flash", chunks_per_rank=2)
    [ag] = [n for n in fw.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    shape_env = ag.args[0].meta["val"].fake_mode.shape_env
    before = len(shape_env.guards)

    result = flash_overlap_pass(bw, options)
    assert result.rewritten == [] and len(shape_env.guards) == before
    [skip] = result.skipped
    assert "only under the guard Eq(Mod(4*s" in skip.reason and "which is not added here" in \
        skip.reason, skip.reason

    result = flash_overlap_pass(fw, options)
    assert [s.kind for s in result.rewritten] == [AG_SITE] and result.skipped == []
    # The divisibility guard first; tracing the schedule over symbolic sizes adds the usual
    # size guards of narrow/cat/reshape (e.g. that a chunk is not of length 1).
    seq = next(iter(shape_env.guards[before].expr.free_symbols))
    assert str(shape_env.guards[before].expr) == f"Eq(Mod(4*{seq}, 8), 0)"
    assert c10d.all_gather_into_tensor.default not in [n.target for n in fw.graph.nodes]


def test_all_reduce_only_graph_is_reported_without_a_warning(group, caplog):
    """A graph whose only collective is an all-reduce (a DTensor optimizer step, a loss
    average) has nothing for FlashOverlap: the report names the all-reduce as left to the
    backend, and no "rewrote none" warning is logged (it was, on every compile). A graph with
    an all-gather the pass could not rewrite still warns."""
    import logging

    from leancompile.options import CompileOptions
    from leancompile.passes.flash.driver import flash_overlap_pass

    options = CompileOptions(compiler="aot_eager", overlap="flash")

    def reduce_only(x, w):
        return funcol.all_reduce(x @ w, "sum", group)

    fw, _ = compile_graphs(reduce_only, torch.randn(8, 16, requires_grad=True),
                           torch.randn(16, 8, requires_grad=True))
    with caplog.at_level(logging.WARNING, logger="leancompile"):
        result = flash_overlap_pass(fw, options)
    [skip] = result.skipped
    assert "all_reduce" in skip.node and "leaves it to the backend" in skip.reason, skip
    assert not [r for r in caplog.records if "rewrote none" in r.getMessage()]

    def gather_no_matmul(x, w):
        return all_gather_single(x, 0, group).relu() * w.sum()

    fw, _ = compile_graphs(gather_no_matmul, torch.randn(8, 16, requires_grad=True),
                           torch.randn(16, 8, requires_grad=True))
    with caplog.at_level(logging.WARNING, logger="leancompile"):
        flash_overlap_pass(fw, options)
    [warning] = [r.getMessage() for r in caplog.records if "rewrote none" in r.getMessage()]
    assert "rewrote none of the 1 all-gathers and reduce-scatters" in warning, warning


def _val_signature(graph):
    sig = []
    for n in graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        sig.append((n.name, str(n.target), tuple(
            (type(v).__name__, tuple(v.shape), v.stride(), v.dtype, v.device)
            if isinstance(v, torch.Tensor) else repr(v) for v in vals)))
    return sig


@pytest.mark.parametrize("overlap", ["flash", "slice"])
def test_schedules_recorded_on_meta_equal_the_fake_tensor_recording(group, monkeypatch,
                                                                    overlap):
    """With static shapes the rewrite records its schedules on meta tensors (the cheap path);
    the graphs it inserts must be the ones the fake-tensor recording gives: the same code, the
    same fake values on the real device in every node's meta, no meta device in any argument
    (a device read from a meta tensor is recorded as the real one)."""
    import copy

    import leancompile.passes.flash.driver as fo
    import leancompile.passes.flash.splice as fg
    from leancompile.options import CompileOptions

    _, model = tp_sp_mlp()
    x = torch.randn(2, 8, 16, requires_grad=True)
    fw, bw = compile_graphs(model, x)
    options = CompileOptions(compiler="aot_eager", overlap=overlap,
                             **({"chunks": 2} if overlap == "slice" else {"chunks_per_rank": 2}))
    used = []
    record = fg._record_on_meta
    monkeypatch.setattr(fg, "_record_on_meta",
                        lambda *a: used.append(1) or record(*a))
    for gm in (fw, bw):
        on_meta, on_fake = copy.deepcopy(gm), copy.deepcopy(gm)
        before = len(used)
        result = fo.flash_overlap_pass(on_meta, options)
        assert len(result.rewritten) == 2 and result.skipped == [], result
        assert len(used) - before == 2  # both sites recorded on meta, no fallback
        with monkeypatch.context() as m:
            m.setattr(fg, "_static_device", lambda values: None)
            fo.flash_overlap_pass(on_fake, options)
        assert len(used) - before == 2
        assert on_meta.code == on_fake.code
        assert _val_signature(on_meta.graph) == _val_signature(on_fake.graph)
        for n in on_meta.graph.nodes:
            for a in (*n.args, *n.kwargs.values()):
                assert not (isinstance(a, torch.device) and a.type == "meta"), n.format_node()
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                assert isinstance(val, torch._subclasses.FakeTensor) and val.device.type == \
                    "cpu", n.format_node()


def test_a_second_weights_gather_after_the_first_matmul_moves_up_with_its_wait(group):
    """A SwiGLU FFN on a 2-D mesh: the sequence gather feeds two matmuls whose weights are
    gathered (FSDP) where each is used, so w3's gather and wait come after w1's matmul, where
    the input gather's schedule goes. The rewrite moves w3's gather and its wait up before
    the schedule (only pure nodes between: the communication keeps its order); with another
    collective between them it refuses, with the reason."""
    from leancompile.options import CompileOptions
    from leancompile.passes.flash.driver import flash_overlap_pass

    def ffn(x, w1, w3):
        h = all_gather_single(x + x.mean(), 0, group)
        a = h @ all_gather_single(w1, 0, group).t()
        return F.silu(a) * (h @ all_gather_single(w3, 0, group).t())

    def ffn_with_a_collective_between(x, w1, w3, y):
        h = all_gather_single(x + x.mean(), 0, group)
        a = h @ all_gather_single(w1, 0, group).t()
        z = all_gather_single(y, 0, group)  # a collective after the first matmul
        return F.silu(a) * (h @ all_gather_single(w3, 0, group).t()) + z

    args = (torch.randn(2, 16), torch.randn(8, 16), torch.randn(8, 16))
    options = CompileOptions(compiler="aot_eager", overlap="flash")
    gm = make_fx(ffn, tracing_mode="fake")(*args)
    comm = [n.args[0].name for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    result = flash_overlap_pass(gm, options)
    assert [s.kind for s in result.rewritten] == [AG_SITE], result.summary()
    assert all("also reads the all-gather" in s.reason for s in result.skipped), result.summary()
    nodes = list(gm.graph.nodes)
    left = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    assert [n.args[0].name for n in left] == comm[1:]  # w1's, then w3's: their order kept
    first_p2p = next(n for n in nodes if getattr(n.target, "namespace", "") == "leancompile")
    w3_wait = next(iter(left[1].users))
    assert nodes.index(w3_wait) < nodes.index(first_p2p)
    gm.graph.lint()

    gm = make_fx(ffn_with_a_collective_between, tracing_mode="fake")(*args, torch.randn(2, 32))
    result = flash_overlap_pass(gm, options)
    [site] = [s for s in result.skipped if s.reason.endswith("but cannot be moved")]
    assert site.kind == AG_SITE and result.rewritten == [], result.summary()

    # w3's gather issued first (a prefetch the program wrote), another gather of the group
    # after it, w3 waited on after the first matmul: the wait alone moves up, the gathers keep
    # their order (a review's reproduction: the pair used to move down below y's gather)
    def ffn_with_w3_issued_first(x, w1, w3, y):
        g3 = c10d.all_gather_into_tensor(w3, WORLD, group.group_name)
        gy = c10d.all_gather_into_tensor(y, WORLD, group.group_name)
        h = all_gather_single(x + x.mean(), 0, group)
        a = h @ all_gather_single(w1, 0, group).t()
        return F.silu(a) * (h @ c10d.wait_tensor(g3).t()) + c10d.wait_tensor(gy).sum()

    gm = make_fx(ffn_with_w3_issued_first, tracing_mode="fake")(*args, torch.randn(2, 32))
    result = flash_overlap_pass(gm, options)
    assert [s.kind for s in result.rewritten] == [AG_SITE], result.summary()
    nodes = list(gm.graph.nodes)
    left = [n.args[0].name for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    assert left == ["w3_1", "y_1", "w1_1"], left
    gm.graph.lint()
