"""``lean_compile(fn, schedule=...)`` in loops users own: a FlowGRPO-style and a DanceGRPO-style
loop (``leancompile/demos/user_loops.py``) changed only by the wrapper and the two phases give
the gradients and parameters of the same loop without the wrapper, with no update forward for
on-policy calls; the guards recompute (counted, with the reason) or refuse clearly.

"The same loop without the wrapper" runs the plain eager function; once it is compiled with the
same backend (``lean_compile`` without a schedule), where Retain must be bitwise equal to it.
Relative L2 is over all parameters (or all gradients) at once."""

import contextlib
import copy
import dataclasses

import pytest
import torch

import leancompile
from leancompile.step import StepConfig
from leancompile.capture import RandomOpInGraphError
from leancompile.demos.user_loops import LoopConfig, dance_grpo_loop, flow_grpo_loop, make_step
from models import ToyFlowPolicy, tiny_flux_policy


def _flat(tensors: dict) -> torch.Tensor:
    return torch.cat([t.flatten() for _, t in sorted(tensors.items())])


def rel_l2(a: dict, b: dict) -> float:
    a, b = _flat(a), _flat(b)
    return ((a - b).norm() / b.norm()).item()


def _fn(policy, config):
    return policy.velocity if config.level == "model" else make_step(policy, config)


def run(base, loop, config, schedule=None, *, compiler="aot_eager", auto_measured=True,
        **loop_kwargs):
    """(result, step): the loop on a copy of ``base`` with its function compiled by
    ``lean_compile`` (a ``LeanStep`` when ``schedule`` is given); ``compiler=None``: the plain
    eager function."""
    torch._dynamo.reset()  # each run compiles its own copy of the policy from scratch
    policy = copy.deepcopy(base)
    fn = _fn(policy, config)
    if compiler is None:
        return loop(policy, fn, config, **loop_kwargs), fn
    extra = {}
    if schedule is not None and config.level == "step":
        extra = dict(sample_output=0, sample_arg="prev_sample")
    if schedule is not None:
        extra["schedule"] = schedule
    if not auto_measured:
        extra["auto_measured"] = False
    step = leancompile.lean_compile(fn, backend=compiler, **extra)
    return loop(policy, step, config, **loop_kwargs), step


def assert_same(result, reference, tol):
    """Every optimizer step's gradients and the parameters after every iteration."""
    assert len(result.grads) == len(reference.grads)
    for got, ref in zip(result.grads, reference.grads):
        assert rel_l2(got, ref) <= tol, ("gradients", rel_l2(got, ref))
    for i, (got, ref) in enumerate(zip(result.history, reference.history)):
        assert rel_l2(got, ref) <= tol, ("parameters after iteration", i + 1, rel_l2(got, ref))


@pytest.fixture(scope="module")
def flux():
    policy = tiny_flux_policy(steps=4)
    policy.requires_grad_(True)
    return policy


FLOW = LoopConfig(sde="flow_grpo", eta=0.9)
DANCE = LoopConfig(sde="dance_grpo", eta=0.3, init_same_noise=True, timestep_fraction=0.7)


@pytest.fixture(scope="module")
def toy():
    return ToyFlowPolicy(steps=4)


# The model is FLUX where its graph is the point (model-level gathered rows; Reweight's
# vectorised backward through its attention), the small MLP policy where the loop's form is
# (FLUX's rows under DanceGRPO's batch-1 training calls: tests/test_real_loops.py).
@pytest.mark.parametrize("level,model", [("model", "flux"), ("step", "toy")])
def test_flow_grpo_loop_retain_equals_the_plain_loop(request, level, model):
    """Samples shuffled across the rollout's sampling batches, re-batched with 2 rows where
    sampling used 4, timesteps permuted per sample, PPO, accumulation, clipping, AdamW; three
    iterations (parameters compared after each)."""
    policy = request.getfixturevalue(model)
    config = dataclasses.replace(FLOW, level=level, iterations=3)
    # Model level: against the loop compiled without a schedule (Retain runs the rollout's
    # own forward graph and its backward); step level: against eager. Not bitwise: Retain's
    # rows were computed 4 at a time (the rollout's batches), the plain loop's update
    # computes them 2 at a time, and a float32 matmul may round a row differently at another
    # batch size (bitwise on the Intel Xeon machines; relative L2 1.8e-7 on AMD EPYC, torch
    # 2.11 and 2.13). test_bf16.py's wrapper test is bitwise.
    compiled = level == "model"
    reference, _ = run(policy, flow_grpo_loop, config,
                       compiler="aot_eager" if compiled else None)
    result, step = run(policy, flow_grpo_loop, config, "retain")
    assert_same(result, reference, 1e-6)
    # Every update call was served by the rollout: not one forward ran.
    assert step.stats.forwards_run == 0, step.stats.summary()
    assert step.stats.reused_calls == step.stats.update_calls > 0
    assert step.stats.mechanisms["gathered rows"] == step.stats.update_calls


