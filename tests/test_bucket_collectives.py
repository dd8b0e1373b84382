"""The bucketing pass (``CompileOptions(bucket_cap_mb=...)``, ``passes/bucket_collectives.py``).

Which collectives share a bucket is decided on graphs traced here with ``make_fx`` (fake
tensors: no process group needed): the cap, the dtype, the reduction, an input computed after
the bucket's first read (moved up when pure, else the bucket closes), symbolic sizes; every
collective left alone has its reason. The values are checked on 2 and 4 gloo ranks against
the same program compiled without the pass and against eager: a sharded model (uneven
parameter rows, padded as ``DTensor``'s ``Shard(0)``; two parameters cast to bf16 before their
gathers, as a mixed-precision policy does; two biases with equal gradients, whose reductions
the graph's CSE merges) under both compilers, two backwards accumulating into ``.grad``, with a
cap that makes several buckets of each kind.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from models import gather_shard, register_shards
from ranks import spawn

c10d = torch.ops._c10d_functional
AG = "_c10d_functional.all_gather_into_tensor.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"


def _gather(x, ranks=2):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, ranks, "0"))


def _scatter(x, op="sum", ranks=2):
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, op, ranks, "0"))


def _bucket(fn, *args, cap_bytes=1 << 20, mode="fake"):
    from leancompile.passes.bucket_collectives import find_buckets
    from leancompile.passes.result import PassResult

    gm = make_fx(fn, tracing_mode=mode)(*args)
    result = PassResult(name="bucket_collectives")
    buckets = find_buckets(gm, cap_bytes, result)
    return gm, buckets, {s.node: s.reason for s in result.skipped}


def _members(buckets):
    return [[m.collective.name for m in b.members] for b in buckets]


def test_buckets_split_at_the_cap_and_by_dtype_and_reduction():
    def fn(a, b, c, d, h, g1, g2, g3):
        ga, gb, gc, gd = _gather(a), _gather(b), _gather(c), _gather(d)
        gh = _gather(h)  # bf16: a bucket of its own dtype
        s1, s2 = _scatter(g1), _scatter(g2)
        s3 = _scatter(g3, "avg")  # another reduction
        return ga.sum() + gb.sum() + gc.sum() + gd.sum() + gh.float().sum(), s1, s2, s3

    kib = torch.randn(256)  # 1 KiB
    _, buckets, skipped = _bucket(fn, kib, kib, torch.randn(384), kib, kib.bfloat16(),
                                  torch.randn(64), torch.randn(64), torch.randn(64),
                                  cap_bytes=2048)
    assert _members(buckets) == [["all_gather_into_tensor", "all_gather_into_tensor_1"],
                                 ["reduce_scatter_tensor", "reduce_scatter_tensor_1"]]
    assert [b.describe() for b in buckets] == [
        "all_gather of 2 tensors, 2.00 KiB, torch.float32, group '0' of 2 ranks",
        "reduce_scatter of 2 tensors, 512 B (sum), torch.float32, group '0' of 2 ranks"]
    # 1 + 1 KiB fill the first bucket; 1.5 + 1 KiB would pass the cap
    assert skipped["all_gather_into_tensor_2"] == (
        "alone in its bucket: the next all_gather (all_gather_into_tensor_3) would pass the cap "
        "(2.50 KiB)")
    for alone in ("all_gather_into_tensor_3", "all_gather_into_tensor_4"):
        assert "no later collective of its kind, group and dtype" in skipped[alone]
    assert "no later collective" in skipped["reduce_scatter_tensor_2"]


def test_an_input_cast_after_the_first_read_moves_up_an_impure_one_closes_the_bucket():
    def cast(a, b, c):  # a mixed-precision policy: each parameter cast just before its gather
        ga = _gather(a.to(torch.bfloat16))
        y = ga.float().sum()
        gb = _gather(b.to(torch.bfloat16).mul(2))  # two pure steps: moved up
        return y + gb.float().sum() + c

    gm, buckets, skipped = _bucket(cast, torch.randn(8), torch.randn(8), torch.randn(1))
    assert _members(buckets) == [["all_gather_into_tensor", "all_gather_into_tensor_1"]]
    assert [n.target for n in buckets[0].hoist] == [torch.ops.aten._to_copy.default,
                                                    torch.ops.aten.mul.Tensor]

    def depends(a, b):  # the second gather's input needs the first one's result
        ga = _gather(a)
        gb = _gather(b + ga[:4])
        return ga.sum() + gb.sum()

    _, buckets, skipped = _bucket(depends, torch.randn(4), torch.randn(4))
    assert buckets == []
    assert "is computed after this bucket's result is first read" in \
        skipped["all_gather_into_tensor"], skipped

    def random(a, b):  # a random op is never moved (it advances the generator)
        ga = _gather(a)
        y = ga.sum()
        gb = _gather(b + torch.rand_like(b))
        return y + gb.sum()

    _, buckets, _ = _bucket(random, torch.randn(4), torch.randn(4))
    assert buckets == []


def test_rewritten_graph_and_symbolic_sizes():
    from leancompile.options import CompileOptions
    from leancompile.passes.bucket_collectives import bucket_collectives_pass, merged_counts

    def fn(a, b, g1, g2):
        return _gather(a).sum() * _gather(b).sum(), _scatter(g1), _scatter(g2)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 2), torch.randn(5), torch.randn(4, 2),
                                          torch.randn(6))
    result = bucket_collectives_pass(gm, CompileOptions(bucket_cap_mb=1))
    ops = [str(n.target) for n in gm.graph.nodes]
    assert (ops.count(AG), ops.count(RS)) == (1, 1)
    assert merged_counts(result) == {"all_gather": (2, 1), "reduce_scatter": (2, 1)}
    gather = next(n for n in gm.graph.nodes if str(n.target) == AG)
    assert tuple(gather.args[0].meta["val"].shape) == (11,)  # 6 + 5 elements per rank
    scatter = next(n for n in gm.graph.nodes if str(n.target) == RS)
    assert tuple(scatter.args[0].meta["val"].shape) == (14,)  # 2 ranks x (4 + 3)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in out[1:]] == [(2, 2), (3,)]

    # Issued where the first member was, not at the top of the graph (the parameters are
    # inputs: issued there, every bucket would hold its full tensors from the start)
    def late(x, a, b):
        y = x.relu()
        return y.sum() + _gather(a).sum() + (y * _gather(b)).sum()

    gm = make_fx(late, tracing_mode="fake")(torch.randn(4), torch.randn(2), torch.randn(2))
    bucket_collectives_pass(gm, CompileOptions(bucket_cap_mb=1))
    order = [str(n.target) for n in gm.graph.nodes]
    assert order.count(AG) == 1 and order.index("aten.relu.default") < order.index(AG)

    # Symbolic sizes: left alone, with the reason
    _, buckets, skipped = _bucket(lambda a, b: _gather(a).sum() + _gather(b).sum(),
                                  torch.randn(4), torch.randn(4), mode="symbolic")
    assert buckets == [] and all("symbolic size" in r for r in skipped.values()), skipped


def test_buckets_that_interact_give_a_valid_graph():
    """Buckets of two kinds or groups whose moved inputs meet: a node reading another
    bucket's result is never moved (that result is unpacked later, before its own bucket's
    first read), a node one bucket moves is not moved again by another, and every bucket is
    rewritten on the graph all buckets' moves made."""
    from leancompile.options import CompileOptions
    from leancompile.passes.bucket_collectives import bucket_collectives_pass

    def gather(x, group):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, group))

    def gradient_of_gathered(w1, w2, g1, dy):  # a TP/SP-like backward under FSDP
        big_w1, big_w2 = _gather(w1), _gather(w2)
        y = _scatter(g1) * 2
        return y, _scatter(dy @ big_w1), big_w2.sum()

    def cast_of_gathered(a, c, b):
        g1, g3, g2 = _gather(a), _gather(c), _gather(b)
        y = g2.float().sum()
        return y + g3.sum() + _gather(g1.to(torch.bfloat16)).float().sum()

    def shared_input(p, a, b, second_read_first):
        """x is gathered on group 1, then on group 0, both after the groups' first reads."""
        g0, g1 = gather(a, "0"), gather(b, "1")
        y1, y0 = (g1.sum(), g0.sum()) if second_read_first else (g0.sum(), g1.sum())
        x = p * 2
        return y0 + y1 + gather(x, "1").sum() + gather(x, "0").sum()

    cases = [(gradient_of_gathered, (torch.randn(2, 4), torch.randn(3), torch.randn(4),
                                     torch.randn(4, 4))),
             (cast_of_gathered, (torch.randn(4), torch.randn(4), torch.randn(4).bfloat16())),
             (lambda p, a, b: shared_input(p, a, b, True), (torch.randn(4),) * 3),
             (lambda p, a, b: shared_input(p, a, b, False), (torch.randn(4),) * 3)]
    merged = []
    for fn, args in cases:
        gm = make_fx(fn, tracing_mode="fake")(*args)
        result = bucket_collectives_pass(gm, CompileOptions(bucket_cap_mb=1))
        gm.graph.lint()  # every node defined before it is read
        merged.append(len(result.notes))
        for site in result.skipped:
            assert "please report" not in site.reason, site
    # The gathers still bucket where they can. x, moved up for group 1, serves group 0 where
    # group 0 reads later; where group 0 reads first it would have to move further: group 0's
    # second gather starts a bucket of its own
    assert merged == [1, 1, 2, 1], merged


