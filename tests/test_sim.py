"""The simulator (``leancompile/sim``): node costs against the roofline and alpha-beta formulas
computed by hand, the overlap schemes on the FlashOverlap paper's case (TP=4, (32, 4096, 4096),
forward, H200) traced at full size on the meta device, device profiles, traces and the CLI."""

import dataclasses
import json
import operator
import warnings

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from leancompile.cli import main as cli
from leancompile.sim import DeviceProfile, device_names, device_profile, node_cost, simulate
from leancompile.sim.fullscale import fake_group, rewrite, tp_attention, trace_graphs
from leancompile.sim.schemes import simulate_schemes
from ranks import spawn

# Round numbers, so that every expected time below is arithmetic.
TOY = DeviceProfile(name="toy", flops={"float32": 1e12}, memory_bandwidth=1e11,
                    link_bandwidth=1e10, link_latency=1e-5, memory_bytes=2**34,
                    kernel_overhead=1e-6, matmul_efficiency=0.5, matmul_overhead=2e-6)


def test_node_costs_are_the_roofline_and_alpha_beta_formulas(tmp_path):
    def f(x, w):
        g = funcol.all_gather_tensor(x, 0, "0")
        return torch.relu(g @ w)

    with fake_group(4):
        x = torch.empty(256, 512, device="meta")
        w = torch.empty(512, 1024, device="meta")
        gm = trace_graphs(f, x, w, backward=False)["forward"]
        costs = {n.name: node_cost(n, TOY) for n in gm.graph.nodes if n.op == "call_function"}
        timeline = simulate(gm, TOY)
    # all-gather of 4 shards of 256 x 512 fp32: 3 ring hops of 512 KiB.
    shard = 256 * 512 * 4
    assert costs["all_gather_into_tensor"][:2] == ("comm", pytest.approx(3 * (1e-5 + shard / 1e10)))
    # mm (1024 x 512) @ (512 x 1024): 2 * 1024 * 512 * 1024 FLOPs at 0.5 * 1e12, + 2 us
    flops = 2 * 1024 * 512 * 1024
    stream, seconds, counted, nbytes = costs["mm"]
    assert (stream, counted) == ("compute", flops)
    assert nbytes == (1024 * 512 + 512 * 1024 + 1024 * 1024) * 4
    assert seconds == pytest.approx(max(2e-6 + flops / 0.5e12, nbytes / 1e11) + 1e-6)
    # relu: memory bound, read + write of 4 MiB
    assert costs["relu"][1] == pytest.approx(2 * 1024 * 1024 * 4 / 1e11 + 1e-6)
    assert costs["wait_tensor"][0] == "wait"
    # A collective's ring step may have its own fixed time (gloo's ring against our P2P
    # exchange); a P2P message keeps link_latency.
    ring = dataclasses.replace(TOY, collective_latency=4e-5)
    assert ring.ring_step_latency == 4e-5 and TOY.ring_step_latency == TOY.link_latency
    gather_node = next(n for n in gm.graph.nodes if n.name == "all_gather_into_tensor")
    assert node_cost(gather_node, ring)[1] == pytest.approx(3 * (4e-5 + shard / 1e10))
    (tmp_path / "ring.json").write_text(ring.to_json())
    assert DeviceProfile.from_json(tmp_path / "ring.json").collective_latency == 4e-5
    with pytest.raises(ValueError, match="latencies must be >= 0"):
        dataclasses.replace(TOY, collective_latency=-1e-6)
    # Sequential: the matmul waits for the whole gather, which is all exposed.
    gather = costs["all_gather_into_tensor"][1]
    assert timeline.exposed_comm_s == pytest.approx(gather)
    assert timeline.total_s == pytest.approx(gather + seconds + costs["relu"][1])
    assert timeline.compute_s == pytest.approx(seconds + costs["relu"][1])
    # Peak at the relu: the inputs (x, w), the mm output and the relu output (the gathered x
    # was last read by the mm).
    live = (256 * 512 + 512 * 1024 + 2 * 1024 * 1024) * 4
    assert timeline.peak_memory_bytes == live


@pytest.fixture(scope="module")
def paper_case():
    return simulate_schemes(device="h200", tp=4, shape=(32, 4096, 4096), slices=(2, 4, 8))


def test_paper_case_flash_hides_the_communication_and_slicing_leaves_m_over_k(paper_case):
    schemes = paper_case["schemes"]
    sequential = schemes["sequential"]["exposed_comm_s"]
    assert sequential > 0 and schemes["sequential"]["rewritten"] == 0
    # On H200 a hop (3 x 64 MiB of bf16 over 450 GB/s) is shorter than a slice's matmul.
    assert schemes["flash"]["exposed_comm_s"] <= 0.01 * sequential
    assert schemes["flash"]["rewritten"] == 2  # the all-gather and the reduce-scatter
    for k in (2, 4, 8):
        exposed = schemes[f"slice_{k}"]["exposed_comm_s"]
        assert 0.9 * sequential / k <= exposed <= 1.2 * sequential / k, (k, exposed)
    assert schemes["flash"]["total_s"] < schemes["slice_8"]["total_s"] < \
        schemes["sequential"]["total_s"]
    assert schemes["async_tp"]["available"]


