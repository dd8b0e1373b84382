"""bf16 policies, as a new user runs them: the transformer cast to bfloat16, the SDE and the
log-prob in float32 (as FlowGRPO and DanceGRPO upcast), one prompt x 4 samples.

- aot_eager: retain's gradients are bitwise equal to recompute's (the update's backward runs on
  the very activations recompute's forward would produce: the same graph on the same inputs);
  reweight's agree to cosine >= 0.9999 (its per-row gradients are taken in bf16 and summed in
  a different order). Full fine-tuning and LoRA; the trainer and the ``lean_compile`` wrapper in
  a FlowGRPO-style loop.
- Inductor: retain and reweight reuse the rollout's own forward, so the PPO ratio is exactly 1
  (``ratio_error == 0``); recompute's update runs Inductor's grad forward where the rollout ran
  its no-grad (inference) graph, which may round differently: its ``ratio_error`` and retain's
  distance from recompute are bounded, not zero. Asserted in fp32 on a small policy by
  ``test_grpo_trainer.py::test_inductor_compiled_graphs_match_aot_eager`` (the tiny FLUX under
  Inductor took minutes of the suite). Not in bf16: torch 2.13's Inductor CPU backend fails to
  compile the tiny FLUX's bf16 backward with a dynamic batch (C++ "conflicting declaration
  'auto at_BFloat16_tmp_acc0_vec'": one bf16 reduction stored to three outputs; reproduced with
  plain ``torch.compile(dynamic=True)``, pytorch/pytorch#194706).
"""

import copy

import pytest
import torch

import leancompile
from grpo_reference import agreement
from leancompile.demos.user_loops import LoopConfig, flow_grpo_loop, make_step
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import bf16_flux


def mean_latent_reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


def run_schedules(policy, compiler="aot_eager", schedules=("recompute", "retain", "reweight")):
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=4, compiler=compiler)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1),
                                           sequence_length=8)
    return {name: trainer.compute_gradients(conditions, torch.Generator().manual_seed(3),
                                            schedule=name) for name in schedules}


def assert_bitwise(grads, reference):
    assert grads.keys() == reference.keys()
    different = [n for n in grads if not torch.equal(grads[n], reference[n])]
    assert not different, different[:5]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer_bf16_retain_bitwise_reweight_close(lora):
    policy = bf16_flux(lora=lora)
    results = run_schedules(policy)
    base = results["recompute"]
    assert {g.dtype for g in base.grads.values()} == {torch.bfloat16}
    assert base.rollout.log_probs.dtype == torch.float32  # the SDE and log-prob stay fp32
    assert any(g.abs().sum() > 0 for g in base.grads.values())
    assert_bitwise(results["retain"].grads, base.grads)
    assert torch.equal(results["retain"].rollout.latents, base.rollout.latents)
    cosine, rel = agreement(results["reweight"].grads, base.grads)
    assert cosine >= 0.9999, (cosine, rel)
    assert results["retain"].ratio_error == 0 and results["reweight"].ratio_error == 0


class _Schedule:
    """A wrapped step whose rollouts run ``schedule`` (``rollout(schedule=...)``)."""

    def __init__(self, step, schedule):
        self.step, self.schedule = step, schedule

    def __call__(self, *args, **kwargs):
        return self.step(*args, **kwargs)

    def rollout(self, **kwargs):
        return self.step.rollout(schedule=self.schedule, **kwargs)

    def update(self):
        return self.step.update()


def test_wrapper_bf16_flow_grpo_loop_retain_bitwise():
    """The user's loop (shuffled, re-batched rows, accumulation, clipping, Adam), its step
    (velocity + SDE + log-prob) wrapped: retain's parameters after 2 iterations are bitwise
    those of the same loop without reuse."""
    base = bf16_flux(steps=4)
    base.requires_grad_(True)
    config = LoopConfig(sde="flow_grpo", eta=0.9, level="step", iterations=2, lr=1e-3)
    policy = copy.deepcopy(base)
    reference = flow_grpo_loop(policy, leancompile.lean_compile(
        make_step(policy, config), backend="aot_eager"), config)
    # Retain, then Reweight on the same wrapped step (one capture): the user's loop chooses
    # the schedule of each rollout (rollout(schedule=...)); the policy back to its start.
    torch._dynamo.reset()
    policy = copy.deepcopy(base)
    step = leancompile.lean_compile(make_step(policy, config), backend="aot_eager",
                                    schedule="retain", sample_output=0,
                                    sample_arg="prev_sample")
    retain = flow_grpo_loop(policy, step, config)
    stats = step.reset_stats()
    assert stats.forwards_run == 0 and stats.reused_calls > 0, stats.summary()
    for got, ref in zip(retain.grads, reference.grads):
        assert_bitwise(got, ref)
    for got, ref in zip(retain.history, reference.history):
        assert_bitwise(got, ref)
    with torch.no_grad():
        for p, start in zip(policy.parameters(), base.parameters()):
            p.copy_(start)
    graphs = len(step.graphs)
    reweight = flow_grpo_loop(policy, _Schedule(step, "reweight"), config)
    assert len(step.graphs) == graphs  # (no new capture)
    assert step.stats.reweight_rows_per_backward > 1  # batched per-row gradients
    cosine, rel = agreement(reweight.grads[0], reference.grads[0])
    assert cosine >= 0.9999, (cosine, rel)