def test_recompute_and_auto_on_a_small_policy():
    """auto by memory alone (``auto_measured=False``): on this toy policy, matching and
    gathering cost more than the forward they save, so the measured choice could stop keeping
    after a cycle (tests/test_auto_costs.py)."""
    base = ToyFlowPolicy(steps=4)
    config = dataclasses.replace(FLOW, level="model", iterations=3)
    reference, _ = run(base, flow_grpo_loop, config, compiler=None)
    result, step = run(base, flow_grpo_loop, config, "recompute")
    assert_same(result, reference, 1e-6)
    assert step.stats.forwards_run == step.stats.update_calls and step.stats.reused_calls == 0
    result, step = run(base, flow_grpo_loop, config, "auto", auto_measured=False)
    assert_same(result, reference, 1e-6)
    assert step.stats.kept == {"retain": 3 * 3} and step.stats.forwards_run == 0


def test_flow_grpo_loop_step_level_reweight(flux):
    config = dataclasses.replace(FLOW, level="step", iterations=3)
    reference, _ = run(flux, flow_grpo_loop, config, compiler=None)
    result, step = run(flux, flow_grpo_loop, config, "reweight")
    assert_same(result, reference, 1e-5)
    assert step.stats.forwards_run == 0
    assert step.stats.mechanisms == {"per-row gradients": step.stats.update_calls}
    assert step.stats.peak_buffer_bytes > 0


def test_reweight_needs_a_per_row_scalar_output():
    config = dataclasses.replace(FLOW, level="model")
    with pytest.raises(ValueError, match="per-row scalar output.*wrap the whole step"):
        run(ToyFlowPolicy(steps=4), flow_grpo_loop, config, "reweight")


def test_flow_grpo_loop_with_kl_to_a_frozen_reference_retain():
    base = ToyFlowPolicy(steps=4)
    reference_policy = copy.deepcopy(base).requires_grad_(False)
    config = dataclasses.replace(FLOW, level="model", beta=0.05, iterations=3)
    reference, _ = run(base, flow_grpo_loop, config, compiler=None,
                       reference=reference_policy)
    result, step = run(base, flow_grpo_loop, config, "retain", reference=reference_policy)
    assert_same(result, reference, 1e-6)
    assert step.stats.forwards_run == 0


@pytest.mark.parametrize("level,schedule,tol", [("model", "retain", 1e-6),
                                                ("step", "reweight", 1e-5)])
def test_dance_grpo_loop(toy, level, schedule, tol):
    """One sample per training call (batch 1, a graph Dynamo specialises) against rollout
    calls of the whole batch; one initial latent per group; DanceGRPO's SDE."""
    config = dataclasses.replace(DANCE, level=level, iterations=3)
    reference, _ = run(toy, dance_grpo_loop, config, compiler=None)
    result, step = run(toy, dance_grpo_loop, config, schedule)
    assert_same(result, reference, tol)
    assert step.stats.forwards_run == 0, step.stats.summary()


def test_two_optimizer_steps_per_rollout_recompute_after_the_first():
    base = ToyFlowPolicy(steps=4)
    config = dataclasses.replace(FLOW, level="model", optimizer_steps=2)
    reference, _ = run(base, flow_grpo_loop, config, compiler=None)
    result, step = run(base, flow_grpo_loop, config, "retain")
    assert_same(result, reference, 1e-6)
    stats = step.stats
    assert 0 < stats.reused_calls < stats.update_calls
    assert stats.forwards_run == stats.update_calls - stats.reused_calls
    assert any("parameters changed since the rollout" in r for r in stats.recomputed)


