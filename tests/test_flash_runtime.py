"""FlashOverlap runtime: the P2P ops (leancompile/runtime/p2p.py) and the per-rank schedules
(leancompile/runtime/flash_schedules.py).

Step lists are checked in-process (ordering properties from docs/flashoverlap.md, the
ranks' messages matching, a simulated run finishing). Input errors and graph structure use torch's
fake process group. Numerics run on gloo with 2 and 4 processes: one spawn per world size runs the
whole matrix against the collectives the schedules replace and writes one JSON file per rank; the
tests below read them.
"""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.runtime.flash_schedules import (
    flash_ag_steps,
    flash_all_gather_matmul,
    flash_all_gather_weight_matmul,
    flash_matmul_reduce_scatter,
    flash_rs_steps,
    sliced_all_gather_matmul,
    sliced_all_gather_weight_matmul,
    sliced_matmul_reduce_scatter,
)
from leancompile.runtime.p2p import (
    P2P_PROBE,
    P2P_START,
    P2P_WAIT,
    pending_exchanges,
    probe,
    start_exchange,
    wait_exchange,
)
from ranks import spawn

# ---------------------------------------------------------------------------------------------
# Step lists


def _all_traces(kind, world, m):
    if kind == "ag":
        return [flash_ag_steps(r, world, m) for r in range(world)]
    return [flash_rs_steps(r, world, m, kind) for r in range(world)]


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_flash_ag_steps_order(world, m):
    for r, trace in enumerate(_all_traces("ag", world, m)):
        steps = trace.steps
        assert len(steps) == world * m
        # The first round is the rank's own data: no wait, nothing remote.
        for s in steps[:m]:
            assert s.compute == (r, s.index) and s.wait == ()
        # The last round sends and receives nothing.
        for s in steps[-m:]:
            assert s.send is None and s.recv is None
        # Step i*m + c computes chunk c of slice (r - i) % N; every slice exactly once.
        assert [s.compute for s in steps] == [((r - i) % world, c)
                                              for i in range(world) for c in range(m)]
        # Each slice is forwarded to r+1 in the step that computes it (before the last round).
        for s in steps[:-m]:
            assert s.send.slice == s.compute and s.send.peer == (r + 1) % world
            assert s.recv.peer == (r - 1) % world
        assert len(trace.sends()) == (world - 1) * m  # (N-1)/N of the tensor, as a ring


