"""SDE transitions (leancompile.grpo.sde) against independent references: diffusers' Euler step,
float64 closed forms of the means, torch.distributions for log-probs and KL."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch.distributions import Normal, kl_divergence

from leancompile.grpo.sde import SDE_KINDS, SDEStep, kl_to_reference, sde_step

SHAPE = (3, 2, 4, 4)
SIGMA = torch.tensor([1.0, 0.62, 0.25])        # includes sigma == 1 (flow_grpo's special case)
SIGMA_NEXT = torch.tensor([0.9, 0.41, 0.0])    # includes the final step, sigma_next == 0
SIGMA_MAX = 0.93


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, v, noise = (torch.randn(SHAPE, generator=g).to(dtype) for _ in range(3))
    return x, v, noise


def _col(t):
    return t.double().reshape(-1, *([1] * (len(SHAPE) - 1)))


def _reference(kind, x, v, s, s_next, eta, sigma_max=SIGMA_MAX):
    """(mean, std) in float64 from the closed forms, written independently of the module:
    both Gaussian kinds are ``x + dt*v - g^2/2 * score * dt`` with the flow-matching score
    ``-(x + (1 - s) v) / s``; cps interpolates ``x0`` and ``x1`` with ``s'*cos(eta pi/2)``."""
    x, v, s, s_next = x.double(), v.double(), _col(s), _col(s_next)
    dt = s_next - s
    score = -(x + (1 - s) * v) / s
    if kind == "flow_grpo":
        s_den = torch.where(s == 1, torch.full_like(s, sigma_max), s)
        g = eta * torch.sqrt(s / (1 - s_den))
        return x + dt * v - 0.5 * g**2 * score * dt, g * torch.sqrt(-dt)
    if kind == "dance_grpo":
        return x + dt * v - 0.5 * eta**2 * score * dt, eta * torch.sqrt(-dt)
    x0, x1 = x - s * v, x + (1 - s) * v
    return x0 * (1 - s_next) + x1 * s_next * math.cos(eta * math.pi / 2), \
        s_next * math.sin(eta * math.pi / 2)