def test_overlap_chunks_stay_and_returned_results_are_tensors_of_their_own():
    from leancompile.options import CompileOptions
    from leancompile.passes.bucket_collectives import bucket_collectives_pass
    from leancompile.passes.flash.splice import SITE_META

    def fn(a, b, g1, g2):
        return _gather(a).sum() + _gather(b).sum(), _scatter(g1), _scatter(g2)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4), torch.randn(4), torch.randn(4, 2),
                                          torch.randn(6))
    for node in gm.graph.nodes:  # the gathers: chunks of an overlap="slice" schedule
        if str(node.target) == AG:
            node.meta[SITE_META] = "all_gather_into_tensor_7"
    result = bucket_collectives_pass(gm, CompileOptions(bucket_cap_mb=1))
    assert [s.reason for s in result.skipped if s.kind == "all_gather"] == [
        "a piece of the overlap pass's schedule for all_gather_into_tensor_7 (overlap='slice' "
        "issues its chunks as collectives on purpose; merging them would undo the overlap)"] * 2
    assert result.notes == [
        "reduce_scatter of 2 tensors, 56 B (sum), torch.float32, group '0' of 2 ranks"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    first, second = (o.meta["val"] for o in out[1:])
    assert first._base is None and second._base is None  # not views: as the waits were
    assert first.untyped_storage()._cdata != second.untyped_storage()._cdata


def test_options_validate_the_cap():
    from leancompile.grpo.trainer import GRPOConfig
    from leancompile.options import CompileOptions

    for bad in (0, -1.0, True, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            CompileOptions(bucket_cap_mb=bad)
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            GRPOConfig(bucket_cap_mb=bad)
    assert CompileOptions(bucket_cap_mb=0.5).cache_key()["bucket_cap_mb"] == 0.5


# -- values on gloo ranks --------------------------------------------------------------------

class Sharded(torch.nn.Module):
    """Parameters split along dim 0 (``torch.chunk`` rows, padded to one size per rank),
    gathered inside the compiled forward (gradients reduce-scattered in its backward); ``w2``
    and ``w3`` are cast to bf16 before their gathers, as a mixed-precision policy does (the
    cast of ``w3`` comes after ``w2``'s gathered weight is read: the pass moves it up)."""

    def __init__(self, rank, world, d=12, h=20):
        super().__init__()
        torch.manual_seed(0)
        full = {"w1": torch.randn(h, d) / d ** 0.5, "b1": torch.randn(h),
                "w2": torch.randn(d, h) / h ** 0.5, "b2": torch.randn(d), "b3": torch.randn(d),
                "w3": torch.randn(7, d) / d ** 0.5}
        self.rows = register_shards(self, full, rank, world)

    def full(self, name):
        return gather_shard(getattr(self, name), self.rows[name],
                            torch.bfloat16 if name in ("w2", "w3") else None)

    def forward(self, x):
        h = torch.nn.functional.gelu(x @ self.full("w1").T + self.full("b1"))
        # b2 and b3 get equal gradients: the graph's CSE makes their reductions one
        y = (h.bfloat16() @ self.full("w2").T).float() + self.full("b2") + self.full("b3")
        return (y.bfloat16() @ self.full("w3").T).float().pow(2).mean()


def _values_worker(rank, world, init, out, compilers):
    import leancompile

    torch._inductor.config.fx_graph_cache = False  # a cache hit runs no pass: no report
    torch._functorch.config.enable_autograd_cache = False
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    x = torch.randn(6, 12)
    runs, reports, shared = {}, {}, {}
    variants = [("eager", None, None)] + [
        (name, c, cap) for c in compilers
        for name, cap in ((c, None), (f"{c}_bucketed", 0.0006))]
    for name, compiler, cap in variants:
        torch._dynamo.reset()
        model = Sharded(rank, world)
        fn = model if compiler is None else torch.compile(model, backend=leancompile.backend(
            compiler=compiler, **({} if cap is None else {"bucket_cap_mb": cap})))
        for _ in range(2):  # the second backward accumulates into .grad
            loss = fn(x)
            loss.backward()
        runs[name] = [loss.detach()] + [p.grad for p in model.parameters()]
        shared[name] = model.b2.grad.data_ptr() == model.b3.grad.data_ptr()
        if cap is not None:
            report = leancompile.last_report()
            reports[name] = {r.phase: {
                "ag": r.op_counts_after.get(AG, 0), "rs": r.op_counts_after.get(RS, 0),
                "notes": [n for p in r.passes if p.name == "bucket_collectives"
                          for n in p.notes]} for r in report.graphs}

    def diff(a, b):
        return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
                   for x, y in zip(runs[a], runs[b]))

    result = {"reports": reports, "shared_grads": shared,
              "bitwise": {f"{c}_bucketed": all(torch.equal(x, y) for x, y in zip(
                  runs[f"{c}_bucketed"], runs[c])) for c in compilers},
              "loss_bitwise": {c: torch.equal(runs[f"{c}_bucketed"][0], runs[c][0])
                               for c in compilers},
              "vs_plain": {c: diff(f"{c}_bucketed", c) for c in compilers},
              "vs_eager": {c: diff(f"{c}_bucketed", "eager") for c in compilers}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world,compilers", [(2, ("aot_eager", "inductor")),
                                              (4, ("aot_eager",))])