def test_slow_links_expose_what_compute_cannot_hide_and_async_tp_needs_symmetric_memory():
    report = simulate_schemes(device="a6000", tp=4, shape=(8, 1024, 1024), slices=(2,))
    schemes = report["schemes"]
    assert not schemes["async_tp"]["available"]
    assert "symmetric memory" in schemes["async_tp"]["reason"]
    assert 0 < schemes["flash"]["exposed_comm_s"] < schemes["sequential"]["exposed_comm_s"]


def _gather_beside_a_matmul(overlap: float, beside: bool, *, side: int = 1024,
                            coalesced: bool = False):
    """all-gather(x) ; y @ v ; wait ; relu(g @ w) on TOY with ``comm_compute_overlap``:
    ``beside`` moves the independent ``side``-square matmul in front of the wait (compute
    issued while the transfer is in flight), else the wait follows the gather as traced;
    ``coalesced``: the gather is a coalesced one, waited through a getitem."""
    def f(x, w, y, v):
        if coalesced:
            g = funcol.all_gather_into_tensor_coalesced([x], "0")[0]
        else:
            g = funcol.all_gather_tensor(x, 0, "0")
        return torch.relu(g @ w), y @ v

    profile = dataclasses.replace(TOY, comm_compute_overlap=overlap)
    with fake_group(4):
        gm = trace_graphs(f, torch.empty(256, 512, device="meta"),
                          torch.empty(512, 1024, device="meta"),
                          torch.empty(side, side, device="meta"),
                          torch.empty(side, side, device="meta"), backward=False)["forward"]
        nodes = {n.name: n for n in gm.graph.nodes}
        wait, independent = nodes["wait_tensor"], nodes["mm_1"]
        assert independent.args[0].op == "placeholder"  # y @ v
        assert (wait.args[0].target is operator.getitem) == coalesced
        if beside:
            wait.prepend(independent)
        costs = {n.name: node_cost(n, profile)[1] for n in gm.graph.nodes
                 if n.op == "call_function"}
        return simulate(gm, profile), costs


@pytest.mark.parametrize("side,coalesced", [(1024, False), (128, False), (1024, True)])
def test_interference_of_a_transfer_and_the_compute_beside_it(side, coalesced):
    """``comm_compute_overlap < 0`` (cores oversubscribed): a transfer with compute issued
    beside it costs ``-overlap x min(transfer, that compute)`` more (the compute the longer
    one, or the shorter; a wait through a getitem too); one waited at once costs what it did
    at overlap 0."""
    for beside in (False, True):
        base, costs = _gather_beside_a_matmul(0.0, beside, side=side, coalesced=coalesced)
        slow, _ = _gather_beside_a_matmul(-0.5, beside, side=side, coalesced=coalesced)
        gather = next(v for k, v in costs.items() if k.startswith("all_gather"))
        compute = costs["mm"] + costs["mm_1"] + costs["relu"]
        # overlap 0: the transfer holds the compute stream for all of its time
        assert base.total_s == pytest.approx(gather + compute)
        extra = 0.5 * min(gather, costs["mm_1"]) if beside else 0.0
        assert slow.total_s == pytest.approx(base.total_s + extra)
        assert any("(interference)" in s.op for s in slow.spans) == beside
    assert (costs["mm_1"] < gather) == (side == 128)  # both sides of the min are exercised
    with pytest.raises(ValueError, match=r"comm_compute_overlap=-1.5 must be in \[-1, 1\]"):
        dataclasses.replace(TOY, comm_compute_overlap=-1.5)


def test_workload_lists_the_graphs_matmuls_activation_and_message():
    from leancompile.sim.calibrate import workload

    def f(x, w):
        g = funcol.all_gather_tensor(x, 0, "0")
        return torch.nn.functional.gelu(g @ w)

    with fake_group(4):
        gm = trace_graphs(f, torch.empty(256, 512, device="meta", requires_grad=True),
                          torch.empty(512, 1024, device="meta", requires_grad=True))
    load = workload([gm["forward"], gm["backward"]])
    # forward (1024 x 512) @ (512 x 1024); backward: the weight's and the input's gradients;
    # each once
    assert sorted(load["matmuls"]) == [(512, 1024, 1024), (1024, 512, 1024), (1024, 1024, 512)]
    assert load["activation"] == 1024 * 1024  # gelu's output (and its gradient's)
    assert load["message"] == 256 * 512  # one shard of the gather