# ---------------------------------------------------------------------------------------------
# Guards, on a small MLP policy


def toy_loop_once(policy, fn, *, perturb=None, change_params=False, noise=None):
    """One rollout of 4 steps (batch 4) and an update over the first 3 steps in batches of 2;
    returns the gradients."""
    gen = torch.Generator().manual_seed(0)
    cond = {"prompt_embeds": torch.randn(4, 3, generator=gen)}
    x = policy.initial_latents(4, gen)
    xs = [x]
    rollout = getattr(fn, "rollout", None)
    with (rollout(train=3) if rollout else torch.no_grad()), torch.no_grad():
        for k in range(4):
            v = fn(x, torch.full((4,), k), cond)
            x = x + 0.1 * v
            xs.append(x)
    if change_params:
        with torch.no_grad():
            next(policy.parameters()).add_(0.01)
    update = getattr(fn, "update", None)
    policy.zero_grad(set_to_none=True)
    with (update() if update else torch.enable_grad()):
        for rows in (torch.tensor([2, 0]), torch.tensor([1, 3])):
            for k in range(3):
                xin = xs[k][rows].clone()
                if perturb is not None and k == perturb:
                    xin[1] += 1e-3
                v = fn(xin, torch.full((2,), k), {"prompt_embeds": cond["prompt_embeds"][rows]})
                v.square().mean().backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


def _guard(case, step_kwargs=None, **kwargs):
    torch._dynamo.reset()
    base = ToyFlowPolicy(steps=4)
    plain = copy.deepcopy(base)
    reference = toy_loop_once(plain, leancompile.lean_compile(plain.velocity,
                                                              backend="aot_eager"), **kwargs)
    wrapped = copy.deepcopy(base)
    step = leancompile.lean_compile(wrapped.velocity, backend="aot_eager", schedule="retain",
                                    **(step_kwargs or {}))
    got = toy_loop_once(wrapped, step, **kwargs)
    assert rel_l2(got, reference) <= 1e-6, case
    return step.stats


def test_perturbed_input_row_recomputes_that_call():
    stats = _guard("perturbed", perturb=1)
    assert stats.update_calls == 6 and stats.reused_calls == 4
    [(reason, count)] = stats.recomputed.items()
    assert count == 2 and reason == "row 1: inputs not seen in the rollout", stats.summary()


def test_parameters_changed_by_hand_recompute():
    stats = _guard("changed", change_params=True)
    assert stats.reused_calls == 0 and stats.forwards_run == 6
    assert any("parameters changed since the rollout" in r for r in stats.recomputed)


def test_fallback_raise_refuses_a_local_recompute_but_not_a_parameter_change():
    """``fallback="raise"`` (graphs with collectives, the fsdp trainer): a call that cannot
    reuse what was kept is an error, not a recompute on this process alone; after a parameter
    change every call recomputes (the same on every rank), so that still runs."""
    with pytest.raises(RuntimeError, match=r"row 1: inputs not seen in the rollout.*"
                                           r"fallback='raise'"):
        _guard("perturbed", {"fallback": "raise"}, perturb=1)
    stats = _guard("changed", {"fallback": "raise"}, change_params=True)
    assert stats.forwards_run == 6
    with pytest.raises(ValueError, match="fallback='nope'"):
        StepConfig(fallback="nope")
    with pytest.raises(ValueError, match="defer_reductions=True with schedule='auto'"):
        StepConfig(schedule="auto", defer_reductions=True)


def test_dropout_is_refused_with_the_fix_or_recomputed():
    policy = ToyFlowPolicy(dropout=0.1).train()
    for schedule in ("retain", "reweight", "auto"):
        step = leancompile.lean_compile(policy.velocity, backend="aot_eager", schedule=schedule)
        with pytest.raises(RandomOpInGraphError, match=r"model\.eval\(\).*schedule='recompute'"):
            toy_loop_once(policy, step)
    step = leancompile.lean_compile(policy.velocity, backend="aot_eager", schedule="recompute")
    toy_loop_once(policy, step)
    assert step.stats.forwards_run == step.stats.update_calls == 6