@pytest.mark.parametrize("variant", ["ring", "direct"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_flash_rs_steps_order(world, m, variant):
    for r, trace in enumerate(_all_traces(variant, world, m)):
        steps = trace.steps
        assert len(steps) == world * m
        assert sorted(s.compute for s in steps) == [(j, c) for j in range(world)
                                                    for c in range(m)]
        # The last round computes the rank's own slice and sends nothing.
        for c, s in enumerate(steps[-m:]):
            assert s.compute == (r, c) and s.send is None and s.recv is None
        # Nothing to wait for before the first partial exists.
        for s in steps[:m]:
            assert s.wait == ()
        assert len(trace.sends()) == (world - 1) * m
        if variant == "ring":
            assert [s.compute for s in steps] == [((r - 1 - i) % world, c)
                                                  for i in range(world) for c in range(m)]
            for s in steps[:-m]:
                assert s.send.slice == s.compute and s.send.peer == (r + 1) % world
        else:
            for s in steps[:-m]:
                assert s.send.peer == s.compute[0] != r  # straight to the owner
            for c, s in enumerate(steps[-m:]):
                assert sorted(t.peer for t in s.wait) == [q for q in range(world) if q != r]


def _simulate(traces):
    """Run all ranks' step lists against each other. Waiting an exchange needs its message to
    have been sent and, for the send it was posted with, the peer's receive to be posted (a
    gloo send completes only then). Steps post their exchange after their waits (the order of
    ``Step``). Returns the ranks that could not finish (empty: no deadlock)."""
    sends, recvs = set(), set()  # (src, dst, tag) posted
    at = [0] * len(traces)

    def waitable(r, trace, t):
        posted = next(s for s in trace.steps if s.recv is not None and s.recv.tag == t.tag)
        ok = (t.peer, r, t.tag) in sends
        if posted.send is not None:
            ok = ok and (r, posted.send.peer, posted.send.tag) in recvs
        return ok

    progress = True
    while progress:
        progress = False
        for r, trace in enumerate(traces):
            if at[r] == len(trace.steps):
                continue
            step = trace.steps[at[r]]
            if all(waitable(r, trace, t) for t in step.wait):
                if step.send is not None:
                    sends.add((r, step.send.peer, step.send.tag))
                if step.recv is not None:
                    recvs.add((step.recv.peer, r, step.recv.tag))
                at[r] += 1
                progress = True
    return [r for r, trace in enumerate(traces) if at[r] < len(trace.steps)]


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["ag", "ring", "direct"])
def test_step_lists_match_across_ranks_and_finish(kind, world, m):
    traces = _all_traces(kind, world, m)
    sends = {(r, t.peer, t.tag): t.slice for r, tr in enumerate(traces) for t in tr.sends()}
    recvs = {(t.peer, r, t.tag): t.slice for r, tr in enumerate(traces) for t in tr.recvs()}
    assert sends == recvs  # every message has exactly one matching receive, same data
    for r, tr in enumerate(traces):
        waited = [t for s in tr.steps for t in s.wait]
        assert sorted((t.peer, t.tag) for t in waited) == sorted(
            (t.peer, t.tag) for t in tr.recvs())  # every receive waited once
        posted_at = {t.tag: s.index for s in tr.steps for t in [s.recv] if t is not None}
        for s in tr.steps:
            for t in s.wait:
                assert posted_at[t.tag] <= s.index
    assert _simulate(traces) == []


def test_step_lists_against_the_paper_tables():
    # docs/flashoverlap.md section 1, N = 3, rank 0.
    assert flash_ag_steps(0, 3).format().splitlines()[1:] == [
        "  step 0: compute slice 0.0; send 0.0 to 1; recv 2.0 from 2",
        "  step 1: compute slice 2.0; wait 2.0 from 2; send 2.0 to 1; recv 1.0 from 2",
        "  step 2: compute slice 1.0; wait 1.0 from 2",
    ]
    assert flash_rs_steps(0, 3).format().splitlines()[1:] == [
        "  step 0: compute slice 2.0; send 2.0 to 1; recv 1.0 from 2",
        "  step 1: compute slice 1.0; wait 1.0 from 2; send 1.0 to 1; recv 0.0 from 2",
        "  step 2: compute slice 0.0; wait 0.0 from 2",
    ]
    assert flash_rs_steps(0, 3, variant="direct").format().splitlines()[1:] == [
        "  step 0: compute slice 1.0; send 1.0 to 1; recv 0.0 from 2",
        "  step 1: compute slice 2.0; send 2.0 to 2; recv 0.0 from 1",
        "  step 2: compute slice 0.0; wait 0.0 from 2, 0.0 from 1",
    ]


def test_step_list_errors():
    with pytest.raises(ValueError, match="rank 4 is not in a group of 4 ranks"):
        flash_ag_steps(4, 4)
    with pytest.raises(ValueError, match=r"chunks_per_rank=0: expected an int >= 1"):
        flash_rs_steps(0, 4, 0)
    with pytest.raises(ValueError, match="unknown reduce-scatter variant 'tree'"):
        flash_rs_steps(0, 4, 1, "tree")


# ---------------------------------------------------------------------------------------------
# Fake process group: input errors, world size 1, graph structure


@pytest.fixture
def fake_group():
    """A fake 4-rank process group in this process, as rank 1 (no communication happens)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def test_reduce_scatter_input_errors(fake_group):
    h, w = torch.randn(6, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"size 6 along scatter_dim 0, not divisible by world "
                                         r"size 4 x chunks_per_rank 1 = 4; pad it to 8$"):
        flash_matmul_reduce_scatter(h, w, group_name=fake_group)
    with pytest.raises(ValueError, match=r"size 12 along scatter_dim 0.* = 8; pad it to 16; or "
                                         r"use chunks_per_rank dividing 3"):
        flash_matmul_reduce_scatter(torch.randn(12, 8), w, group_name=fake_group,
                                    chunks_per_rank=2)
    with pytest.raises(ValueError, match=r"size 4 along scatter_dim 1, .* x chunks 2 = 8; "
                                         r"pad it to 8; or use chunks dividing 1"):
        sliced_matmul_reduce_scatter(torch.randn(8, 8), w, group_name=fake_group,
                                     scatter_dim=1, chunks=2)
    with pytest.raises(ValueError, match=r"unknown variant 'tree'; use one of \('ring', "
                                         r"'direct'\)"):
        flash_matmul_reduce_scatter(torch.randn(8, 8), w, group_name=fake_group,
                                    variant="tree")
    with pytest.raises(ValueError, match=r"w has 8 rows but the input's last dim \(K\) is 5"):
        flash_matmul_reduce_scatter(torch.randn(8, 5), w, group_name=fake_group)
    with pytest.raises(ValueError, match="unknown process group name 'nope'"):
        flash_matmul_reduce_scatter(torch.randn(8, 8), w, group_name="nope")
    # a sum of matmuls: one h, w (and bias) per term, one output shape
    with pytest.raises(ValueError, match=r"as many h, w \(and bias\) as terms, got 2 h, 1 w"):
        flash_matmul_reduce_scatter([h, h], [w], group_name=fake_group)
    with pytest.raises(ValueError, match=r"different output shapes \[\(8, 4\), \(8, 2\)\]"):
        flash_matmul_reduce_scatter([torch.randn(8, 8)] * 2, [w, torch.randn(8, 2)],
                                    group_name=fake_group)


def test_all_gather_input_errors(fake_group):
    x, w = torch.randn(3, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"size 3 along gather_dim 0, not divisible by "
                                         r"chunks_per_rank=2; pad it to 4 or use "
                                         r"chunks_per_rank=1"):
        flash_all_gather_matmul(x, [w], group_name=fake_group, chunks_per_rank=2)
    with pytest.raises(ValueError, match=r"gather_dim=-1 is the contraction \(K\) dim"):
        flash_all_gather_matmul(x, [w], group_name=fake_group, gather_dim=-1)
    with pytest.raises(ValueError, match=r"gather_dim=2 is out of range for a 2-D tensor"):
        flash_all_gather_matmul(x, [w], group_name=fake_group, gather_dim=2)
    with pytest.raises(ValueError, match=r"weights\[1\] has 5 rows"):
        flash_all_gather_matmul(x, [w, torch.randn(5, 4)], group_name=fake_group)
    with pytest.raises(ValueError, match="weights is empty"):
        flash_all_gather_matmul(x, [], group_name=fake_group)
    with pytest.raises(ValueError, match="got 1 biases for 2 weights"):
        flash_all_gather_matmul(x, [w, w], group_name=fake_group, bias=[torch.randn(4)])
    with pytest.raises(ValueError, match=r"chunks=0: expected an int >= 1"):
        sliced_all_gather_matmul(x, [w], group_name=fake_group, chunks=0)
    # Weight gathers: layout, K mismatch, divisibility of the shard's gathered dim.
    with pytest.raises(ValueError, match=r"unknown layout 'nk'; use one of \('linear', 'kn'\)"):
        flash_all_gather_weight_matmul(w, x, group_name=fake_group, layout="nk")
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(3, 8\) but the weight's K "
                                         r"dim is 4 \(layout='linear'\)"):
        flash_all_gather_weight_matmul(w, x, group_name=fake_group)
    with pytest.raises(ValueError, match=r"w_shard has size 3 along gather_dim 0, not divisible "
                                         r"by chunks=2; pad it to 4 or use chunks=1"):
        sliced_all_gather_weight_matmul(torch.randn(3, 8), x, group_name=fake_group, chunks=2)
    with pytest.raises(ValueError, match="inputs is empty; pass at least one"):
        flash_all_gather_weight_matmul(w, [], group_name=fake_group, layout="kn")
    with pytest.raises(ValueError, match=r"peer_send=-2: expected a rank in the group"):
        start_exchange(x, x.shape, -2, 0, fake_group)
    with pytest.raises(ValueError, match="recv_shape is required"):
        start_exchange(x, None, 0, 2, fake_group)


def test_world_size_one_is_a_plain_matmul(fake_group):
    single = dist.new_group([1]).group_name  # this process (rank 1) alone
    x = torch.randint(-3, 4, (4, 3, 8)).double()
    w, b = torch.randint(-3, 4, (8, 6)).double(), torch.randint(-3, 4, (6,)).double()
    expected = torch.matmul(x, w) + b
    for fn in (flash_all_gather_matmul, sliced_all_gather_matmul):
        gathered, (y,) = fn(x, [w], group_name=single, bias=[b], return_gathered=True)
        assert gathered is x and torch.equal(y, expected)
    for fn in (flash_all_gather_weight_matmul, sliced_all_gather_weight_matmul):
        gathered, (y,) = fn(w.t(), x, group_name=single, bias=b, return_gathered=True)
        assert torch.equal(gathered, w.t()) and torch.equal(y, expected)
    for variant in ("ring", "direct"):
        y = flash_matmul_reduce_scatter(x, w, group_name=single, variant=variant, bias=b)
        assert torch.equal(y, expected)
    assert torch.equal(sliced_matmul_reduce_scatter(x, w, group_name=single, bias=b), expected)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_ops_trace_with_fake_tensors_and_overlap_compute(fake_group):
    """make_fx with fake tensors: the schedule is P2P nodes interleaved with the matmuls, and
    dead-code elimination keeps it."""
    def ag(x, wq, wk):
        return flash_all_gather_matmul(x, [wq, wk], group_name=fake_group, chunks_per_rank=2)[1]

    gm = make_fx(ag, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 3),
                                          torch.randn(8, 3))
    gm.graph.eliminate_dead_code()
    targets = _targets(gm)
    assert targets.count(P2P_START) == targets.count(P2P_WAIT) == 3 * 2  # (N-1) * m hops
    assert targets.count(torch.ops.aten.mm.default) == 4 * 2 * 2  # N * m slices x 2 weights
    # Step 0 posts its hop before its own slice's matmuls, and waits only after them.
    first_start, first_mm = targets.index(P2P_START), targets.index(torch.ops.aten.mm.default)
    assert first_start < first_mm < targets.index(P2P_WAIT)
    _assert_overlapped_compute_precedes_wait(gm)

    def rs(h, w):
        return flash_matmul_reduce_scatter(h, w, group_name=fake_group, scatter_dim=1)

    gm = make_fx(rs, tracing_mode="fake")(torch.randn(2, 8, 8), torch.randn(8, 6))
    gm.graph.eliminate_dead_code()
    targets = _targets(gm)
    assert targets.count(P2P_START) == 3 and targets.count(torch.ops.aten.mm.default) == 4

    def direct(h, w):
        return flash_matmul_reduce_scatter(h, w, group_name=fake_group, variant="direct",
                                           chunks_per_rank=2)

    gm_direct = make_fx(direct, tracing_mode="fake")(torch.randn(16, 8), torch.randn(8, 6))
    gm_direct.graph.eliminate_dead_code()
    assert _targets(gm_direct).count(P2P_WAIT) == 3 * 2
    _assert_overlapped_compute_precedes_wait(gm_direct)
    # The hop of step i's sum is in flight while step i+1 computes its partial.
    starts = [i for i, t in enumerate(targets) if t == P2P_START]
    waits = [i for i, t in enumerate(targets) if t == P2P_WAIT]
    mms = [i for i, t in enumerate(targets) if t == torch.ops.aten.mm.default]
    assert all(any(s < q < w for q in mms) for s, w in zip(starts, waits))
    _assert_overlapped_compute_precedes_wait(gm)


def _ancestors(node):
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _assert_overlapped_compute_precedes_wait(gm):
    """Every matmul placed between a p2p_start and its p2p_wait is an input of the wait (its
    ``after`` list), so no scheduler can move that compute behind the wait."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    waits = [n for n in nodes if n.target == P2P_WAIT]
    assert waits
    for wait in waits:
        start = wait.args[0]
        between = nodes[nodes.index(start) + 1:nodes.index(wait)]
        mms = [n for n in between if n.target == torch.ops.aten.mm.default]
        assert mms and set(mms) <= _ancestors(wait), wait.format_node()


def test_send_only_exchanges_survive_dce(fake_group):
    def fn(x):
        start_exchange(x, None, 2, -1, fake_group)  # result never read
        wait_exchange(start_exchange(x, None, 3, -1, fake_group))  # waited, result unused
        probe(x, 0, -1, fake_group)  # a probe that receives nothing
        return x + 1

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 8))
    gm.graph.eliminate_dead_code()
    targets = _targets(gm)
    assert targets.count(P2P_START) == 2 and targets.count(P2P_WAIT) == 1
    assert targets.count(P2P_PROBE) == 1