def test_profiles_load_and_cite_their_numbers(tmp_path):
    names = device_names()
    assert {"h200", "h100", "a100", "a6000", "ib-ndr", "ascend-910b"} <= set(names)
    for name in names:
        profile = device_profile(name)
        assert {"flops", "memory_bandwidth", "link_bandwidth"} <= set(profile.sources), name
    h200 = device_profile("h200")
    assert h200.peak_flops(torch.bfloat16) == 989.5e12 and h200.symmetric_memory
    mine = dataclasses.replace(h200, name="mine", link_bandwidth=25e9)
    path = tmp_path / "mine.json"
    path.write_text(mine.to_json())
    assert device_profile(str(path)) == mine
    path.write_text(json.dumps({**json.loads(mine.to_json()), "nvlink": 1}))
    with pytest.raises(ValueError, match=r"unknown device profile field\(s\) \['nvlink'\]"):
        device_profile(str(path))
    with pytest.raises(ValueError, match="not a built-in profile"):
        device_profile("tpu-v9")
    with pytest.raises(ValueError, match="memory_bandwidth=0"):
        dataclasses.replace(h200, memory_bandwidth=0)


def test_chrome_trace_of_a_timeline(tmp_path):
    with fake_group(2):
        gm = trace_graphs(lambda x: funcol.all_gather_tensor(x, 0, "0") * 2,
                          torch.empty(8, 8, device="meta"), backward=False)["forward"]
        trace = simulate(gm, "h100").to_chrome_trace()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"compute", "comm", "wait"}
    assert all(e["dur"] >= 0 and "node" in e["args"] for e in spans)