def test_outside_the_phases_it_is_the_compiled_function():
    policy = ToyFlowPolicy()
    step = leancompile.lean_compile(policy.velocity, backend="aot_eager", schedule="auto")
    x, k = torch.randn(3, 8), torch.zeros(3, dtype=torch.long)
    cond = {"prompt_embeds": torch.randn(3, 3)}
    out = step(x, k, cond)
    ref = policy.velocity(x, k, cond)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    ref.sum().backward()
    for a, p in zip(grads, policy.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_option_errors():
    policy = ToyFlowPolicy()
    with pytest.raises(ValueError, match="schedule='fast'"):
        leancompile.lean_compile(policy.velocity, schedule="fast")
    with pytest.raises(TypeError, match=r"\['sample_arg'\] go with schedule"):
        leancompile.lean_compile(policy.velocity, sample_arg="prev_sample")
    with pytest.raises(ValueError, match="sample_output and sample_arg go together"):
        leancompile.lean_compile(policy.velocity, schedule="retain", sample_arg="x")
    with pytest.raises(ValueError, match="lean_compile"):
        torch.compile(policy.velocity, backend=leancompile.backend(schedule="retain"))


def test_reweight_refuses_a_loss_on_a_non_scalar_output():
    """The KL built outside the step from its ``mean`` output: reweight kept gradients of the
    per-row log-prob only, and says which output it cannot serve."""
    base = ToyFlowPolicy(steps=4)
    reference_policy = copy.deepcopy(base).requires_grad_(False)
    config = dataclasses.replace(FLOW, level="step", beta=0.05)
    with pytest.raises(ValueError, match=r"also depends on output 2 \(shape \(2, 8\)\)"):
        run(base, flow_grpo_loop, config, "reweight", reference=reference_policy)


def _gaussian_step(layer, *, detach_in_log_prob: bool, through_buffer: bool = False):
    """A sampling step as users write it: draws ``mean + std * noise`` when no ``prev_sample``
    is given (not detached, as FlowGRPO's ``sde_step_with_logprob``), scores either.
    ``through_buffer``: the log-prob reads the sample from a buffer it was written into."""
    def step(x, noise=None, prev_sample=None):
        mean = layer(x)
        sample = mean + 0.5 * noise if prev_sample is None else prev_sample.detach()
        read = sample.detach() if detach_in_log_prob else sample
        if through_buffer:
            buffer = torch.zeros(x.shape[0], 2, x.shape[1])
            buffer[:, 1] = read
            read = buffer[:, 1]
        return sample, -((read - mean) ** 2).sum(1) / 0.5
    return step


def _sampling_step(compiler: str):
    """A Linear's ``_gaussian_step`` (log-prob of the detached sample) under
    ``lean_compile(schedule="retain")``, the sample passed back as ``prev_sample``: (layer,
    step_fn, x, noise, step), seeded."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    step_fn = _gaussian_step(layer, detach_in_log_prob=True)
    x, noise = torch.randn(4, 8), torch.randn(4, 8)
    step = leancompile.lean_compile(step_fn, backend=compiler, schedule="retain",
                                    sample_output=0, sample_arg="prev_sample")
    return layer, step_fn, x, noise, step


def _gaussian_loop(layer, step, x, noise, *, with_sample_term: bool):
    """One rollout call and its update; the update's loss optionally also reads the sample it
    passed back (a constant there). Returns the weight's gradient."""
    layer.zero_grad()
    with step.rollout(), torch.no_grad():
        sample, _ = step(x, noise=noise)
    with step.update():
        out, log_prob = step(x, prev_sample=sample)
        loss = (log_prob * torch.arange(4.0)).sum()
        (loss + out.sum() if with_sample_term else loss).backward()
    return layer.weight.grad.clone()


@pytest.mark.parametrize("schedule,through_buffer", [("retain", False), ("reweight", False),
                                                     ("auto", True)])
def test_a_log_prob_of_the_undetached_sample_is_refused(schedule, through_buffer):
    """The rollout's log-prob read the drawn sample without detaching it: the rollout's backward
    differentiates through the sample (here to exactly zero), the update's holds it constant.
    Reusing it would be a silently wrong gradient; it is refused with the fix, and recompute
    gives eager autograd's gradient."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    step_fn = _gaussian_step(layer, detach_in_log_prob=False, through_buffer=through_buffer)
    x, noise = torch.randn(4, 8), torch.randn(4, 8)
    step = leancompile.lean_compile(step_fn, backend="aot_eager", schedule=schedule,
                                    sample_output=0, sample_arg="prev_sample")
    with pytest.raises(ValueError, match=r"carries gradient into output\(s\) \[1\].*"
                                         r"prev_sample\.detach\(\).*schedule='recompute'"):
        _gaussian_loop(layer, step, x, noise, with_sample_term=False)
    step = leancompile.lean_compile(step_fn, backend="aot_eager", schedule="recompute",
                                    sample_output=0, sample_arg="prev_sample")
    got = _gaussian_loop(layer, step, x, noise, with_sample_term=False)
    sample = layer(x).detach() + 0.5 * noise
    layer.zero_grad()
    (step_fn(x, prev_sample=sample)[1] * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(got, layer.weight.grad)
    assert layer.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("schedule,compiler", [("retain", "aot_eager"), ("reweight", "aot_eager"),
                                               ("retain", "inductor")])
def test_a_loss_on_the_passed_back_sample_brings_no_gradient(schedule, compiler):
    """FlowGRPO's spelling (the drawn sample differentiable, the log-prob reading it detached)
    reuses the rollout; an update loss that also reads the sample output gets no gradient from
    it (the update passed it in), as in eager autograd, although the rollout graph that drew it
    differentiates it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    step_fn = _gaussian_step(layer, detach_in_log_prob=True)
    x, noise = torch.randn(4, 8), torch.randn(4, 8)
    step = leancompile.lean_compile(step_fn, backend=compiler, schedule=schedule,
                                    sample_output=0, sample_arg="prev_sample")
    got = _gaussian_loop(layer, step, x, noise, with_sample_term=True)
    assert step.stats.reused_calls == 1 and step.stats.forwards_run == 0, step.stats.summary()
    sample = layer(x).detach() + 0.5 * noise
    layer.zero_grad()
    out, log_prob = step_fn(x, prev_sample=sample)
    ((log_prob * torch.arange(4.0)).sum() + out.sum()).backward()
    torch.testing.assert_close(got, layer.weight.grad, rtol=1e-6, atol=1e-6)


def test_loop_bench_reports_ratios_reuse_and_regroup_cost():
    from leancompile.benchmarks.loop import format_table, run_loop_bench

    torch._dynamo.reset()
    # (one single-stream FLUX block: a capture costs 0.67 of the 1+1 model's)
    report = run_loop_bench(rounds=1, steps=2, layers=0, single_layers=1, hidden=64, latent=8,
                            log=lambda *a: None)
    assert report["ideal_ratio"] > 1
    for name in ("lean aligned", "lean regrouped"):
        entry = report["variants"][name]
        assert entry["forwards_run"] == 0 and entry["reused_calls"] == entry["update_calls"] > 0
        assert entry["grad_rel_l2"] <= 1e-6 and entry["ratio_median"] > 0
    assert report["variants"]["lean aligned"]["mechanisms"] == {"whole kept calls": 2}
    assert report["variants"]["lean regrouped"]["gathered_mib"] > 0
    text = format_table(report)
    assert "ideal ratio" in text and "regrouped rows" in text


def test_explain_a_step_shows_what_each_schedule_keeps(flux):
    """``leancompile.explain(step, *args)``: per graph, retain's kept bytes, whether regrouped
    rows are gathered, reweight's per-row gradients and rows per vectorised backward, and the
    pipeline's report with its ``lean_grpo`` stage."""
    torch._dynamo.reset()
    policy = copy.deepcopy(flux)
    config = dataclasses.replace(FLOW, level="step")
    step = leancompile.lean_compile(make_step(policy, config), backend="aot_eager",
                                    schedule="reweight", sample_output=0,
                                    sample_arg="prev_sample", reweight_rows=3)
    conditions = policy.example_conditions(4, torch.Generator().manual_seed(1),
                                           sequence_length=8)
    latents = policy.initial_latents(4, torch.Generator().manual_seed(0)).float()
    k = torch.full((4,), 1, dtype=torch.long)
    report = leancompile.explain(step, latents, k, conditions, noise=torch.randn_like(latents))
    text = str(report)
    assert "retain keeps" in text and "gathered row by row" in text, text
    assert "3 row(s) per vectorised backward" in text, text
    assert "lean_grpo" in text, text


# ---------------------------------------------------------------------------------------------
# Inputs a review found giving other gradients than eager autograd (each now reused exactly,
# recomputed with its reason, or refused); small MLPs, against the same loop unwrapped.


def _mlp(out=1):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, out))


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _adamw_windows(model, call, lean=None):
    """Two accumulation windows of 2 rows, a fused AdamW step after each (fused and 8-bit
    optimizers change parameters without bumping their version counters)."""
    torch.manual_seed(0)
    x, adv = torch.randn(4, 4), torch.tensor([1.0, -1.0, 0.5, 2.0])
    if lean is not None:
        with lean.rollout(), torch.no_grad():
            lean(x)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    windows = []
    with (lean.update() if lean is not None else contextlib.nullcontext()):
        for rows in ([0, 1], [2, 3]):
            optimizer.zero_grad()
            (-(adv[rows] * call(x[rows])).sum()).backward()
            windows.append(_grads(model))
            optimizer.step()
    return windows, dict(model.named_parameters())


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_a_fused_optimizer_step_makes_what_was_kept_stale(schedule):
    model, reference = _mlp(), _mlp()
    step = leancompile.lean_compile(lambda x: model(x).squeeze(-1), backend="aot_eager",
                                    schedule=schedule)
    got, params = _adamw_windows(model, step, step)
    want, ref_params = _adamw_windows(reference, lambda x: reference(x).squeeze(-1))
    for a, b in zip(got, want):
        assert rel_l2(a, b) <= 1e-6
    assert rel_l2(params, ref_params) <= 1e-6
    assert step.stats.reused_calls == 1, step.stats.summary()
    assert any("AdamW.step() ran" in r for r in step.stats.recomputed), step.stats.summary()