# ---------------------------------------------------------------------------------------------
# gloo, 2 and 4 processes


def _int64(shape, gen):
    """Small integers in float64: every summation order gives the same (exact) result."""
    return torch.randint(-3, 4, shape, generator=gen).double()


def _inputs(kind, shape, gen):
    if kind == "f64":
        return _int64(shape, gen)
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def _ref_all_gather(x, d, n):
    out = torch.empty((n * x.size(d), *x.movedim(d, 0).shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.movedim(d, 0).contiguous())
    return out.movedim(0, d)


def _ref_reduce_scatter(full, d, n):
    src = full.movedim(d, 0).contiguous()
    out = torch.empty((src.size(0) // n, *src.shape[1:]), dtype=full.dtype)
    dist.reduce_scatter_tensor(out, src)
    return out.movedim(0, d)


def _mm_ref(x, w, b):
    """What the graph being replaced computes: mm / addmm on the rows of x."""
    x2 = x.reshape(-1, x.size(-1))
    y = torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
    return y.reshape(*x.shape[:-1], w.size(1))


def _compare(got, ref, exact):
    """(ok, detail): bitwise equal if ``exact``, else within the float32 reduction tolerance of
    the module docstring of flash_schedules (rtol=1e-5, atol=1e-5)."""
    if got.shape != ref.shape:
        return False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    diff = (got - ref).abs().max().item() if got.numel() else 0.0
    detail = f"max abs diff {diff}, bitwise {torch.equal(got, ref)}"
    if exact:
        return torch.equal(got, ref), detail
    try:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return True, detail
    except AssertionError as e:
        return False, str(e)


def _leftovers():
    from torch._C._distributed_c10d import _get_work_registry_size

    return pending_exchanges(), _get_work_registry_size()


def _run_cases(rank, n, group_name, results):
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard / weight shard

    def record(category, name, ok, detail):
        left = _leftovers()
        if left != (0, 0):
            ok, detail = False, f"{detail}; left behind (pending, registry) = {left}"
        results.setdefault(category, {})[name] = {"ok": bool(ok), "detail": detail}

    for kind in ("f64", "f32"):
        for d in (0, 1):
            shape = (4, 3, 32) if d == 0 else (2, 4, 32)
            x = _inputs(kind, shape, torch.Generator().manual_seed(7 + rank))
            weights = [_inputs(kind, (32, q), torch.Generator().manual_seed(q))
                       for q in (8, 4, 6)]  # replicated: the same on every rank
            biases = [_inputs(kind, (8,), torch.Generator().manual_seed(1)), None,
                      _inputs(kind, (6,), torch.Generator().manual_seed(2))]
            full = _ref_all_gather(x, d, n)
            refs = [_mm_ref(full, w, b) for w, b in zip(weights, biases)]
            for m in (1, 2):
                for scheme, fn, kw in (("flash", flash_all_gather_matmul, "chunks_per_rank"),
                                       ("sliced", sliced_all_gather_matmul, "chunks")):
                    name = f"{scheme} {kind} gather_dim={d} {kw}={m}"
                    gathered, ys = fn(x, weights, group_name=group_name, gather_dim=d,
                                      bias=biases, return_gathered=True, **{kw: m})
                    # All-gather paths are bitwise: the same mm on the same rows, and data
                    # movement for the gathered X.
                    oks = [_compare(gathered, full, True)]
                    oks += [_compare(y, r, True) for y, r in zip(ys, refs)]
                    record(f"ag {scheme}", name, all(o for o, _ in oks),
                           "; ".join(t for _, t in oks))
            none, ys = flash_all_gather_matmul(x, weights[0], group_name=group_name,
                                               gather_dim=d)
            record("ag flash", f"flash {kind} gather_dim={d} single weight, no gathered",
                   none is None and len(ys) == 1, "")

        for layout in ("linear", "kn"):
            # FSDP-style: each rank holds a shard of the weight, inputs differ per rank.
            d = 0 if layout == "linear" else 1
            w_shard = _inputs(kind, (4, 16) if d == 0 else (16, 4), gen)
            xs = [_inputs(kind, (3, 5, 16), gen), _inputs(kind, (6, 16), gen)]
            biases = [_inputs(kind, (4 * n,), torch.Generator().manual_seed(3)), None]
            full = _ref_all_gather(w_shard, d, n)
            b_mat = full.t() if layout == "linear" else full
            refs = [_mm_ref(x, b_mat, b) for x, b in zip(xs, biases)]
            for m in (1, 2):
                for scheme, fn, kw in (("flash", flash_all_gather_weight_matmul,
                                        "chunks_per_rank"),
                                       ("sliced", sliced_all_gather_weight_matmul, "chunks")):
                    gathered, ys = fn(w_shard, xs, group_name=group_name, layout=layout,
                                      bias=biases, return_gathered=True, **{kw: m})
                    # Slicing the weight's output columns may change the BLAS blocking: exact
                    # for integer values, float32 within tolerance.
                    oks = [_compare(gathered, full, True)]
                    oks += [_compare(y, r, kind == "f64") for y, r in zip(ys, refs)]
                    record(f"ag weight {scheme}", f"{scheme} {kind} layout={layout} {kw}={m}",
                           all(o for o, _ in oks), "; ".join(t for _, t in oks))

        for d in (0, 1, 2):
            h = _inputs(kind, (2 * n, 2 * n, 32), gen)
            w = _inputs(kind, (32, 4 * n), gen)  # row-parallel: a different shard per rank
            for with_bias in (False, True):
                b = _inputs(kind, (4 * n,), gen) if with_bias else None
                ref = _ref_reduce_scatter(_mm_ref(h, w, b), d, n)
                exact = kind == "f64"  # integer values: every summation order is exact
                for m in (1, 2):
                    for variant in ("ring", "direct"):
                        got = flash_matmul_reduce_scatter(h, w, group_name=group_name,
                                                          scatter_dim=d, variant=variant,
                                                          chunks_per_rank=m, bias=b)
                        record("rs flash", f"{variant} {kind} scatter_dim={d} m={m} "
                               f"bias={with_bias}", *_compare(got, ref, exact))
                    got = sliced_matmul_reduce_scatter(h, w, group_name=group_name,
                                                       scatter_dim=d, chunks=m, bias=b)
                    record("rs sliced", f"sliced {kind} scatter_dim={d} chunks={m} "
                           f"bias={with_bias}", *_compare(got, ref, exact))


def _run_compiled(rank, n, group_name, results):
    """The schedules under torch.compile(aot_eager, fullgraph): same values as eager, and the
    P2P ops are nodes of the AOT forward graph."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    def step(x, wq, wk, w2, b2):
        _, (q, k) = flash_all_gather_matmul(x, [wq, wk], group_name=group_name, gather_dim=1,
                                            chunks_per_rank=2)
        h = torch.relu(q)
        ring = flash_matmul_reduce_scatter(h, w2, group_name=group_name, scatter_dim=1,
                                           bias=b2)
        direct = flash_matmul_reduce_scatter(h, w2, group_name=group_name, scatter_dim=1,
                                             variant="direct")
        _, (qs,) = sliced_all_gather_matmul(x, [wq], group_name=group_name, gather_dim=1)
        back = wait_exchange(start_exchange(k, k.shape, (rank + 1) % n, (rank - 1) % n,
                                            group_name, tag=99))
        return ring, direct, qs, back

    gen = torch.Generator().manual_seed(rank)
    args = (torch.randn(4, 6, 16, generator=gen), torch.randn(16, 8, generator=gen),
            torch.randn(16, 5, generator=gen), torch.randn(8, 16, generator=gen),
            torch.randn(16, generator=gen))
    eager = step(*args)
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep), fullgraph=True)
    got = compiled(*args)
    targets = [nd.target for nd in graphs[0].graph.nodes] if len(graphs) == 1 else []
    counts = {str(op): targets.count(op) for op in (P2P_START, P2P_WAIT)}
    same = [torch.equal(a, b) for a, b in zip(eager, got)]
    # m=2 AG: (N-1)*2 hops; ring RS and direct RS: N-1 each; one exchange of k.
    expected = {str(P2P_START): 4 * (n - 1) + 1, str(P2P_WAIT): 4 * (n - 1) + 1}
    ok = all(same) and counts == expected and _leftovers() == (0, 0)
    results["compiled"] = {"aot_eager fullgraph": {
        "ok": ok, "detail": f"equal={same} graphs={len(graphs)} counts={counts} "
                            f"expected={expected} left={_leftovers()}"}}


def _worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    results = {}
    try:
        group_name = dist.group.WORLD.group_name
        _run_cases(rank, world_size, group_name, results)
        if world_size == 2:
            _run_compiled(rank, world_size, group_name, results)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def gloo_run(request, tmp_path_factory):
    n = request.param
    tmp = tmp_path_factory.mktemp(f"flash{n}")
    spawn(_worker, args=(n, str(tmp / "init"), str(tmp)), nprocs=n, join=True)
    return n, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(n)]


def _check(gloo_run, category, count):
    n, per_rank = gloo_run
    for rank, results in enumerate(per_rank):
        cases = results.get(category, {})
        assert len(cases) == count, (rank, sorted(cases))
        failed = {k: v["detail"] for k, v in cases.items() if not v["ok"]}
        assert not failed, f"rank {rank} of {n}: {failed}"


def test_flash_all_gather_matmul_equals_all_gather_then_matmul(gloo_run):
    # f64/f32 x gather_dim 0/1 x chunks_per_rank 1/2, three weights, + single-weight calls
    _check(gloo_run, "ag flash", 2 * 2 * 2 + 2 * 2)


def test_sliced_all_gather_matmul_equals_all_gather_then_matmul(gloo_run):
    _check(gloo_run, "ag sliced", 2 * 2 * 2)


def test_weight_all_gather_matmul_equals_all_gather_then_matmul(gloo_run):
    # f64/f32 x layout linear/kn x chunks 1/2, two inputs (one with bias), flash and sliced
    _check(gloo_run, "ag weight flash", 2 * 2 * 2)
    _check(gloo_run, "ag weight sliced", 2 * 2 * 2)


def test_flash_matmul_reduce_scatter_equals_matmul_then_reduce_scatter(gloo_run):
    # f64/f32 x scatter_dim 0/1/2 x bias x chunks_per_rank 1/2 x ring/direct
    _check(gloo_run, "rs flash", 2 * 3 * 2 * 2 * 2)


def test_sliced_matmul_reduce_scatter_equals_matmul_then_reduce_scatter(gloo_run):
    _check(gloo_run, "rs sliced", 2 * 3 * 2 * 2)


@pytest.mark.parametrize("gloo_run", [2], indirect=True, ids=["2ranks"])
def test_compiled_aot_eager_fullgraph_equals_eager(gloo_run):
    _check(gloo_run, "compiled", 1)  # run by the 2-rank job only (compile time)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_attention_slices_are_the_whole_attentions_rows_bitwise(dtype):
    """``AttentionRows`` (the query-split attention inside a reduce-scatter schedule): each
    causal slice of queries, handed the whole attention's blocks of keys with its rows of the
    mask (``slice_keys``), gives exactly the whole attention's rows, output and log-sum-exp, on
    torch's CPU kernel. Handed only the keys its span reaches (the earlier form), a row differs
    at most of these lengths: the kernel's blocking and vector reductions follow the key count
    (found measuring the bf16 split on torchtitan's Llama3). Lengths below, at and above one
    key block (512)."""
    from leancompile.runtime.attention_rows import KEY_BLOCK, AttentionRows, slice_keys

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert (slice_keys(8, 16), slice_keys(600, 1536), slice_keys(1100, 1536)) == (
        16, 2 * KEY_BLOCK, 1536)
    torch.manual_seed(0)
    for seq in (16, 48, 100, 600, 1536):
        q, k, v = (torch.randn(1, 2, seq, 16).to(dtype) for _ in range(3))
        whole = op(q, k, v, 0.0, True)
        for n in (2, 4):
            # the rows along dim 2 of the attention's output itself (no layout chain)
            rows = AttentionRows(op, q, k, v, (0.0, True), {}, lambda out, ql: out, q.shape, 2,
                                 causal=True)
            length = seq // n
            for i in range(n):
                start = i * length
                assert torch.equal(rows.narrow(2, start, length),
                                   whole[0][:, :, start:start + length]), (seq, n, i)
            # what the backward saves: the output and the log-sum-exp, put together
            out, lse = rows.assembled(whole[:2])
            assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1]), (seq, n)