def _step(kind, x, v, eta=0.7, **kw):
    kw.setdefault("sigma", SIGMA)
    kw.setdefault("sigma_next", SIGMA_NEXT)
    return sde_step(kind, latents=x, velocity=v, eta=eta, sigma_max=SIGMA_MAX, **kw)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_eta_zero_is_diffusers_euler_step(kind):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    sigmas = scheduler.sigmas
    assert sigmas[0] == 1 and sigmas[-1] == 0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 3, generator=g)
    for k, t in enumerate(scheduler.timesteps):
        v = torch.randn(x.shape, generator=g)
        expected = scheduler.step(model_output=v, timestep=t, sample=x).prev_sample
        # no sigma_max, no noise: neither is needed for a deterministic step
        got = sde_step(kind, latents=x, velocity=v, sigma=sigmas[k].expand(2),
                       sigma_next=sigmas[k + 1], eta=0.0)
        assert torch.equal(got.prev_sample, expected), f"step {k}"
        assert torch.equal(got.mean, expected)
        assert torch.equal(got.log_prob, torch.zeros(2))
        # scoring with eta == 0 is finite (zeros) too
        scored = sde_step(kind, latents=x, velocity=v, sigma=sigmas[k], sigma_next=sigmas[k + 1],
                          eta=0.0, prev_sample=expected + 1)
        assert torch.equal(scored.log_prob, torch.zeros(2))
        x = expected


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_mean_std_and_sample_match_float64_closed_form(kind):
    x, v, noise = _inputs()
    step = _step(kind, x, v, eta=0.7, noise=noise)
    mean, std = _reference(kind, x, v, SIGMA, SIGMA_NEXT, 0.7)
    torch.testing.assert_close(step.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.std.double().expand(SHAPE), torch.as_tensor(std).expand(SHAPE)
                               .double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(step.prev_sample.double(), mean + std * noise.double(),
                               rtol=1e-5, atol=1e-5)
    for t in (step.prev_sample, step.log_prob, step.mean, step.std, step.kl_std):
        assert t.dtype == torch.float32
    assert step.log_prob.shape == (3,)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo"])
def test_gaussian_log_prob_matches_torch_distributions(kind):
    x, v, noise = _inputs(2)
    given = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    step = _step(kind, x, v, eta=0.7, prev_sample=given)
    mean, std = _reference(kind, x, v, SIGMA, SIGMA_NEXT, 0.7)
    expected = Normal(mean, std.expand(SHAPE)).log_prob(given.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(step.prev_sample, given)


def test_cps_log_prob_is_negative_mean_square():
    x, v, noise = _inputs(4)
    given = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    step = _step("flow_grpo_cps", x, v, eta=0.8, prev_sample=given)
    mean, _ = _reference("flow_grpo_cps", x, v, SIGMA, SIGMA_NEXT, 0.8)
    expected = -((given.double() - mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    # at the final step (sigma_next == 0) the cps std is 0: the sample is the mean, log-prob 0
    sampled = _step("flow_grpo_cps", x, v, eta=0.8, noise=noise)
    assert sampled.std.reshape(-1)[2] == 0
    assert torch.equal(sampled.prev_sample[2], sampled.mean[2])
    assert sampled.log_prob[2] == 0 and torch.isfinite(sampled.log_prob).all()


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_rescoring_the_sample_gives_the_same_log_prob(kind):
    x, v, noise = _inputs(6)
    drawn = _step(kind, x, v, noise=noise)
    scored = _step(kind, x, v, prev_sample=drawn.prev_sample)
    assert torch.equal(scored.log_prob, drawn.log_prob)
    assert torch.equal(scored.mean, drawn.mean)
    # a different sample has a different (lower, here) log-prob
    other = _step(kind, x, v, prev_sample=drawn.prev_sample + 0.5)
    assert (other.log_prob[:2] < drawn.log_prob[:2]).all()


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_gradient_reaches_velocity_only_through_the_mean(kind):
    x, v, noise = _inputs(7)
    given = (x + 0.3 * noise).requires_grad_()
    v32 = v.clone().requires_grad_()
    step = _step(kind, x, v32, eta=0.7, prev_sample=given)
    step.log_prob.sum().backward()
    assert given.grad is None and not step.prev_sample.requires_grad
    # reference gradient: float64 autograd through the closed form
    v64 = v.double().requires_grad_()
    mean, std = _reference(kind, x, v64, SIGMA, SIGMA_NEXT, 0.7)
    if kind == "flow_grpo_cps":
        ref = -((given.detach().double() - mean) ** 2).mean(dim=(1, 2, 3))
    else:
        ref = Normal(mean, std.expand(SHAPE)).log_prob(given.detach().double()).mean(dim=(1, 2, 3))
    ref.sum().backward()
    torch.testing.assert_close(v32.grad.double(), v64.grad, rtol=1e-4, atol=1e-5)
    assert v32.grad.abs().sum() > 0

    # sampling: the returned sample is detached, the log-prob still depends on the velocity
    v2 = v.clone().requires_grad_()
    drawn = _step(kind, x, v2, eta=0.7, noise=noise)
    assert not drawn.prev_sample.requires_grad
    drawn.log_prob[:2].sum().backward()
    assert v2.grad[:2].abs().sum() > 0


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_per_sample_sigmas_equal_scalar_calls(kind):
    x, v, noise = _inputs(8)
    batched = _step(kind, x, v, noise=noise)
    for b in range(SHAPE[0]):
        single = _step(kind, x[b:b + 1], v[b:b + 1], noise=noise[b:b + 1],
                       sigma=float(SIGMA[b]), sigma_next=float(SIGMA_NEXT[b]))
        torch.testing.assert_close(single.prev_sample, batched.prev_sample[b:b + 1],
                                   rtol=0, atol=0)
        torch.testing.assert_close(single.log_prob, batched.log_prob[b:b + 1],
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(single.std.expand(1, 1, 1, 1), batched.std[b:b + 1],
                                   rtol=0, atol=0)


def test_float32_math_for_low_precision_inputs():
    x, v, noise = _inputs(9)
    low = _step("flow_grpo", x.bfloat16(), v.bfloat16(), noise=noise.bfloat16())
    full = _step("flow_grpo", x.bfloat16().float(), v.bfloat16().float(),
                 noise=noise.bfloat16().float())
    assert low.prev_sample.dtype == low.log_prob.dtype == torch.float32
    assert torch.equal(low.log_prob, full.log_prob)


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")  # torch's own test backend
@pytest.mark.parametrize("kind", SDE_KINDS)
def test_traces_under_torch_compile_without_breaks_or_random_ops(kind):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    x, v, noise = _inputs(10)

    def step(x, v, sigma, sigma_next, noise, eta):
        out = sde_step(kind, latents=x, velocity=v, sigma=sigma, sigma_next=sigma_next,
                       eta=eta, noise=noise, sigma_max=SIGMA_MAX)
        return out.prev_sample, out.log_prob

    eager_v = v.clone().requires_grad_()
    ref_sample, ref_lp = step(x, eager_v, SIGMA, SIGMA_NEXT, noise, 0.7)
    ref_lp.sum().backward()

    # the aot_eager backend, keeping the aten graphs it runs
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    comp_v = v.clone().requires_grad_()
    sample, lp = compiled(x, comp_v, SIGMA, SIGMA_NEXT, noise, 0.7)
    lp.sum().backward()
    torch.testing.assert_close(sample, ref_sample, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comp_v.grad, eager_v.grad, rtol=1e-5, atol=1e-6)

    assert len(backend.graphs) == 1 and len(backend.fw_graphs) == 1
    for gm in backend.fw_graphs + backend.bw_graphs:
        for node in gm.graph.nodes:
            tags = getattr(node.target, "tags", ())
            assert torch.Tag.nondeterministic_seeded not in tags, node.format_node()


def test_zero_std_gaussian_step_is_finite():
    # a degenerate step (sigma_next == sigma) has std 0 for the Gaussian kinds: log-prob 0
    x, v, noise = _inputs(11)
    for kind in ("flow_grpo", "dance_grpo"):
        vg = v.clone().requires_grad_()
        step = _step(kind, x, vg, sigma=torch.tensor([0.5, 0.5, 0.5]),
                     sigma_next=torch.tensor([0.5, 0.3, 0.5]), noise=noise)
        assert step.log_prob[0] == 0 and step.log_prob[2] == 0 and step.log_prob[1] != 0
        step.log_prob.sum().backward()
        assert torch.isfinite(vg.grad).all()


def test_errors_name_the_problem():
    x, v, noise = _inputs(12)
    with pytest.raises(ValueError, match="kind='ddim'.*flow_grpo"):
        sde_step("ddim", latents=x, velocity=v, sigma=0.5, sigma_next=0.4, eta=0.7, noise=noise)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step("flow_grpo", latents=x, velocity=v, sigma=0.5, sigma_next=0.4, eta=0.7,
                 noise=noise)
    with pytest.raises(ValueError, match="both noise and prev_sample"):
        _step("dance_grpo", x, v, noise=noise, prev_sample=x)
    with pytest.raises(ValueError, match="neither noise nor prev_sample"):
        _step("dance_grpo", x, v)
    with pytest.raises(ValueError, match=r"sigma has shape \(2,\)"):
        _step("dance_grpo", x, v, sigma=torch.tensor([0.5, 0.4]), noise=noise)
    with pytest.raises(ValueError, match="velocity has shape"):
        _step("dance_grpo", x, v[:2], noise=noise)
    with pytest.raises(ValueError, match="eta=-0.1"):
        _step("dance_grpo", x, v, eta=-0.1, noise=noise)
    with pytest.raises(TypeError, match="eta must be a Python float"):
        _step("dance_grpo", x, v, eta=torch.tensor(0.3), noise=noise)


def test_kl_to_reference_matches_gaussian_kl():
    x, v, noise = _inputs(13)
    v_ref = v + 0.1 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(14))
    step = _step("flow_grpo", x, v, noise=noise)
    ref = _step("flow_grpo", x, v_ref, prev_sample=step.prev_sample)
    exact = kl_divergence(Normal(step.mean.double(), step.std.double().expand(SHAPE)),
                          Normal(ref.mean.double(), step.std.double().expand(SHAPE)))
    exact = exact.mean(dim=(1, 2, 3))
    torch.testing.assert_close(kl_to_reference(step.mean, ref.mean, step.std).double(), exact,
                               rtol=1e-5, atol=1e-7)
    # FlowGRPO's KL divides by std_dev_t (kl_std): the exact KL times (sigma - sigma_next)
    flow = kl_to_reference(step.mean, ref.mean, step.kl_std)
    torch.testing.assert_close(flow.double(), exact * (SIGMA - SIGMA_NEXT).double(),
                               rtol=1e-5, atol=1e-7)
    # by hand, std given as a [B] tensor
    m = torch.zeros(2, 3)
    m_ref = torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.0, 3.0]])
    torch.testing.assert_close(kl_to_reference(m, m_ref, torch.tensor([1.0, 0.5])),
                               torch.tensor([3.0 / 2, 3.0 / (2 * 0.25)]))


def test_kl_to_reference_is_zero_where_std_is_zero():
    mean = torch.ones(2, 3, requires_grad=True)
    kl = kl_to_reference(mean, torch.zeros(2, 3), torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(kl, torch.tensor([0.0, 1.0 / 8]))
    kl.sum().backward()
    assert torch.isfinite(mean.grad).all() and (mean.grad[0] == 0).all()
    with pytest.raises(ValueError,
                       match=r"std has shape \(3,\); mean have shape \(2, 3\).*one value per"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))


def test_sde_step_is_a_dataclass_with_documented_fields():
    import dataclasses

    assert [f.name for f in dataclasses.fields(SDEStep)] == [
        "prev_sample", "log_prob", "mean", "std", "kl_std"]