def _weighted_rollout_and_update(model, reference, schedule, *, between=None):
    """One rollout call on 4 rows and the update repeating it (a per-row weighted loss), with
    ``between()`` run in between; the reference's gradient taken eagerly. Returns the step."""
    step = leancompile.lean_compile(lambda x: model(x).squeeze(-1), backend="aot_eager",
                                    schedule=schedule)
    x = torch.randn(4, 4)
    with step.rollout(), torch.no_grad():
        step(x)
    if between is not None:
        between()
    with step.update():
        (step(x) * torch.arange(4.0)).sum().backward()
    (reference(x).squeeze(-1) * torch.arange(4.0)).sum().backward()
    return step


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_a_parameter_frozen_in_the_rollout_and_trained_in_the_update(schedule):
    model, reference = _mlp(), _mlp()
    model[0].weight.requires_grad_(False)

    def unfreeze():
        model[0].weight.requires_grad_(True)

    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        # Dynamo does not recompile for it (plain torch.compile leaves .grad empty there)
        with pytest.raises(RuntimeError, match=r"^0\.weight now requires grad .* without "
                                               r"compiling it again"):
            _weighted_rollout_and_update(model, reference, schedule, between=unfreeze)
        return
    step = _weighted_rollout_and_update(model, reference, schedule, between=unfreeze)
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6
    assert any("requires_grad" in r for r in step.stats.recomputed), step.stats.summary()