def test_bench_overlap_simulate_cli_json(capsys):
    assert cli(["bench", "overlap", "--simulate", "--device", "h200", "--tp", "2",
                "--shape", "2,256,256", "--slices", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["schemes"]) == {"sequential", "slice_2", "async_tp", "flash", "direct"}
    for entry in report["schemes"].values():
        assert {"total_s", "compute_s", "exposed_comm_s"} <= set(entry)


def test_a_2d_mesh_rewrites_every_tp_site_and_leaves_the_weight_gathers_with_reasons():
    """SimpleFSDP x TP+SP: each projection of a Llama block reads an FSDP weight gather (dp)
    and a TP activation gather or feeds a TP reduce-scatter (tp); the pass takes the TP side of
    every projection (the output and down projections' reduce-scatters over their weight
    gathers) and leaves each weight gather with its reason; the backward rewrites all."""
    from leancompile.sim.fullscale import fake_mesh, llama_2d_block
    from leancompile.sim.graph_facts import group_name

    with fake_mesh(2, 2) as (dp, tp):
        graphs = llama_2d_block(2, 2, (2, 64, 256), dtype=torch.float32, backward=True,
                                dp_group=dp, tp_group=tp)
        axes = {dp.group_name: "dp", tp.group_name: "tp"}
        done = {}
        for phase, gm in graphs.items():
            nodes = {n.name: n for n in gm.graph.nodes}
            _, record = rewrite(gm, phase, overlap="flash")
            result, = [p for p in record.passes if p.name == "flash_overlap"]
            done[phase] = (
                sorted((axes[group_name(nodes[x.node])], x.kind) for x in result.rewritten),
                sorted((axes[group_name(nodes[x.node])], x.reason) for x in result.skipped))
    rewritten, skipped = done["forward"]
    assert rewritten == [("tp", "all_gather+mm")] * 2 + [("tp", "mm+reduce_scatter")] * 2
    assert [axis for axis, _ in skipped] == ["dp"] * 4
    assert sum("also reads the all-gather" in r for _, r in skipped) == 2  # QKV, gate/up
    assert sum("is reduce-scattered at" in r and "over another group (2 ranks)" in r
               for _, r in skipped) == 2  # output and down projections
    rewritten, skipped = done["backward"]
    assert skipped == [] and ("tp", "mm+reduce_scatter") in rewritten and \
        ("dp", "mm+reduce_scatter") in rewritten


@pytest.mark.parametrize("how", ["turned off", "failed"])
def test_a_2d_mesh_reduce_scatter_that_is_not_rewritten_leaves_the_matmul_to_its_weight_gather(
        how, monkeypatch):
    """An attack on the choice above, in bf16: the output projection's TP reduce-scatter
    turned off by ``overlap_sites``, or its rewrite raising once (the safety net's retry):
    its FSDP weight gather is rewritten instead, not both left as collectives."""
    import leancompile.passes.flash.driver as driver
    from leancompile.sim.fullscale import fake_mesh, llama_2d_block
    from leancompile.sim.graph_facts import group_name

    with fake_mesh(2, 2) as (dp, tp):
        gm = llama_2d_block(2, 2, (2, 64, 256), backward=False, dp_group=dp,
                            tp_group=tp)["forward"]
        axes = {dp.group_name: "dp", tp.group_name: "tp"}
        nodes = {n.name: n for n in gm.graph.nodes}
        first_rs = next(n.name for n in gm.graph.nodes
                        if "reduce_scatter_tensor" in str(n.target))
        options = {"overlap": "flash"}
        if how == "turned off":
            options["overlap_sites"] = {first_rs: "none"}
        else:
            monkeypatch.delenv("LEANCOMPILE_ON_ERROR", raising=False)
            original = driver.rewrite_reduce_scatter

            def fail_first(gm, match, **kw):
                if match.reduce_scatter.name == first_rs:
                    raise RuntimeError("injected")
                return original(gm, match, **kw)

            monkeypatch.setattr(driver, "rewrite_reduce_scatter", fail_first)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, record = rewrite(gm, "forward", **options)
        result, = [p for p in record.passes if p.name == "flash_overlap"]
    rewritten = sorted((axes[group_name(nodes[x.node])], x.kind) for x in result.rewritten)
    # the other projection's reduce-scatter still wins over its weight gather; this one's
    # weight gather takes the matmul
    assert rewritten == [("dp", "all_gather+mm")] + [("tp", "all_gather+mm")] * 2 + \
        [("tp", "mm+reduce_scatter")], result
    # left with a reason (turned off: that; failed: the retry's, the raise in a warning)
    assert first_rs in {x.node for x in result.skipped}, result
    raised = [str(w.message) for w in caught if f"the site at {first_rs} raised" in
              str(w.message)]
    assert bool(raised) == (how == "failed"), raised


def test_bench_overlap_simulates_a_llama_block_on_a_2d_mesh(capsys):
    assert cli(["bench", "overlap", "--simulate", "--case", "llama-2d", "--device", "h200",
                "--dp", "2", "--tp", "2", "--shape", "2,1024,1024", "--slices", "2",
                "--backward", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["dp"] == 2 and report["config"]["case"] == "llama-2d"
    seq, flash = report["schemes"]["sequential"], report["schemes"]["flash"]
    assert seq["exposed_by_axis"]["tp"] > 0 and seq["rewritten"] == 0
    assert flash["exposed_by_axis"]["tp"] < 0.5 * seq["exposed_by_axis"]["tp"]
    assert {(s["phase"], s["axis"]) for s in flash["sites"] if s["rewritten"]} >= {
        ("forward", "tp"), ("backward", "tp"), ("backward", "dp")}
    assert all(s["reason"] for s in flash["sites"] if not s["rewritten"])
    assert cli(["bench", "overlap", "--simulate", "--case", "llama-2d", "--dp", "2", "--tp",
                "2", "--shape", "2,1024,1024", "--slices", "2"]) == 0
    out = capsys.readouterr().out
    assert "a 2 x 2 (dp x tp) mesh" in out and "exposed per axis" in out and "left: " in out
    with pytest.raises(SystemExit):  # --dp belongs to the 2-D case
        cli(["bench", "overlap", "--simulate", "--dp", "2"])
    assert cli(["bench", "overlap", "--simulate", "--case", "llama-2d", "--dp", "3", "--tp",
                "2", "--shape", "2,1024,1024"]) == 2
    assert "must divide by dp=3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dp="):
        simulate_schemes(case="llama-2d", tp=2, shape=(2, 256, 256))


# ----------------------------------------------------------------------------------------------
# Strict mode


def _mlp_block(group):
    def block(x, w1, w2):
        g = funcol.all_gather_tensor(x, 0, group)
        return funcol.reduce_scatter_tensor(torch.relu(g @ w1) @ w2, "sum", 0, group)
    return block


def test_strict_passes_a_fully_rewritten_graph_and_names_every_collective_left():
    import leancompile

    def leftovers(x, w):
        g = funcol.all_gather_tensor(x, 0, "0")          # read by a relu, no matmul
        s = funcol.all_reduce(x @ w, "sum", "0")          # no pass rewrites all-reduces
        return torch.relu(g).sum() + s.sum()

    with fake_group(4):
        graphs = trace_graphs(_mlp_block("0"), torch.empty(16, 8, device="meta"),
                              torch.empty(8, 16, device="meta"),
                              torch.empty(16, 8, device="meta"), backward=False)
        gm, record = rewrite(graphs["forward"], "forward", overlap="flash", strict=True)
        assert not any("_c10d_functional" in str(n.target) for n in gm.graph.nodes)
        bad = trace_graphs(leftovers, torch.empty(16, 8, device="meta"),
                           torch.empty(8, 8, device="meta"), backward=False)["forward"]
        rewrite(bad, "forward", overlap="flash")  # without strict: compiled as it is
        with pytest.raises(leancompile.UnrewrittenCollectiveError) as info:
            rewrite(bad, "forward", overlap="flash", strict=True)
    message = str(info.value)
    assert "keeps 2 collective(s)" in message
    assert "all_gather_into_tensor" in message and "flash_overlap: " in message
    assert "all_reduce.default is not an all-gather, reduce-scatter or all-to-all" in message
    with pytest.raises(ValueError, match="strict=True checks that the overlap pass"):
        leancompile.CompileOptions(strict=True)


def test_strict_error_reaches_the_torch_compile_caller():
    import leancompile

    def leftovers(x):
        return funcol.all_reduce(x, "sum", "0") + 1

    with fake_group(2):
        compiled = torch.compile(leftovers, backend=leancompile.backend(
            compiler="aot_eager", overlap="flash", strict=True))
        with pytest.raises(Exception, match="(?s)UnrewrittenCollectiveError.*all_reduce"):
            compiled(torch.randn(4, 4))


def test_validate_calibrates_and_compares_on_two_gloo_ranks():
    """The ``--validate`` pipeline end to end at a tiny size (its numbers are a benchmark's,
    printed by ``leancompile bench overlap --validate``, not asserted here)."""
    from leancompile.benchmarks.overlap_validate import validate

    report = validate((2,), seq=64, dim=16, hidden=32, rounds=1)
    entry = report[2]
    assert entry["profile"]["name"] == "cpu-gloo" and entry["profile"]["flops"]["float32"] > 0
    assert set(entry["schemes"]) == {"sequential", "slice_2", "flash", "direct"}
    for scheme in entry["schemes"].values():
        assert scheme["simulated_s"] > 0 and scheme["measured_s"] > 0
        assert scheme["error"] == pytest.approx(
            abs(scheme["simulated_s"] - scheme["measured_s"]) / scheme["measured_s"])


# ----------------------------------------------------------------------------------------------
# plan grpo


@pytest.fixture(scope="module")
def flux_dev_costs():
    """FLUX.1-dev at full width and depth (19 + 38 blocks, extrapolated from 1- and 2-block
    traces on the meta device), 256 px, 2 samples per rank, on the A6000 profile."""
    from leancompile.sim.plan import GRPOPlanConfig, model_costs

    cfg = GRPOPlanConfig(model="flux-dev", resolution=256, steps=16, fraction=0.6,
                         samples_per_rank=2, gpus=8, device="a6000")
    return cfg, model_costs(cfg)


def test_plan_grpo_flux_dev_reproduces_the_papers_qualitative_findings(flux_dev_costs):
    from leancompile.sim.plan import plan_grpo

    cfg, costs = flux_dev_costs
    assert 11.8e9 < costs.params < 12.0e9 and costs.trainable == costs.params  # FLUX.1-dev
    assert costs.tokens == 256 and costs.backward_s > costs.forward_s > 0
    report = plan_grpo(cfg, costs)
    schedules = report["schedules"]
    # Reweight's per-sample buffers (a full bf16 gradient, 24 GB, per sample) do not fit two
    # samples per rank on 48 GB; Retain does at 256 px, and saves the update's forward.
    assert not schedules["reweight"]["fits"]
    assert schedules["retain"]["fits"] and schedules["retain"]["speedup"] > 1.1
    assert schedules["retain"]["paper"] == "1.18-1.29x"
    assert schedules["reweight"]["paper"] == "1.44-1.81x"
    assert report["auto"] == "retain"
    # Retain's memory grows with the trained steps: one call's saved activations per step.
    half = plan_grpo(dataclasses.replace(cfg, fraction=0.5), costs)["schedules"]["retain"]
    full = plan_grpo(dataclasses.replace(cfg, fraction=1.0), costs)["schedules"]["retain"]
    assert full["memory_bytes"] - half["memory_bytes"] == pytest.approx(8 * costs.saved_bytes,
                                                                        rel=1e-6)
    # One sample per rank: Reweight's buffer fits.
    one = plan_grpo(dataclasses.replace(cfg, samples_per_rank=1), costs)
    assert one["schedules"]["reweight"]["memory_bytes"] < \
        schedules["reweight"]["memory_bytes"] - 20e9


def test_plan_grpo_cli(capsys):
    assert cli(["plan", "grpo", "--model", "sd3.5-m", "--resolution", "256", "--steps", "4",
                "--gpus", "2", "--device", "h100", "--lora", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["schedules"]) == {"recompute", "retain", "reweight"}
    assert report["costs"]["trainable"] < report["costs"]["params"] / 100  # adapters only
    assert all(e["fits"] for e in report["schedules"].values())
    assert cli(["plan", "grpo", "--model", "flux-dev", "--resolution", "250"]) == 2
    assert "multiple of 16" in capsys.readouterr().err


def test_trace_grpo_writes_chrome_traces_and_a_png(tmp_path):
    """``leancompile trace grpo``: the measured step's trace holds the trainer's phases and the
    step graphs' runs; the simulated one the predicted phases; the PNG is written."""
    from leancompile.benchmarks.trace import trace_grpo
    from leancompile.sim.plan import GRPOPlanConfig, ModelCosts, plan_grpo

    # The simulated half from given per-call costs (tracing FLUX.1-dev takes ~15 s; the
    # planner's own test does that).
    costs = ModelCosts(params=12 * 10**9, trainable=12 * 10**9, tokens=2025, inference_s=1.5,
                       forward_s=1.5, backward_s=4.0, saved_bytes=2 * 10**9,
                       call_peak_bytes=4 * 10**9)
    plan = plan_grpo(GRPOPlanConfig(model="flux-dev", steps=4), costs)
    files = trace_grpo(tmp_path, plan=plan)
    measured, simulated, png = files
    names = {e["name"] for e in json.loads(measured.read_text())["traceEvents"]
             if e.get("ph") == "X"}
    assert {"leancompile.rollout", "leancompile.reward", "leancompile.update",
            "leancompile.sync", "leancompile.optimizer", "leancompile.forward_graph",
            "leancompile.backward_graph"} <= names
    events = json.loads(simulated.read_text())["traceEvents"]
    assert {e["name"] for e in events} >= {"kept forward", "backward"}
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in events)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_trace_overlap_writes_chrome_traces_and_a_png(tmp_path):
    """``leancompile trace overlap`` at a tiny size: rank 0's profiled step holds the P2P steps
    and matmuls of the flash schedule; the simulated traces (the same graphs on ``cpu-gloo``
    calibrated in the ranks, the paper's case on H200) hold compute and communication spans;
    the PNG is written."""
    from leancompile.benchmarks.trace import trace_overlap

    measured, simulated, paper, png = trace_overlap(tmp_path, seq=64, dim=16, hidden=32)
    names = {e["name"] for e in json.loads(measured.read_text())["traceEvents"]
             if e.get("ph") == "X"}
    assert {"leancompile::p2p_start", "leancompile::p2p_wait", "aten::mm"} <= names, names
    for path in (simulated, paper):
        events = json.loads(path.read_text())["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X"]
        assert {"compute", "comm"} <= {e["cat"] for e in spans}
        assert all(e["dur"] >= 0 for e in spans)
        assert any("p2p_start" in e["name"] for e in spans)
    assert paper.name == "overlap_h200.json"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_exposure_per_collective_before_and_after_the_passes():
    """``leancompile.sim.exposure(report, device)``: each collective's predicted exposed time
    in the graphs before our passes and in the rewritten ones (the P2P steps carry the site
    they replaced); on a link so slow that no slice's compute hides a hop, some stays exposed
    and is attributed to the right site."""
    import leancompile
    from leancompile.sim import exposure

    slow = dataclasses.replace(device_profile("h100"), name="slow", link_bandwidth=1e8,
                               collective_bandwidth=1e8)
    with fake_group(4):
        report = leancompile.explain(_mlp_block("0"), torch.randn(64, 32, requires_grad=True),
                                     torch.randn(32, 64, requires_grad=True),
                                     torch.randn(64, 32, requires_grad=True),
                                     compiler="aot_eager", overlap="flash")
    rows = exposure(report, slow, world_size=4)
    forward = {r["site"]: r for r in rows if r["graph"] == "graph0_forward"}
    assert set(forward) == {"all_gather_into_tensor", "reduce_scatter_tensor", "(total)"}
    for site in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert 0 < forward[site]["after_s"] < forward[site]["before_s"], forward[site]
    total = forward["(total)"]
    assert total["before_s"] == pytest.approx(forward["all_gather_into_tensor"]["before_s"] +
                                              forward["reduce_scatter_tensor"]["before_s"])
    # (comm-bound at this speed: the decomposed schedule's extra kernels cost more than the
    # little compute it hides, so the step itself is not faster; the model says so.)
    assert total["total_after_s"] > total["total_before_s"] - total["before_s"]
    fast = {r["site"]: r for r in exposure(report, "h200") if r["graph"] == "graph0_forward"}
    assert fast["(total)"]["after_s"] <= fast["(total)"]["before_s"]


@pytest.mark.parametrize("case, world, shape", [("llama-tp", 4, (1, 2048, 1024)),
                                                ("fsdp-mlp", 4, (2, 1024, 1024))])
def test_llama_tp_and_fsdp_blocks_at_size_rewritten_and_simulated(case, world, shape):
    report = simulate_schemes(device="h200", tp=world, shape=shape, slices=(2,), case=case,
                              backward=True)
    schemes = report["schemes"]
    assert schemes["sequential"]["rewritten"] == 0 and schemes["flash"]["rewritten"] > 0
    assert schemes["flash"]["exposed_comm_s"] < schemes["sequential"]["exposed_comm_s"]


def test_overlap_auto_picks_what_the_simulator_predicts_fastest(tmp_path):
    import leancompile
    from leancompile.sim.fullscale import tp_mlp

    slow = dataclasses.replace(device_profile("h100"), name="slow", link_bandwidth=1e8,
                               collective_bandwidth=1e8, link_latency=1e-3)
    (tmp_path / "slow.json").write_text(slow.to_json())
    with fake_group(4):
        graphs = tp_mlp(4, (32, 4096, 4096))  # the FlashOverlap paper's case
        fast_gm, fast = rewrite(graphs["forward"], "forward", overlap="auto", device="h200")
        _, crawl = rewrite(graphs["forward"], "forward", overlap="auto",
                           device=str(tmp_path / "slow.json"))
    auto = fast.auto
    assert auto["device"] == "h200" and set(auto["predicted_s"]) == {
        "none", "flash", "flash direct", "flash 2 chunks per rank", "flash projection alone",
        "slice 2", "slice 4"}
    best = min(auto["predicted_s"].values())
    assert auto["predicted_s"][auto["chosen"]] <= best * 1.01
    # On NVLink a hop hides behind a slice's matmul: a flash schedule, about 20% faster.
    assert auto["chosen"].startswith("flash")
    assert auto["predicted_s"][auto["chosen"]] < 0.85 * auto["predicted_s"]["none"]
    assert any("p2p_start" in str(n.target) for n in fast_gm.graph.nodes)
    # A link so slow that compute hides little: the decomposed schedules only add kernels
    # and copies, so the graph stays as it was.
    assert crawl.auto["chosen"] == "none"
    with pytest.raises(ValueError, match="device='h200' is what overlap='auto' predicts on"):
        leancompile.CompileOptions(overlap="flash", device="h200")


def test_query_split_attention_hides_more_than_flash_rs_on_the_projection_alone():
    """A TP+SP self-attention layer at DiT size on 4 x A6000 (PCIe): Flash-RS next to the
    output projection alone has one projection slice per hop to hide the transfer behind;
    with the attention split by query each hop also hides a slice of the attention, and the
    first partial leaves after a quarter of it."""
    report = simulate_schemes(device="a6000", tp=4, shape=(2, 8192, 3072), case="attention",
                              slices=(2,))
    schemes = report["schemes"]
    split, alone = schemes["flash"], schemes["flash_projection"]
    assert split["rewritten"] == alone["rewritten"] == 2
    assert split["exposed_comm_s"] < 0.5 * alone["exposed_comm_s"], (split, alone)
    assert split["total_s"] < 0.9 * alone["total_s"] < schemes["sequential"]["total_s"]
    # A small layer on NVLink: the split's extra kernel calls cost more than what is left to
    # hide, and overlap="auto" keeps the attention whole.
    with fake_group(4):
        graphs = tp_attention(4, (1, 4096, 3072))
        _, record = rewrite(graphs["forward"], "forward", overlap="auto", device="h200")
    predicted = record.auto["predicted_s"]
    assert predicted["flash projection alone"] < predicted["flash"] < predicted["none"]
    assert record.auto["chosen"] == "flash projection alone", record.auto


def test_attention_split_leaves_a_reduce_scatter_of_the_product_columns_to_flash_rs():
    """Regression (second review): the attention's query rows as the projection's contraction
    dim, the product scattered on its columns. The slices are columns of the weight, not rows of
    the attention output: the site is Flash-RS on the projection alone (it raised before)."""
    import torch.nn.functional as F

    from leancompile.sim.fullscale import rewrite

    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    b, s, heads, hd = 2, 16, 4, 4
    with fake_group(4) as group:
        def layer(x, wqkv, wo):
            h = funcol.all_gather_tensor(x, 0, group)
            q, k, v = F.linear(h, wqkv).view(b, s, 3, 1, hd).unbind(2)
            o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0]
            att = o.permute(0, 1, 3, 2).reshape(b * hd, s)     # queries in the K dim
            return funcol.reduce_scatter_tensor(F.linear(att, wo), "sum", 1, group)

        graphs = trace_graphs(layer, torch.empty(b * s // 4, heads * hd, device="meta"),
                              torch.empty(3 * hd, heads * hd, device="meta"),
                              torch.empty(heads * hd, s, device="meta"), backward=False)
        _, record = rewrite(graphs["forward"], "forward", overlap="flash")
    (result,) = [p for p in record.passes if p.name == "flash_overlap"]
    assert sorted(site.kind for site in result.rewritten) == ["all_gather+mm",
                                                              "mm+reduce_scatter"]


def test_overlap_auto_chooses_per_site_when_that_is_predicted_faster():
    """A wide all-gather feeding a large matmul and a narrow reduce-scatter after a small one
    (the MLP's hidden size below its model size): on H200 the gather hides behind its matmul,
    while decomposing the reduce-scatter costs more kernels than the little compute it could
    hide. No single setting is best for both; the per-site plan is."""
    import leancompile
    from leancompile.sim.fullscale import tp_mlp

    with fake_group(4):
        graphs = tp_mlp(4, (4, 512, 8192), hidden=1024)
        gm, record = rewrite(graphs["forward"], "forward", overlap="auto", device="h200",
                             strict=True)
        pinned, pinned_record = rewrite(graphs["forward"], "forward", overlap="flash",
                                        overlap_sites=record.auto["sites"], strict=True)
    auto = record.auto
    assert auto["chosen"] == "per site", auto
    assert auto["sites"] == {"all_gather_into_tensor": "flash",
                             "reduce_scatter_tensor": "none"}, auto
    uniform = {k: v for k, v in auto["predicted_s"].items() if k != "per site"}
    assert auto["predicted_s"]["per site"] < 0.99 * min(uniform.values()), auto
    targets = [str(n.target) for n in gm.graph.nodes]
    assert any("p2p_start" in t for t in targets)
    assert sum("reduce_scatter_tensor" in t for t in targets) == 1  # kept, and strict allows it
    (site,) = [s for p in record.passes for s in p.skipped if s.node == "reduce_scatter_tensor"]
    assert site.reason == leancompile.passes.flash_overlap.AUTO_KEPT_REASON
    assert "overlap='auto' on h200: per site" in record.summary()
    assert "reduce_scatter_tensor: none" in record.summary()
    # The plan, pinned with overlap_sites=, gives the same graph.
    assert str(pinned.code) == str(gm.code)
    with pytest.raises(ValueError, match="each site takes one of"):
        leancompile.CompileOptions(overlap="flash", overlap_sites={"x": "ring"})
    with pytest.raises(ValueError, match="pass overlap='flash' or 'slice'"):
        leancompile.CompileOptions(overlap_sites={"x": "flash"})


def _auto_worker(rank, world, init, out, profile_path):
    import torch.distributed as dist

    import leancompile

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 64), torch.randn(64, 32)
    torch.manual_seed(1 + rank)
    x = torch.randn(16, 32)
    block = _mlp_block(dist.group.WORLD.group_name)
    # Each site its own setting: the all-gather's flash with 2 slices per rank, the
    # reduce-scatter sliced in 2 (names as explain shows them).
    mixed = {"all_gather_into_tensor": "flash 2 chunks per rank",
             "reduce_scatter_tensor": "slice 2"}
    results, targets = {}, {}
    for name, options in (("sequential", {}),
                          ("auto", {"overlap": "auto", "device": profile_path}),
                          ("mixed", {"overlap": "flash", "overlap_sites": mixed})):
        torch._dynamo.reset()
        y = torch.compile(block, backend=leancompile.backend(compiler="aot_eager", **options))(
            x, w1, w2)
        results[name] = y
        report = leancompile.last_report()
        if name == "auto":
            chosen = [r.auto["chosen"] for r in report.graphs]
        targets[name] = [op for r in report.graphs for op, k in r.op_counts_after.items()
                         for _ in range(k)]
    diffs = {name: (results[name] - results["sequential"]).abs().max().item()
             for name in ("auto", "mixed")}
    everyone = [None] * world
    dist.all_gather_object(everyone, chosen)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"chosen": everyone, "diffs": diffs, "targets": targets["mixed"]}, f)
    dist.destroy_process_group()


