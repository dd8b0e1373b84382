"""LeanGRPO schedules on tiny diffusers models: gradients against recompute and against an
independent eager-autograd GRPO loop; the guards; auto's choice and its byte accounting."""

import copy
import dataclasses

import pytest
import torch

from grpo_reference import agreement, eager_grpo_gradients
from leancompile.capture import RandomOpInGraphError
from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer, OffPolicyWarning
from models import ToyFlowPolicy, tiny_flux_policy, tiny_wan_policy

# Every compile here is a trainer's lean_compile step (a code object of its own), and
# test_auto_chooses_from_the_memory_budget runs the fixture's trainer again: Dynamo is reset
# per module, not per test (that test: 38 -> 20 s of CPU).
DYNAMO_RESET = "module"


def mean_latent_reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


def flux_conditions(policy, prompts=2):
    return policy.example_conditions(prompts, generator=torch.Generator().manual_seed(1),
                                     sequence_length=8)


def run_all(trainer, conditions, seed=3):
    return {name: trainer.compute_gradients(conditions, torch.Generator().manual_seed(seed),
                                            schedule=name)
            for name in ("recompute", "retain", "reweight")}


def check_agreement(results, policy, config, reference=None):
    base = results["recompute"]
    for name, result in results.items():
        assert result.schedule == name
    # Retain runs the training forward graph at selected steps where the baseline runs the
    # inference graph; Reweight runs selected steps one sample at a time (one gradient buffer
    # each). Both can round differently in the last bit, and the difference is carried through
    # the later denoising steps: on an AMD EPYC (AVX-512) machine the tiny Wan rollout with CFG
    # differed by 1.3e-6 in one of 4096 elements (latents of magnitude ~1).
    torch.testing.assert_close(results["retain"].rollout.latents, base.rollout.latents,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["reweight"].rollout.latents, base.rollout.latents,
                               rtol=1e-5, atol=1e-5)
    eager = eager_grpo_gradients(policy, base.rollout, sde=config.sde, eta=config.eta,
                                 beta=config.beta, reference=reference)
    cos, rel = agreement(base.grads, eager)
    assert cos >= 0.99999 and rel <= 1e-5, ("recompute vs eager autograd", cos, rel)
    cos, rel = agreement(results["retain"].grads, base.grads)
    assert cos >= 0.9999999 and rel <= 1e-6, ("retain vs recompute", cos, rel)
    cos, rel = agreement(results["reweight"].grads, base.grads)
    assert rel <= 1e-5, ("reweight vs recompute", cos, rel)
    assert any(g.abs().sum() > 0 for g in base.grads.values())


@pytest.fixture(scope="module")
def flux():
    """One tiny-FLUX trainer (a dual-stream and a single-stream block) and its three schedules'
    results, shared (capture is the cost)."""
    policy = tiny_flux_policy(double_blocks=1)
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=2)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    conditions = flux_conditions(policy)
    return dict(policy=policy, trainer=trainer, config=config, conditions=conditions,
                results=run_all(trainer, conditions))


def test_flux_schedules_match_recompute_and_eager(flux):
    check_agreement(flux["results"], flux["policy"], flux["config"])
    # Reweight (the fixture's last run): after each sample's first trained step, the
    # vectorised backward adds into the samples' gradient buffers itself, the weight
    # gradients as in-place batched matmuls (runtime/accumulate.py).
    stats = flux["trainer"].lean_step(list(flux["conditions"])).stats
    steps = len(flux["policy"].sigmas) - 1
    assert stats.reweight_fused_steps == (steps - 1) * 2, stats  # 2 prompts, one group each
    assert stats.reweight_inplace_matmuls > 0


def test_flux_with_kl_schedules_match_recompute_and_eager():
    policy = tiny_flux_policy(steps=3)
    reference = copy.deepcopy(policy)
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=2, beta=0.05, reference="copy")
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    # Move the policy away from its reference so the KL term is not zero.
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    results = run_all(trainer, flux_conditions(policy))
    assert all(r.kl > 0 for r in results.values())
    check_agreement(results, policy, config, reference)


def test_wan_cfg_with_kl_schedules_match_recompute_and_eager():
    """With diffusers' gradient checkpointing on, as FlowGRPO's ``train_wan2_1.py`` trains Wan
    (the FLUX tests above run without it): the checkpointed attention, wrapped by torch in
    ``run_and_save_rng_state``, is kept, regrouped and vmapped like any other."""
    policy = tiny_wan_policy()
    policy.transformer.enable_gradient_checkpointing()
    reference = copy.deepcopy(policy)
    config = GRPOConfig(sde="dance_grpo", eta=0.3, group_size=2, beta=0.05, reference="copy")
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    conditions = policy.example_conditions(1, generator=torch.Generator().manual_seed(1),
                                           sequence_length=8)
    results = run_all(trainer, conditions)
    assert all(r.kl > 0 for r in results.values())
    check_agreement(results, policy, config, reference)