def test_a_parameter_unfrozen_without_a_recompile_is_refused():
    """What torch 2.11's Dynamo does after a parameter frozen at compile time is unfrozen (it
    runs the old graph; emulated here by skipping Dynamo's guards): the call is refused, where
    its backward would leave the parameter's gradient silently empty."""
    model = _mlp()
    model[0].weight.requires_grad_(False)
    step = leancompile.lean_compile(lambda x: model(x).squeeze(-1), backend="aot_eager",
                                    schedule="retain")
    x = torch.randn(4, 4)
    step(x).sum().backward()
    model[0].weight.requires_grad_(True)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True), \
            pytest.raises(RuntimeError, match=r"^0\.weight now requires grad but did not when "
                                              r"this graph was compiled"):
        step(x).sum().backward()
    assert model[0].weight.grad is None


def test_a_batch_independent_output_of_an_update_made_of_two_kept_calls():
    """A Gaussian policy returning its log-std (an entropy bonus reads it): the rollout in two
    calls of 2 rows, the update in one call of all 4. The log-std's cotangent counts once."""
    class Gaussian(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.net = torch.nn.Linear(4, 4)
            self.log_std = torch.nn.Parameter(torch.full((4,), -0.5))

        def forward(self, x, action):
            std = self.log_std.exp()
            log_prob = (-((action - self.net(x)) / std) ** 2 / 2 - self.log_std).sum(1)
            return log_prob, self.log_std * 1.0

    torch.manual_seed(0)
    x, action, adv = torch.randn(4, 4), torch.randn(4, 4), torch.tensor([1.0, -1.0, 0.5, 2.0])

    def loss(log_prob, log_std):
        return -(adv * log_prob).mean() - 0.1 * log_std.sum()

    policy, reference = Gaussian(), Gaussian()
    step = leancompile.lean_compile(policy, backend="aot_eager", schedule="retain")
    with step.rollout(), torch.no_grad():
        step(x[:2], action[:2])
        step(x[2:], action[2:])
    with step.update():
        loss(*step(x, action)).backward()
    assert step.stats.mechanisms == {"whole kept calls": 1}, step.stats.summary()
    loss(*reference(x, action)).backward()
    assert rel_l2(_grads(policy), _grads(reference)) <= 1e-6


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_an_output_edited_in_place_after_the_rollout_is_recomputed(schedule):
    model, reference = _mlp(out=4), _mlp(out=4)
    fn = (lambda x: torch.tanh(model(x))) if schedule == "retain" else \
        (lambda x: (torch.tanh(model(x)), model(x).sum(1)))
    step = leancompile.lean_compile(fn, backend="aot_eager", schedule=schedule)
    x = torch.randn(4, 4)
    with step.rollout(), torch.no_grad():
        out = step(x)
        (out if schedule == "retain" else out[0]).mul_(0.1)  # the sampler's Euler step
    with step.update():
        out = step(x)
        loss = out.square().sum() if schedule == "retain" else (out[1] * torch.arange(4.)).sum()
        loss.backward()
    out = torch.tanh(reference(x))
    (out.square().sum() if schedule == "retain" else
     (reference(x).sum(1) * torch.arange(4.)).sum()).backward()
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6
    assert any("changed in place" in r for r in step.stats.recomputed), step.stats.summary()


def test_equal_rows_of_two_samples_each_reach_their_own_buffer():
    """Reweight with one buffer per sample, two samples equal at the first step (DanceGRPO's
    shared initial noise): each update row takes its own kept row."""
    model, reference = _mlp(), _mlp()
    step = leancompile.lean_compile(lambda x: model(x).squeeze(-1), backend="aot_eager",
                                    schedule="reweight")
    torch.manual_seed(0)
    xs = [torch.randn(4, 4) for _ in range(2)]
    xs[0][1] = xs[0][0]
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    with step.rollout(samples=torch.arange(4).repeat(2, 1)), torch.no_grad():
        for x in xs:
            step(x)
    with step.update():
        for x in xs:
            (-(adv * step(x)).sum()).backward()
    for x in xs:
        (-(adv * reference(x).squeeze(-1)).sum()).backward()
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6
    assert step.stats.forwards_run == 0, step.stats.summary()


@pytest.mark.parametrize("op", ["flip", "batch size", "masked_scatter"])
@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_rows_mixed_by_a_reversal_a_masked_scatter_or_the_batch_size(op, schedule):
    """Ops whose rows depend on other rows or on the batch size: the update's rows come in
    another grouping (retain) or one row at a time (reweight's per-row backward), and must be
    recomputed or taken whole."""
    model, reference = _mlp(out=4), _mlp(out=4)
    mix = {"flip": lambda h: h.flip(0), "batch size": lambda h: h / h.shape[0],
           "masked_scatter": lambda h: torch.zeros_like(h).masked_scatter(h > 0, h)}[op]

    def fn(x, net=model):
        h = mix(torch.tanh(net(x)))
        return h if schedule == "retain" else h.sum(1)

    step = leancompile.lean_compile(fn, backend="aot_eager", schedule=schedule)
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    with step.rollout(), torch.no_grad():
        step(x)
    weights = torch.arange(1.0, 17.0).reshape(4, 4)
    batches = ([2, 0], [3, 1]) if schedule == "retain" else ([0, 1, 2, 3],)
    outputs = []
    with step.update():
        for rows in batches:
            out = step(x[rows])
            outputs.append(out.detach())
            (out.exp() * weights[rows].reshape(out.shape[0], -1)[:, :out[0].numel()]
             .reshape(out.shape)).sum().backward()
    for rows, got in zip(batches, outputs):
        out = fn(x[rows], reference)
        torch.testing.assert_close(got, out.detach())
        (out.exp() * weights[rows].reshape(out.shape[0], -1)[:, :out[0].numel()]
         .reshape(out.shape)).sum().backward()
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_parameters_written_through_data_make_what_was_kept_stale(schedule):
    """Manual SGD through ``.data`` between the rollout and the update: no version counter
    moves; the values' digest does."""
    model, reference = _mlp(), _mlp()

    def manual_sgd():
        for p, q in zip(model.parameters(), reference.parameters()):
            p.data.add_(0.1)
            q.data.add_(0.1)

    step = _weighted_rollout_and_update(model, reference, schedule, between=manual_sgd)
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6
    assert any("written through .data" in r for r in step.stats.recomputed), step.stats.summary()


def test_parameters_that_are_views_of_one_flat_buffer():
    """Parameters at offsets no word size divides (a flat buffer, as ZeRO-style sharding keeps
    them): the digest reads them; the update reuses the rollout and matches eager."""
    from torch.nn.utils import parameters_to_vector

    model, reference = _mlp(), _mlp()
    flat = torch.cat([torch.zeros(1), parameters_to_vector(model.parameters()).detach()])
    offset = 0
    for p in model.parameters():  # from offset 1 (4 bytes): not a multiple of 8
        p.data = flat[1 + offset:1 + offset + p.numel()].view_as(p)
        offset += p.numel()
    step = _weighted_rollout_and_update(model, reference, "retain")
    assert step.stats.reused_calls == 1, step.stats.summary()
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6


def test_a_sampling_step_without_a_named_sample_says_how_to_name_it():
    """The rollout calls the step with ``noise=``, the update with ``prev_sample=``: two graphs,
    so nothing is reused (the update's gradient is recomputed, exactly); the reason names both
    arguments and the options that let the update reuse the rollout's forward."""
    model, reference = _mlp(4), _mlp(4)

    def step(net, x, noise=None, prev_sample=None):
        mean = net(x)
        sample = mean + noise if prev_sample is None else prev_sample
        return sample, -((sample - mean) ** 2).sum(1)

    wrapped = leancompile.lean_compile(lambda x, **kw: step(model, x, **kw),
                                       backend="aot_eager", schedule="retain")
    x, noise = torch.randn(4, 4), torch.randn(4, 4)
    with wrapped.rollout(), torch.no_grad():
        sample, _ = wrapped(x, noise=noise)
    with wrapped.update():
        wrapped(x, prev_sample=sample)[1].sum().backward()
    step(reference, x, prev_sample=sample)[1].sum().backward()
    assert rel_l2(_grads(model), _grads(reference)) <= 1e-6
    [reason] = wrapped.stats.recomputed
    assert "this call passes prev_sample, the rollout's passed noise" in reason
    assert "sample_output=" in reason and "sample_arg='prev_sample'" in reason