def test_bucketed_sharded_model_equals_the_unbucketed_compile(tmp_path, world, compilers):
    spawn(_values_worker, args=(world, str(tmp_path / "init"), str(tmp_path), compilers),
          nprocs=world)
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, phases in got["reports"].items():
            # 0.0006 MiB (629 bytes): the forward's fp32 parts (w1, b1, b2) make one bucket,
            # the bf16 parts (w2, w3, w3's cast moved up) another; the backward's full-size
            # gradients several
            assert phases["forward"]["ag"] == 2, (name, phases)
            assert any("torch.bfloat16" in n for n in phases["forward"]["notes"]), phases
            assert 1 < phases["backward"]["rs"] < 5, (name, phases)
            assert phases["forward"]["notes"] and phases["backward"]["notes"], phases
        # Two parameters' equal gradients are two tensors (Inductor returned two views of one
        # region before: accumulating into one .grad changed the other)
        assert not any(got["shared_grads"].values()), got["shared_grads"]
        # The gathers only move bytes: the loss is bitwise. Two ranks sum one pair whatever
        # the buffer: bitwise gradients; four may sum in another order: rounding
        assert all(got["loss_bitwise"].values()), got
        if world == 2:
            assert all(got["bitwise"].values()), got
        assert all(v <= 1e-6 for v in got["vs_plain"].values()), got
        assert all(v <= 2e-2 for v in got["vs_eager"].values()), got  # bf16 in the model

