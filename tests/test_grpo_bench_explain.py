"""`leancompile bench grpo` (tiny config) and explain() of a GRPO trainer."""

import json
import subprocess
import sys

import pytest
import torch

import leancompile
from leancompile.benchmarks.grpo import BenchConfig, format_table, main
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import ToyFlowPolicy


def test_bench_grpo_json_has_ratios_and_agreement(capsys):
    assert main(["--model", "flux", "--layers", "0", "--single-layers", "1", "--hidden", "64",
                 "--latent", "8",
                 "--steps", "3", "--repeats", "1", "--json", "--malloc", "default"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["malloc"] == "default"
    assert report["config"]["steps"] == 3 and report["config"]["model"] == "flux"
    assert report["config"]["compilers"] == ["aot_eager"]
    assert report["ideal_ratio"] > 1.0
    schedules = report["schedules"]
    assert set(schedules) == {"eager", "recompute", "retain", "reweight"}
    for name, entry in schedules.items():
        for key in ("rollout_s", "update_s", "total_s", "total_s_min", "ratio_to_recompute",
                    "ratio_to_recompute_min", "ratio_to_eager", "ratio_to_eager_min",
                    "fraction_of_ideal", "fraction_of_ideal_min", "retained_bytes",
                    "grad_cosine", "grad_rel_l2", "grad_rel_l2_to_eager", "ratio_error"):
            assert key in entry, (name, key)
        assert entry["total_s"] > 0 and entry["total_s_min"] <= entry["total_s"]
    assert schedules["recompute"]["ratio_to_recompute"] == 1.0
    assert schedules["eager"]["ratio_to_eager"] == 1.0
    for name in ("retain", "reweight"):
        entry = schedules[name]
        assert entry["fraction_of_ideal"] == entry["ratio_to_recompute"] / report["ideal_ratio"]
        assert entry["fraction_of_ideal_min"] == pytest.approx(
            entry["ratio_to_recompute_min"] / report["ideal_ratio"])
        assert entry["ratio_to_eager"] == pytest.approx(
            schedules["eager"]["total_s"] / entry["total_s"])
    assert schedules["recompute"]["fraction_of_ideal"] is None
    # Retain and reweight reuse the rollout's forward: the PPO ratio is exactly 1.
    assert schedules["retain"]["ratio_error"] == 0 and schedules["reweight"]["ratio_error"] == 0
    # Plain eager FlowGRPO computes the same gradient as the trainer (fp32 rounding only).
    assert schedules["eager"]["grad_rel_l2"] <= 1e-5
    assert schedules["eager"]["grad_cosine"] >= 1 - 1e-9
    assert schedules["eager"]["retained_bytes"] == 0
    assert schedules["retain"]["grad_rel_l2"] <= 1e-6
    assert schedules["reweight"]["grad_rel_l2"] <= 1e-5
    assert schedules["retain"]["retained_bytes"] > 0
    assert schedules["recompute"]["retained_bytes"] == 0
    assert report["best_fraction_of_ideal"] is not None
    assert report["best_fraction_of_ideal_min"] is not None
    assert set(report["by_compiler"]) == {"aot_eager"}
    assert set(report["by_compiler"]["aot_eager"]["schedules"]) == {
        "recompute", "retain", "reweight"}
    best = report["best_configuration"]
    assert best["compiler"] == "aot_eager" and best["schedule"] in schedules
    assert best["ratio_to_eager"] == schedules[best["schedule"]]["ratio_to_eager"]
    text = format_table(report)
    assert "ideal ratio" in text and "eager" in text and "best configuration" in text
    assert "host allocator: default" in text


_RSS_AFTER_FREE = """
import sys, torch
if sys.argv[1] == "keep":
    from leancompile.runtime.allocator import keep_freed_memory
    assert keep_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
blocks = [torch.ones(1 << 18) for _ in range(256)]  # 256 x 1 MiB
held = rss()
del blocks
print(held - rss())
"""


def test_bench_grpo_under_torchrun_fsdp_counts_gradient_reductions():
    """What a user launches: ``torchrun --nproc-per-node 2 -m leancompile.cli bench grpo
    --parallel fsdp``. Two prompt groups, both ranks on each (shared layout): Reweight
    reduce-scatters once per group; recompute inside each of its two trained steps'
    backwards."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
         "leancompile.cli", "bench", "grpo", "--parallel", "fsdp", "--prompts", "2",
         "--schedules", "recompute,reweight", "--layers", "0", "--single-layers", "1",
         "--hidden", "64", "--latent",
         "8", "--steps", "2", "--repeats", "1", "--json", "--malloc", "default"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["config"]["world_size"] == 2 and report["config"]["prompts"] == 2
    recompute, reweight = report["schedules"]["recompute"], report["schedules"]["reweight"]
    assert reweight["sync_collectives"] == 2, reweight
    # Recompute's two backwards each reduce-scatter every gradient in one bucket (the
    # default bucket_cap_mb=25 holds the tiny model whole)
    assert report["config"]["bucket_cap_mb"] == 25.0
    assert recompute["sync_collectives"] == 2, recompute
    assert reweight["grad_rel_l2"] <= 1e-5, reweight
    # each carries the full (padded) gradient: two groups' worth, as recompute's two
    # backwards (whose per-parameter reduce-scatters pad less)
    assert abs(reweight["sync_bytes"] - recompute["sync_bytes"]) <= 0.01 * recompute[
        "sync_bytes"], (reweight, recompute)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_keeps_freed_blocks_resident():
    """glibc hands 1 MiB blocks back to the kernel when they are freed; after
    keep_freed_memory() the process keeps them for the next allocation (the bench's --malloc)."""
    from leancompile.runtime.allocator import _glibc, keep_freed_memory

    if _glibc() is None:
        pytest.skip("not glibc")
    returned = {mode: int(subprocess.run([sys.executable, "-c", _RSS_AFTER_FREE, mode],
                                         capture_output=True, text=True, check=True).stdout)
                for mode in ("default", "keep")}
    assert returned["default"] > 200 << 20, returned  # the blocks went back to the kernel
    assert returned["keep"] < 16 << 20, returned  # kept for reuse
    with pytest.raises(ValueError, match="32 MiB"):
        keep_freed_memory(mmap_threshold=64 << 20)
    with pytest.raises(ValueError, match="trim_threshold"):
        keep_freed_memory(trim_threshold=-1)


def test_bench_config_errors():
    with pytest.raises(ValueError, match="include recompute"):
        BenchConfig(schedules=("retain",))
    with pytest.raises(ValueError, match="model='sd3'"):
        BenchConfig(model="sd3")
    with pytest.raises(ValueError, match="grad_sync='step'"):
        BenchConfig(grad_sync="step")
    with pytest.raises(ValueError, match="prompts=0"):
        BenchConfig(prompts=0)
    with pytest.raises(ValueError, match="compilers"):
        BenchConfig(compilers=("aot_eager", "aot_eager"))
    with pytest.raises(ValueError, match="compilers"):
        BenchConfig(compilers=("tvm",))
    assert BenchConfig(compiler="inductor").compilers == ("inductor",)
    config = BenchConfig(compilers=("inductor", "aot_eager"))
    assert config.compiler == "inductor"
    with pytest.raises(SystemExit):
        main(["--compiler", "aot_eager", "--compilers", "inductor,aot_eager"])


def test_explain_a_trainer_shows_plans_and_choice():
    policy = ToyFlowPolicy(steps=4)
    trainer = GRPOTrainer(policy, lambda x, c: x.mean(1), None,
                          GRPOConfig(group_size=2, memory_budget_bytes=1 << 30))
    conditions = policy.example_conditions(2, torch.Generator().manual_seed(0))
    report = leancompile.explain(trainer, conditions)
    assert report.chosen == "retain"
    text = str(report)
    for name in ("recompute", "retain", "reweight"):
        assert f"schedule {name}" in text
    assert "backward_later" in text and "scale_buffer" in text and "-> retain" in text
    assert report.saved_bytes_per_call > 0
    assert report.plans["retain"].peak_bytes == 4 * report.saved_bytes_per_call  # 4 steps
    # Nothing ran: no rollout was recorded, no parameter has a gradient.
    assert trainer.last_rollout is None
    assert all(p.grad is None for p in policy.parameters())