def test_overlap_auto_on_two_gloo_ranks_agrees_and_equals_sequential(tmp_path):
    """Every rank predicts the same times for its (symmetric) graph, so they pick the same
    schedule; the result is the sequential one's. The profile (a hop as long as a slice's
    matmul, no launch costs) makes a decomposed schedule win."""
    profile = dataclasses.replace(device_profile("h100"), name="slowcompute",
                                  flops={"float32": 1e8}, link_bandwidth=3e6,
                                  collective_bandwidth=3e6, link_latency=0.0,
                                  kernel_overhead=0.0, matmul_overhead=0.0)
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    out = tmp_path / "result.json"
    spawn(_auto_worker, args=(2, str(tmp_path / "init"), str(out), str(path)), nprocs=2,
          join=True)
    result = json.loads(out.read_text())
    assert result["chosen"][0] == result["chosen"][1] and result["chosen"][0] != ["none"], \
        result
    assert max(result["diffs"].values()) <= 1e-5, result
    mixed = result["targets"]
    # The gather's own setting: both of the other rank's 2 slices arrive by a P2P step (one
    # with the graph's default, 1 slice per rank); the scatter's: 2 sliced collectives.
    assert sum("p2p_start" in t for t in mixed) == 2
    assert sum("reduce_scatter_tensor" in t for t in mixed) == 2  # two sliced collectives
    assert not any("all_gather_into_tensor" in t for t in mixed)