def test_init_same_noise_shares_the_initial_latent_per_group():
    policy = ToyFlowPolicy(steps=2)
    trainer = GRPOTrainer(policy, mean_latent_reward, None,
                          GRPOConfig(group_size=3, init_same_noise=True, schedule="retain"))
    result = trainer.compute_gradients(policy.example_conditions(2), torch.Generator().manual_seed(0))
    start = result.rollout.latents[:, 0]
    assert torch.equal(start[0], start[1]) and torch.equal(start[1], start[2])
    assert not torch.equal(start[0], start[3])
    assert not torch.equal(result.rollout.latents[0, -1], result.rollout.latents[1, -1])


def test_per_sample_random_steps_split_the_batch():
    """DanceGRPO selection: each sample trains its own random steps, so at a given step some
    rows are selected and some are not; the runner splits the batch."""
    policy = ToyFlowPolicy(steps=5)
    config = GRPOConfig(sde="dance_grpo", eta=0.3, group_size=2, timestep_fraction=0.5)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    conditions = policy.example_conditions(2, torch.Generator().manual_seed(1))
    results = run_all(trainer, conditions)
    selected = results["recompute"].rollout.selected
    assert selected.shape == (4, 2) and len({tuple(r) for r in selected.tolist()}) > 1
    check_agreement(results, policy, config)


def test_retained_bytes_are_measured_and_predicted_exactly(flux):
    retain = flux["results"]["retain"]
    assert retain.retained_bytes > 0
    assert retain.retained_bytes == retain.plans["retain"].peak_bytes
    grad_bytes = sum(p.numel() * 4 for p in flux["policy"].parameters())
    reweight = flux["results"]["reweight"]
    assert reweight.buffer_bytes == 2 * grad_bytes  # one group of 2 samples in flight
    assert reweight.plans["reweight"].peak_bytes >= reweight.buffer_bytes
    assert flux["results"]["recompute"].retained_bytes == 0


def test_auto_chooses_from_the_memory_budget(flux):
    trainer = flux["trainer"]
    retain = flux["results"]["recompute"].plans["retain"].peak_bytes

    def auto(budget, budgets=(0.0,)):
        trainer.config = dataclasses.replace(
            flux["config"], memory_budget_bytes=budget, partitioner_budgets=budgets)
        try:
            return trainer.compute_gradients(flux["conditions"],
                                             torch.Generator().manual_seed(3))
        finally:
            trainer.config = flux["config"]

    roomy = auto(10 * retain)
    assert roomy.schedule == "retain" and roomy.retained_bytes == retain
    # Below what retain keeps at full budget: the partitioner at budget 0 saves less.
    smaller = auto(retain - 1)
    assert smaller.schedule == "retain" and "partitioner" in smaller.reason, smaller.reason
    assert smaller.retained_bytes < retain and smaller.plans["retain"].memory_budget == 0.0
    cos, rel = agreement(smaller.grads, flux["results"]["recompute"].grads)
    assert rel <= 1e-6, rel
    # Retain cannot fit at all, reweight's buffers can (auto measured its per-sample graph).
    reweight = roomy.plans["reweight"].peak_bytes
    assert reweight < retain
    assert auto(reweight, budgets=()).schedule == "reweight"
    assert auto(1, budgets=()).schedule == "recompute"


def test_parameter_change_between_rollout_and_update_recomputes():
    policy = ToyFlowPolicy()
    config = GRPOConfig(group_size=2, schedule="retain", eta=0.9)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    pending = trainer.rollout(policy.example_conditions(2, torch.Generator().manual_seed(1)),
                              torch.Generator().manual_seed(0))
    with torch.no_grad():  # what an optimizer step does
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    with pytest.warns(OffPolicyWarning, match="recomputed"):
        result = pending.update()
    assert result.schedule == "recompute"
    eager = eager_grpo_gradients(policy, result.rollout, sde=config.sde, eta=config.eta)
    cos, rel = agreement(result.grads, eager)
    assert rel <= 1e-5, rel  # with the new parameters and the PPO ratio != 1


def test_several_optimizer_steps_per_rollout_recompute_after_the_first():
    def train(schedule):
        policy = ToyFlowPolicy(steps=4)
        optimizer = torch.optim.SGD([p for p in policy.parameters()], lr=0.5)
        trainer = GRPOTrainer(policy, mean_latent_reward, optimizer, GRPOConfig(
            group_size=2, eta=0.9, schedule=schedule, updates_per_rollout=2,
            max_grad_norm=None))
        metrics = trainer.step(policy.example_conditions(2, torch.Generator().manual_seed(1)),
                               torch.Generator().manual_seed(0))
        return metrics, torch.cat([p.detach().flatten() for p in policy.parameters()])

    lean_metrics, lean_params = train("retain")
    base_metrics, base_params = train("recompute")
    assert lean_metrics["schedules"] == ["retain", "recompute"]
    assert base_metrics["schedules"] == ["recompute", "recompute"]
    torch.testing.assert_close(lean_params, base_params, rtol=1e-6, atol=1e-7)


