"""Graph features real policies trace, through LeanGRPO's capture (``leancompile/capture/``):
ops with side effects (AOTAutograd's effect tokens) and activation checkpointing, with and
without a random op inside the checkpointed region.

Regressions: a policy with ``torch.linalg.inv`` (an error check with a side effect, so the
graphs carry an effect token) failed the capture with an IndexError; a checkpointed region with
dropout failed it with ``KeyError: 'rng_state_output_0'`` (the partitioner passes the
generator state to the backward under another name), and once past that, the random op hid in
``run_and_save_rng_state`` where the check for random ops did not look."""

import copy
import dataclasses

import pytest
import torch

import leancompile
from grpo_reference import agreement
from leancompile.capture import RandomOpInGraphError
from leancompile.demos.user_loops import LoopConfig, flow_grpo_loop
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import ToyFlowPolicy
from test_grpo_trainer import mean_latent_reward
from test_lean_step import assert_same, run, toy_loop_once


class InversePolicy(ToyFlowPolicy):
    """The velocity mixes its channels through the inverse of a learned matrix."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mix = torch.nn.Parameter(torch.eye(self.dim) + 0.1 * torch.randn(self.dim, self.dim))

    def velocity(self, latents, step_index, conditions):
        return super().velocity(latents, step_index, conditions) @ torch.linalg.inv(self.mix)


def _trainer_gradients(policy):
    conditions = policy.example_conditions(2, generator=torch.Generator().manual_seed(1))
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=2)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    return {s: trainer.compute_gradients(conditions, torch.Generator().manual_seed(5),
                                         schedule=s).grads
            for s in ("recompute", "retain", "reweight")}


@pytest.mark.parametrize("make", [InversePolicy, lambda: ToyFlowPolicy(checkpointing=True)],
                         ids=["effect_token", "checkpointing"])
def test_trainer_schedules_agree_with_eager(make):
    grads = _trainer_gradients(make())
    # Recompute against eager autograd: the wrapper test below.
    for schedule in ("retain", "reweight"):
        assert agreement(grads[schedule], grads["recompute"])[1] <= 1e-6, schedule


@pytest.mark.parametrize("make", [InversePolicy, lambda: ToyFlowPolicy(checkpointing=True)],
                         ids=["effect_token", "checkpointing"])
def test_wrapper_loop_equals_the_eager_loop(make):
    base = make()
    for level, schedule in (("model", "retain"), ("step", "reweight")):
        config = dataclasses.replace(LoopConfig(sde="flow_grpo", eta=0.9), level=level,
                                     iterations=2)
        reference, _ = run(copy.deepcopy(base), flow_grpo_loop, config, compiler=None)
        result, step = run(copy.deepcopy(base), flow_grpo_loop, config, schedule)
        assert_same(result, reference, 1e-5)
        assert step.stats.forwards_run == 0 and step.stats.reused_calls > 0


def test_checkpointed_dropout_is_refused_for_lean_schedules_and_recomputed():
    policy = ToyFlowPolicy(dropout=0.1, checkpointing=True).train()
    for schedule in ("retain", "reweight"):
        step = leancompile.lean_compile(policy.velocity, backend="aot_eager", schedule=schedule)
        with pytest.raises(RandomOpInGraphError, match=r"aten\.rand.*Dropout.*model\.eval\(\)"):
            toy_loop_once(policy, step)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(group_size=2))
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1))
    with pytest.raises(RandomOpInGraphError, match=r"aten\.rand.*Dropout"):
        trainer.compute_gradients(conditions, torch.Generator().manual_seed(0), schedule="retain")

    # Recompute runs the graphs it captured: the backward redraws the forward's dropout mask
    # from the saved generator state. Reference: torch.compile with the same decompositions
    # and partitioner, which draws the same numbers from the same seed.
    def gradients(fn):
        torch.manual_seed(3)
        return toy_loop_once(policy, fn)
    step = leancompile.lean_compile(policy.velocity, backend="aot_eager", schedule="recompute")
    got = gradients(step)
    ref = gradients(torch.compile(policy.velocity, backend="aot_eager_decomp_partition"))
    assert step.stats.forwards_run == step.stats.update_calls > 0
    assert got.keys() == ref.keys()
    for name in got:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


def test_effect_token_under_inductor():
    """Inductor lowers the effect tokens itself (``compile_fx_inner`` on the unlifted graph)."""
    base = InversePolicy()
    config = dataclasses.replace(LoopConfig(sde="flow_grpo", eta=0.9), level="model",
                                 iterations=2)
    reference, _ = run(copy.deepcopy(base), flow_grpo_loop, config, compiler=None)
    result, step = run(copy.deepcopy(base), flow_grpo_loop, config, "retain",
                       compiler="inductor")
    assert_same(result, reference, 1e-5)
    assert step.stats.forwards_run == 0 and step.stats.reused_calls > 0
