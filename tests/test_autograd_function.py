"""A custom ``torch.autograd.Function`` in the policy keeps its own backward under every
schedule. Regression: the rollout runs under ``no_grad``, where Dynamo inlines a Function's
forward; the graphs captured from that trace differentiated the forward's ops, so Retain and
Reweight silently got other gradients than Recompute and eager autograd (2x apart here)."""

import copy
import dataclasses

import torch

from grpo_reference import agreement
from leancompile.demos.user_loops import LoopConfig, flow_grpo_loop
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import ToyFlowPolicy
from test_grpo_trainer import mean_latent_reward
from test_lean_step import assert_same, run


class DoubleGrad(torch.autograd.Function):
    """Identity forward; the backward doubles (a rule the forward's ops do not imply, like a
    straight-through estimator or a collective's custom transpose)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class CustomRulePolicy(ToyFlowPolicy):
    def velocity(self, latents, step_index, conditions):
        return DoubleGrad.apply(super().velocity(latents, step_index, conditions))


def test_trainer_schedules_keep_the_functions_backward():
    policy = CustomRulePolicy()
    conditions = policy.example_conditions(2, generator=torch.Generator().manual_seed(1))
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=2)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    grads = {s: trainer.compute_gradients(conditions, torch.Generator().manual_seed(5),
                                          schedule=s).grads
             for s in ("recompute", "retain", "reweight")}
    plain = GRPOTrainer(ToyFlowPolicy(), mean_latent_reward, None, config).compute_gradients(
        conditions, torch.Generator().manual_seed(5), schedule="recompute").grads
    # The rule doubles every gradient: recompute follows it (checked against the policy
    # without it), and the reusing schedules must agree with recompute.
    assert agreement(grads["recompute"], {k: 2 * v for k, v in plain.items()})[1] <= 1e-6
    for schedule in ("retain", "reweight"):
        assert agreement(grads[schedule], grads["recompute"])[1] <= 1e-6, schedule


def test_wrapper_loop_keeps_the_functions_backward():
    base = CustomRulePolicy(steps=4)
    config = dataclasses.replace(LoopConfig(sde="flow_grpo", eta=0.9), level="model",
                                 iterations=2)
    reference, _ = run(copy.deepcopy(base), flow_grpo_loop, config)
    result, step = run(base, flow_grpo_loop, config, "retain")
    assert_same(result, reference, 1e-6)
    assert step.stats.forwards_run == 0 and step.stats.reused_calls > 0
