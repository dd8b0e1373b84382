"""The GRPO trainer, the bench's eager FlowGRPO row and a user's loop wrapped by
``lean_compile``, on an accelerator: the same runs as on the host, compared with the host's.

The rest of the suite runs on the CPU. These tests run on the devices that
``LEANCOMPILE_TEST_DEVICES`` names (comma-separated, e.g. ``cuda``); unset, on ``cuda`` where
torch sees one. CI's machines have none, so there they are skipped; ``tools/gpu_check.sh``
runs them on the GPU machine, and ``LEANCOMPILE_TEST_DEVICES=cpu`` runs them on the host
against itself (a check of the tests). What they pin down: every tensor the trainer and the
loops make lands on the policy's device (trajectories, log-probs, step indices, noise drawn on
the host from the same generators), rewards and advantages stay on the host, and the
gradients agree with the host's within float32 rounding.
"""

import copy
import os

import pytest
import torch

import leancompile
from grpo_reference import agreement
from leancompile.benchmarks.grpo import eager_flow_grpo_gradients
from leancompile.demos.user_loops import LoopConfig, flow_grpo_loop, make_step
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import bf16_flux, tiny_flux_policy


def _devices() -> list[str]:
    named = os.environ.get("LEANCOMPILE_TEST_DEVICES")
    if named is not None:
        return [d.strip() for d in named.split(",") if d.strip()]
    return ["cuda"] if torch.cuda.is_available() else []


DEVICES = _devices()
pytestmark = pytest.mark.skipif(not DEVICES, reason="no accelerator (set "
                                "LEANCOMPILE_TEST_DEVICES=cpu to run these on the host)")
SCHEDULES = ("recompute", "retain", "reweight")


def _params(devices):
    return devices or [pytest.param("none", marks=pytest.mark.skip(reason="no such device"))]


def mean_latent_reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


def _trainer_runs(policy, compiler="aot_eager"):
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=4, compiler=compiler)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1),
                                           sequence_length=8)
    runs = {name: trainer.compute_gradients(conditions, torch.Generator().manual_seed(3),
                                            schedule=name) for name in SCHEDULES}
    return runs, trainer, conditions


def _on_host(grads):
    return {n: g.detach().cpu() for n, g in grads.items()}


@pytest.mark.parametrize("device", _params(DEVICES))
def test_trainer_on_the_device_agrees_with_the_host(device):
    host = tiny_flux_policy(steps=3)
    policy = copy.deepcopy(host).to(device)
    on_host, _, _ = _trainer_runs(host)
    runs, trainer, conditions = _trainer_runs(policy)
    target = torch.device(device)
    for name, result in runs.items():
        record = result.rollout
        assert record.latents.device.type == target.type, name
        assert record.log_probs.device.type == target.type, name
        assert record.log_probs.dtype == torch.float32
        assert record.rewards.device.type == "cpu" and record.advantages.device.type == "cpu"
        assert {g.device.type for g in result.grads.values()} == {target.type}, name
        # The same draws (noise from the host's generators) give the same trajectory.
        torch.testing.assert_close(record.latents.cpu(), on_host[name].rollout.latents,
                                   rtol=1e-4, atol=1e-5)
        cosine, rel = agreement(_on_host(result.grads), on_host[name].grads)
        assert rel <= 1e-4, (name, cosine, rel)
    base = runs["recompute"].grads
    for name in ("retain", "reweight"):
        assert runs[name].schedule == name, runs[name].reason
        assert runs[name].ratio_error == 0.0, name  # the rollout's own forward, reused
        cosine, rel = agreement(runs[name].grads, base)
        assert rel <= 1e-5, (name, cosine, rel)
    assert runs["retain"].retained_bytes > 0

    # The bench's eager FlowGRPO row (no compile) on the same device and draws.
    eager = eager_flow_grpo_gradients(policy, trainer.config, conditions, mean_latent_reward,
                                      torch.Generator().manual_seed(3))
    cosine, rel = agreement(eager.grads, base)
    assert rel <= 1e-5, (cosine, rel)
    torch.testing.assert_close(eager.rewards.cpu(), runs["recompute"].rollout.rewards)


@pytest.mark.parametrize("device", _params(DEVICES))
def test_a_users_loop_wrapped_on_the_device_gives_the_plain_loops_gradients(device):
    config = LoopConfig(sde="flow_grpo", eta=0.9, level="step", prompts=1, group_size=2,
                        sample_batch=2, train_batch=2, iterations=1, optimizer_steps=1)
    results = {}
    for schedule in ("plain", "retain"):
        torch._dynamo.reset()
        policy = tiny_flux_policy(steps=3).to(device)
        extra = {} if schedule == "plain" else dict(schedule=schedule, sample_output=0,
                                                    sample_arg="prev_sample")
        step = leancompile.lean_compile(make_step(policy, config), backend="aot_eager",
                                        **extra)
        results[schedule] = (flow_grpo_loop(policy, step, config), step)
    (plain, _), (lean, step) = results["plain"], results["retain"]
    assert step.stats.forwards_run == 0, step.stats.summary()  # the update reused the rollout's
    for got, ref in zip(lean.grads, plain.grads):
        cosine, rel = agreement(_on_host(got), _on_host(ref))
        assert rel <= 1e-5, (cosine, rel)


@pytest.mark.parametrize("device", _params([d for d in DEVICES if d != "cpu"]))
def test_bf16_lora_under_inductor_on_the_device(device):
    """What the host's Inductor cannot compile (``test_bf16.py``'s note): the bf16 LoRA
    policy under Inductor; retain and reweight reuse the rollout's forward (ratio exactly 1)
    and agree with recompute."""
    policy = bf16_flux(lora=True, steps=3)
    policy.to(device)
    runs, _, _ = _trainer_runs(policy, compiler="inductor")
    base = runs["recompute"].grads
    assert {g.dtype for g in base.values()} == {torch.bfloat16}
    for name in ("retain", "reweight"):
        assert runs[name].ratio_error == 0.0, name
        cosine, rel = agreement(runs[name].grads, base)
        assert cosine >= 0.999, (name, cosine, rel)