def test_trainer_auto_on_a_device_takes_the_fastest_plan_that_fits():
    from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
    from models import ToyFlowPolicy

    policy = ToyFlowPolicy()
    conditions = policy.example_conditions(2, generator=torch.Generator().manual_seed(1))

    def reward(latents, conditions):
        return latents.flatten(1).mean(1)

    config = GRPOConfig(group_size=2, eta=0.9, schedule="auto", device="a100",
                        memory_budget_bytes=2**30)
    report = GRPOTrainer(policy, reward, None, config).explain(conditions)
    seconds = {name: plan.seconds for name, plan in report.plans.items()}
    assert all(s is not None and s > 0 for s in seconds.values()), seconds
    assert seconds["retain"] < seconds["recompute"]  # no update forward
    assert report.chosen == min((n for n, p in report.plans.items() if p.fits),
                                key=lambda n: seconds[n])
    assert "predicted" in report.reason and "fastest that fits" in report.reason
    assert "predicted" in report.plans["retain"].describe()
    plain = GRPOTrainer(policy, reward, None, dataclasses.replace(config, device=None))
    assert plain.explain(conditions).plans["retain"].seconds is None
    with pytest.raises(ValueError, match="not a built-in profile"):
        GRPOConfig(device="tpu-v9")


def test_cpu_flash_attention_counts_its_flops():
    """CPU graphs (and the Ulysses query-split rewrite, which keeps the CPU kernel) carry
    ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, for which torch has no
    FLOP formula: counted like CUDA's flash attention (4*B*H*S*S*D forward)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.sim.simulate import _flops

    def f(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            out[0], q, k, v, out[0], out[1], 0.0, False)
        return out[0], grads[0]

    b, h, s, d = 1, 2, 64, 8
    gm = make_fx(f)(*(torch.randn(b, h, s, d) for _ in range(3)))
    flops = {str(n.target).split(".")[-2]: _flops(n) for n in gm.graph.nodes
             if "attention" in str(n.target)}
    assert flops["_scaled_dot_product_flash_attention_for_cpu"] == 4 * b * h * s * s * d
    assert flops["_scaled_dot_product_flash_attention_for_cpu_backward"] > \
        flops["_scaled_dot_product_flash_attention_for_cpu"]