def test_dropout_in_the_policy_is_refused_for_lean_schedules():
    policy = ToyFlowPolicy(dropout=0.1).train()
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1))
    trainer = GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(group_size=2))
    for schedule in ("retain", "reweight", "auto"):
        with pytest.raises(RandomOpInGraphError, match=r"rand.*Dropout.*model.eval\(\)"):
            trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                      schedule=schedule)
    trainer.compute_gradients(conditions, torch.Generator().manual_seed(0), schedule="recompute")
    policy.eval()
    result = trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                       schedule="retain")
    assert result.schedule == "retain"


def test_global_std_reweight_waits_for_the_whole_batch():
    policy = ToyFlowPolicy(steps=3)
    config = GRPOConfig(group_size=2, eta=0.9, global_std=True)
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    conditions = policy.example_conditions(2, torch.Generator().manual_seed(1))
    base = trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                     schedule="recompute")
    lean = trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                     schedule="reweight")
    torch.testing.assert_close(lean.rollout.advantages, base.rollout.advantages)
    cos, rel = agreement(lean.grads, base.grads)
    assert rel <= 1e-5, rel
    grad_bytes = sum(p.numel() * 4 for p in policy.parameters())
    assert lean.buffer_bytes == 4 * grad_bytes  # every sample's buffer waited for the batch


def test_non_finite_rewards_name_the_samples():
    policy = ToyFlowPolicy(steps=2)

    def bad_reward(latents, conditions):
        r = torch.zeros(latents.shape[0])
        r[1] = float("nan")
        return r

    trainer = GRPOTrainer(policy, bad_reward, None, GRPOConfig(group_size=2, schedule="retain"))
    with pytest.raises(ValueError, match=r"samples \[1\]"):
        trainer.compute_gradients(policy.example_conditions(1), torch.Generator().manual_seed(0))


def test_config_errors():
    with pytest.raises(ValueError, match="schedule='fast'"):
        GRPOConfig(schedule="fast")
    with pytest.raises(ValueError, match="group_size=1"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match=r"eta=0: .*no policy gradient.*eta > 0"):
        GRPOConfig(eta=0)
    with pytest.raises(TypeError):
        GRPOConfig("retain")


class AdaptersOff:
    """The LoRA policy with its adapters disabled (peft's own switch): the KL reference."""

    def __init__(self, policy):
        self.policy = policy

    def velocity(self, *args):
        self.policy.transformer.disable_adapters()
        try:
            return self.policy.velocity(*args)
        finally:
            self.policy.transformer.enable_adapters()


def test_lora_with_adapter_reference_kl():
    pytest.importorskip("peft")
    from peft import LoraConfig

    policy = tiny_flux_policy(steps=3)
    policy.transformer.requires_grad_(False)
    policy.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4,
                                              target_modules=["to_q", "to_k", "to_v"]))
    with torch.no_grad():  # lora_B starts at zero; move it so the KL and lora_A grads are live
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=2, beta=0.1)  # reference="auto"
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config)
    assert trainer.trainable and all("lora_" in n for n in trainer.trainable)
    results = run_all(trainer, flux_conditions(policy))
    assert set(results["retain"].grads) == set(trainer.trainable)
    assert all(r.kl > 0 for r in results.values())
    check_agreement(results, policy, config, reference=AdaptersOff(policy))


def test_inductor_compiled_graphs_match_aot_eager():
    policy = ToyFlowPolicy(steps=3)
    conditions = policy.example_conditions(2, torch.Generator().manual_seed(1))
    reference = GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(group_size=2))
    base = reference.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                       schedule="recompute")
    trainer = GRPOTrainer(policy, mean_latent_reward, None,
                          GRPOConfig(group_size=2, compiler="inductor"))
    for schedule in ("recompute", "retain", "reweight"):
        result = trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                           schedule=schedule)
        cos, rel = agreement(result.grads, base.grads)
        assert rel <= 1e-5, (schedule, rel)
        # Retain and Reweight reuse the rollout's own forward: their ratios are exactly 1.
        # Recompute's update forward is Inductor's grad graph and its rollout the inference
        # graph, which may round differently (bounded, not zero).
        if schedule == "recompute":
            assert result.ratio_error is not None and result.ratio_error < 1e-4
        else:
            assert result.ratio_error == 0, (schedule, result.ratio_error)
