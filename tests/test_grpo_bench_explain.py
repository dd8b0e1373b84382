"""`leancompile bench grpo` (tiny config) and explain() of a GRPO trainer."""

import json

import pytest
import torch

import leancompile
from leancompile.benchmarks.grpo import BenchConfig, format_table, main, run_grpo_bench
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import ToyFlowPolicy


def test_bench_grpo_json_has_ratios_and_agreement(capsys):
    assert main(["--model", "flux", "--layers", "1", "--hidden", "64", "--latent", "8",
                 "--steps", "3", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["steps"] == 3 and report["config"]["model"] == "flux"
    assert report["ideal_ratio"] > 1.0
    schedules = report["schedules"]
    assert set(schedules) == {"recompute", "retain", "reweight"}
    for name, entry in schedules.items():
        for key in ("rollout_s", "update_s", "total_s", "ratio_to_recompute", "retained_bytes",
                    "grad_cosine", "grad_rel_l2"):
            assert key in entry, (name, key)
        assert entry["total_s"] > 0
    assert schedules["recompute"]["ratio_to_recompute"] == 1.0
    assert schedules["retain"]["grad_rel_l2"] <= 1e-6
    assert schedules["reweight"]["grad_rel_l2"] <= 1e-5
    assert schedules["retain"]["retained_bytes"] > 0
    assert schedules["recompute"]["retained_bytes"] == 0
    assert "ideal ratio" in format_table(report)


def test_bench_config_errors():
    with pytest.raises(ValueError, match="include recompute"):
        BenchConfig(schedules=("retain",))
    with pytest.raises(ValueError, match="model='sd3'"):
        BenchConfig(model="sd3")


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
