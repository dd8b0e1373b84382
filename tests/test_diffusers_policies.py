"""FluxPolicy, SD3Policy and WanPolicy against the real diffusers pipelines (tiny random models).

The reference is always diffusers itself: a deterministic Euler rollout with the policy must
reproduce ``pipeline(..., output_type="latent")`` from the same initial latents and prompt
embeddings, the policy's sigmas must be the pipeline scheduler's, and ``to_vae_latents`` must be
what the pipeline passes to ``vae.decode``.
"""

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers integration needs diffusers")

from diffusers import (  # noqa: E402
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)

from leancompile.integrations.diffusers import (  # noqa: E402
    FLUX_SCHEDULER_CONFIG,
    SD3_SCHEDULER_CONFIG,
    FluxPolicy,
    SD3Policy,
    WanPolicy,
    select_conditions,
)

STEPS = 3
BATCH = 2
SEQ = 6  # text tokens


class _Decoded(Exception):
    """Raised by a patched ``vae.decode`` to stop the pipeline once its input is captured."""


def _tiny_kl_vae():
    # One block: vae_scale_factor 2 ** 0 = 1; 4 latent channels.
    return AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=4, norm_num_groups=1, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035).eval()


class FluxCase:
    name = "flux"
    guidance = 3.5
    size = dict(height=16, width=16)  # vae_scale_factor 1 -> 16x16 latents, 64 packed tokens

    def __init__(self):
        torch.manual_seed(0)
        self.transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8], guidance_embeds=True).eval()
        self.vae = _tiny_kl_vae()

    def policy(self, transformer=None, **kwargs):
        kwargs = {"guidance_scale": self.guidance, **self.size, **kwargs}
        return FluxPolicy(transformer or self.transformer, num_inference_steps=STEPS,
                          vae_config=self.vae.config, **kwargs)

    def pipeline(self, **kwargs):
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG), vae=self.vae,
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
            transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run(self, pipe, policy, conditions, latents, output_type="latent"):
        return pipe(**conditions, latents=latents, num_inference_steps=STEPS,
                    guidance_scale=policy.guidance_scale, output_type=output_type,
                    **self.size).images

    def prepare_latents(self, pipe, generator):
        latents, _ = pipe.prepare_latents(BATCH, 4, self.size["height"], self.size["width"],
                                          torch.float32, torch.device("cpu"), generator)
        return latents


class SD3Case:
    name = "sd3"
    guidance = 4.5
    size = dict(height=8, width=8)  # vae_scale_factor 1, patch 1 -> 64 tokens

    def __init__(self):
        torch.manual_seed(0)
        self.transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
            pooled_projection_dim=64, out_channels=4).eval()
        self.vae = _tiny_kl_vae()

    def policy(self, transformer=None, **kwargs):
        kwargs = {"guidance_scale": self.guidance, **self.size, **kwargs}
        return SD3Policy(transformer or self.transformer, num_inference_steps=STEPS,
                         vae_config=self.vae.config, **kwargs)

    def pipeline(self):
        pipe = StableDiffusion3Pipeline(
            transformer=self.transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG), vae=self.vae,
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
            text_encoder_3=None, tokenizer_3=None)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run(self, pipe, policy, conditions, latents, output_type="latent"):
        return pipe(**conditions, latents=latents, num_inference_steps=STEPS,
                    guidance_scale=policy.guidance_scale, output_type=output_type,
                    **self.size).images

    def prepare_latents(self, pipe, generator):
        return pipe.prepare_latents(BATCH, 4, self.size["height"], self.size["width"],
                                    torch.float32, torch.device("cpu"), generator)


class WanCase:
    name = "wan"
    guidance = 5.0
    shift = 5.0
    # VAE scale 8 spatial, 4 temporal: 4x4 latents, 2 latent frames, 8 tokens of 1x2x2
    size = dict(height=32, width=32, num_frames=5)

    def __init__(self):
        torch.manual_seed(0)
        self.transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=1,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
        self.vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                    temperal_downsample=[False, True, True]).eval()

    def policy(self, transformer=None, **kwargs):
        kwargs = {"guidance_scale": self.guidance, "flow_shift": self.shift, **self.size, **kwargs}
        return WanPolicy(transformer or self.transformer, num_inference_steps=STEPS,
                         vae_config=self.vae.config, **kwargs)

    def pipeline(self, expand_timesteps=False):
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=self.vae,
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=self.shift),
                           transformer=self.transformer, expand_timesteps=expand_timesteps)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run(self, pipe, policy, conditions, latents, output_type="latent"):
        return pipe(**conditions, latents=latents, num_inference_steps=STEPS,
                    guidance_scale=policy.guidance_scale, output_type=output_type,
                    **self.size).frames

    def prepare_latents(self, pipe, generator):
        return pipe.prepare_latents(BATCH, 16, *self.size.values(), torch.float32,
                                    torch.device("cpu"), generator)


_CASES = {}


@pytest.fixture(scope="module", params=["flux", "sd3", "wan"])
def case(request):
    if request.param not in _CASES:
        _CASES[request.param] = {"flux": FluxCase, "sd3": SD3Case, "wan": WanCase}[request.param]()
    return _CASES[request.param]


def _inputs(policy, seed=0):
    conditions = policy.example_conditions(BATCH, torch.Generator().manual_seed(seed),
                                           sequence_length=SEQ)
    latents = policy.initial_latents(BATCH, torch.Generator().manual_seed(seed + 1))
    return conditions, latents


@torch.no_grad()
def euler_rollout(policy, latents, conditions):
    x = latents
    for k in range(policy.num_inference_steps):
        x = x + (policy.sigmas[k + 1] - policy.sigmas[k]) * policy.velocity(x, k, conditions)
    return x


# ---- the rollout reproduces the pipeline --------------------------------------------------


def _check_rollout(case, policy, pipe):
    conditions, x0 = _inputs(policy)
    ours = euler_rollout(policy, x0, conditions)
    with torch.no_grad():
        theirs = case.run(pipe, policy, conditions, x0.clone())
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert (ours - x0).abs().max() > 0.1, "the rollout did not move the latents"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # After the run, the pipeline's scheduler holds the schedule it used.
    torch.testing.assert_close(policy.sigmas, pipe.scheduler.sigmas, rtol=0, atol=0)
    torch.testing.assert_close(policy.timesteps, pipe.scheduler.timesteps, rtol=0, atol=0)


def test_rollout_matches_pipeline(case):
    _check_rollout(case, case.policy(), case.pipeline())


def test_sd3_without_guidance_matches_pipeline():
    case = SD3Case()
    policy = case.policy(guidance_scale=1.0)
    assert policy.condition_keys == ("prompt_embeds", "pooled_prompt_embeds")
    _check_rollout(case, policy, case.pipeline())


def test_wan_expand_timesteps_matches_pipeline():
    case = _CASES.get("wan") or WanCase()
    _check_rollout(case, case.policy(expand_timesteps=True), case.pipeline(expand_timesteps=True))


def test_to_vae_latents_is_what_the_pipeline_decodes(case, monkeypatch):
    policy, pipe = case.policy(), case.pipeline()
    conditions, x0 = _inputs(policy, seed=3)
    final = euler_rollout(policy, x0, conditions)

    def decode(latents, *args, **kwargs):
        raise _Decoded(latents)

    monkeypatch.setattr(case.vae, "decode", decode)
    with pytest.raises(_Decoded) as caught, torch.no_grad():
        case.run(pipe, policy, conditions, x0.clone(), output_type="pt")
    decoded = caught.value.args[0]
    ours = policy.to_vae_latents(final)
    assert ours.shape == decoded.shape
    torch.testing.assert_close(ours, decoded, rtol=0, atol=1e-5)


def test_initial_latents_are_drawn_like_prepare_latents(case):
    policy, pipe = case.policy(), case.pipeline()
    ours = policy.initial_latents(BATCH, torch.Generator().manual_seed(7))
    theirs = case.prepare_latents(pipe, torch.Generator().manual_seed(7))
    assert torch.equal(ours, theirs)
    generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
    ours = policy.initial_latents(BATCH, generators)
    theirs = case.prepare_latents(pipe, [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert torch.equal(ours, theirs)


# ---- the schedules, against the formulas -------------------------------------------------


def _shift(sigmas, shift):
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def test_flux_sigmas_are_linspace_with_dynamic_shift():
    policy = FluxCase().policy()
    seq_len = (16 // 2) * (16 // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (seq_len - 256)
    base = np.linspace(1.0, 1 / STEPS, STEPS)
    want = np.exp(mu) / (np.exp(mu) + (1 / base - 1))
    assert policy.mu == pytest.approx(mu)
    np.testing.assert_allclose(policy.sigmas.numpy(), np.append(want, 0.0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(policy.timesteps.numpy(), want * 1000, rtol=0, atol=1e-3)


@pytest.mark.parametrize("make, shift", [(lambda: SD3Case().policy(), 3.0),
                                         (lambda: WanCase().policy(flow_shift=5.0), 5.0)])
def test_sd3_and_wan_sigmas_are_shifted_linspace(make, shift):
    policy = make()
    # The scheduler's init shifts its 1000 training sigmas; set_timesteps spaces T points between
    # the shifted ends and shifts them again (so the last point is shift(shift(1/1000))).
    sigma_min = _shift(1 / 1000, shift)
    want = _shift(np.linspace(1.0, sigma_min, STEPS), shift)
    np.testing.assert_allclose(policy.sigmas.numpy(), np.append(want, 0.0), rtol=0, atol=1e-6)
    assert policy.sigmas.dtype == torch.float32 and policy.sigmas[-1] == 0


def test_wan_scheduler_argument_and_default_shift():
    case = WanCase()
    default = WanPolicy(case.transformer, num_inference_steps=STEPS, vae_config=case.vae.config,
                        **case.size)
    assert default.flow_shift == 3.0
    passed = WanPolicy(case.transformer, num_inference_steps=STEPS, vae_config=case.vae.config,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **case.size)
    assert torch.equal(default.sigmas, passed.sigmas)
    with pytest.raises(ValueError, match="flow_shift=5.0 disagrees"):
        WanPolicy(case.transformer, num_inference_steps=STEPS, flow_shift=5.0,
                  scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **case.size)
    with pytest.raises(TypeError, match="FlowMatchEulerDiscreteScheduler"):
        WanPolicy(case.transformer, num_inference_steps=STEPS, scheduler=UniPCMultistepScheduler(),
                  **case.size)


# ---- one step per sample, one graph for all steps -----------------------------------------


@torch.no_grad()
def test_step_tensor_equals_per_sample_int_steps(case):
    policy = case.policy()
    conditions, x = _inputs(policy, seed=5)
    steps = torch.tensor([STEPS - 1, 0])
    batched = policy.velocity(x, steps, conditions)
    for i, k in enumerate(steps.tolist()):
        single = policy.velocity(x[i:i + 1], k, policy.select_conditions(conditions, i))
        torch.testing.assert_close(batched[i:i + 1], single, rtol=0, atol=1e-5)
    # and the steps really differ
    assert (policy.velocity(x, 0, conditions)[0] - batched[0]).abs().max() > 1e-3


def test_compiled_velocity_is_one_graph_for_all_steps(case):
    # With grad (the graph a trainer compiles) for SD3's guided batch; the others without, to
    # keep the test fast: the step lookup is the same code in all three.
    with_grad = case.name == "sd3"
    policy = case.policy()
    conditions, x = _inputs(policy, seed=6)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(policy.velocity, backend=counting_backend, fullgraph=True)
    for steps in (torch.tensor([0, 2]), torch.tensor([1, 0])):
        with torch.set_grad_enabled(with_grad):
            got = compiled(x, steps, conditions)
        assert got.requires_grad == with_grad
        with torch.no_grad():
            want = policy.velocity(x, steps, conditions)
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-5)
    assert len(graphs) == 1, f"recompiled for a new step tensor: {len(graphs)} graphs"
    # The step is looked up on the device: no tensor-to-Python read (a host sync on a GPU).
    syncs = [n for n in graphs[0].graph.nodes if n.target in ("item", "tolist", int, float)]
    assert not syncs, f"step_index read back to Python: {syncs}"


# ---- gradients ----------------------------------------------------------------------------


def test_sd3_gradient_flows_through_both_cfg_halves():
    case = _CASES.get("sd3") or SD3Case()
    policy = case.policy()
    names = [name for name, _ in policy.named_parameters()]
    assert names and all(name.startswith("transformer.") for name in names)
    conditions, x = _inputs(policy, seed=8)
    conditions = {k: v.requires_grad_() for k, v in conditions.items()}
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    step = 1

    def grads():
        out = {name: p.grad.clone() for name, p in policy.named_parameters()}
        out.update({k: v.grad.clone() for k, v in conditions.items()})
        policy.zero_grad()
        for v in conditions.values():
            v.grad = None
        return out

    (policy.velocity(x, step, conditions) * weight).sum().backward()
    ours = grads()

    # Manual: two separate transformer calls, combined as the pipeline does.
    t = policy.timesteps[step].expand(BATCH)
    tr = case.transformer
    uncond = tr(hidden_states=x, timestep=t,
                encoder_hidden_states=conditions["negative_prompt_embeds"],
                pooled_projections=conditions["negative_pooled_prompt_embeds"],
                return_dict=False)[0]
    cond = tr(hidden_states=x, timestep=t, encoder_hidden_states=conditions["prompt_embeds"],
              pooled_projections=conditions["pooled_prompt_embeds"], return_dict=False)[0]
    ((uncond + policy.guidance_scale * (cond - uncond)) * weight).sum().backward()
    manual = grads()

    for key in ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                "negative_pooled_prompt_embeds"):
        assert ours[key].abs().max() > 0, f"no gradient reached {key}"
    for name, want in manual.items():
        torch.testing.assert_close(ours[name], want, rtol=1e-4, atol=1e-5, msg=name)


def test_lora_injected_with_peft_trains_through_the_policy():
    peft = pytest.importorskip("peft", reason="LoRA needs peft")
    case = _CASES.get("flux") or FluxCase()
    transformer = copy.deepcopy(case.transformer)
    before = case.policy(transformer)
    conditions, x = _inputs(before, seed=10)
    with torch.no_grad():
        reference = before.velocity(x, 1, conditions)
    transformer.add_adapter(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    transformer.requires_grad_(False)
    for name, p in transformer.named_parameters():
        p.requires_grad_("lora_" in name)
    policy = case.policy(transformer)
    v = policy.velocity(x, 1, conditions)
    torch.testing.assert_close(v, reference, rtol=0, atol=1e-6)  # LoRA B starts at zero
    v.square().sum().backward()
    lora = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert lora and all(n.startswith("transformer.") and "lora_" in n for n in lora)
    lora_b = [p for n, p in lora.items() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().max() > 0 for p in lora_b)


def test_schedule_stays_float32_when_the_policy_changes_dtype():
    case = _CASES.get("sd3") or SD3Case()
    policy = case.policy(copy.deepcopy(case.transformer))
    sigmas = policy.sigmas.clone()
    policy.to(torch.bfloat16)
    assert policy.transformer.dtype == torch.bfloat16
    assert policy.sigmas.dtype == torch.float32 and torch.equal(policy.sigmas, sigmas)
    conditions, x = _inputs(policy)
    with torch.no_grad():
        v = policy.velocity(x, 0, conditions)
    assert v.dtype == torch.float32
    assert "sigmas" not in policy.state_dict()


# ---- conditions and errors ---------------------------------------------------------------


def test_select_conditions_repeats_and_keeps_the_batch_dimension():
    policy = SD3Case().policy()
    conditions = policy.example_conditions(BATCH, torch.Generator().manual_seed(0),
                                           sequence_length=SEQ)
    assert set(conditions) == set(policy.condition_keys)
    assert conditions["prompt_embeds"].shape == (BATCH, SEQ, 32)
    assert conditions["pooled_prompt_embeds"].shape == (BATCH, 64)
    repeated = policy.select_conditions(conditions, torch.arange(BATCH).repeat_interleave(3))
    assert repeated["prompt_embeds"].shape == (3 * BATCH, SEQ, 32)
    assert torch.equal(repeated["negative_prompt_embeds"][3],
                       conditions["negative_prompt_embeds"][1])
    one = select_conditions(conditions, 1)
    assert one["pooled_prompt_embeds"].shape == (1, 64)
    assert torch.equal(one["pooled_prompt_embeds"][0], conditions["pooled_prompt_embeds"][1])


@pytest.fixture(scope="module")
def transformers():
    class Transformers:
        flux = (_CASES.get("flux") or FluxCase()).transformer
        sd3 = (_CASES.get("sd3") or SD3Case()).transformer
        wan = (_CASES.get("wan") or WanCase()).transformer
    return Transformers


def _flux(c, **kwargs):
    return FluxPolicy(c.flux, **{"num_inference_steps": 2, "height": 16, "width": 16, **kwargs})


def _sd3(c, **kwargs):
    return SD3Policy(c.sd3, **{"num_inference_steps": 2, "height": 16, "width": 16, **kwargs})


def _wan(c, **kwargs):
    return WanPolicy(c.wan, **{"num_inference_steps": 2, "height": 32, "width": 32,
                               "num_frames": 5, **kwargs})


@pytest.mark.parametrize("make, match", [
    # default VAE scale 8: FLUX packs 2x2, so multiples of 16
    (lambda c: _flux(c, height=1000, width=1024), r"multiples of \(16, 16\).*height=992"),
    (lambda c: _flux(c, height=0), "height=0 must be >= 1"),
    (lambda c: _flux(c, num_inference_steps=0), "num_inference_steps=0 must be >= 1"),
    (lambda c: _sd3(c, height=512, width=500), r"multiples of \(8, 8\).*width=496"),
    (lambda c: _sd3(c, height=8, width=8, vae_scale_factor=1).to_vae_latents(
        torch.zeros(1, 4, 9, 9)), r"latents have shape \(1, 4, 9, 9\)"),
    (lambda c: _sd3(c, height=2048, width=2048, vae_scale_factor=1), "pos_embed_max_size"),
    (lambda c: _wan(c, height=40), r"multiples of \(16, 16\)"),
    (lambda c: _wan(c, num_frames=6), "num_frames - 1 must be a multiple of 4.*use num_frames=5"),
])
def test_bad_sizes_raise_value_errors(make, match, transformers):
    with pytest.raises(ValueError, match=match):
        make(transformers)


@pytest.mark.parametrize("make, match", [
    (lambda c: FluxPolicy(c.sd3, num_inference_steps=2, height=16, width=16),
     "wraps a diffusers FluxTransformer2DModel, got SD3Transformer2DModel"),
    (lambda c: _flux(c, height=16.0), "height must be an int"),
    (lambda c: _sd3(c, scheduler=UniPCMultistepScheduler()), "FlowMatchEulerDiscreteScheduler"),
])
def test_bad_arguments_raise_type_errors(make, match, transformers):
    with pytest.raises(TypeError, match=match):
        make(transformers)


def test_velocity_rejects_bad_steps_conditions_and_latents():
    policy = (_CASES.get("sd3") or SD3Case()).policy()
    conditions, x = _inputs(policy)
    with pytest.raises(ValueError, match="step_index=3 is outside 0..2"):
        policy.velocity(x, STEPS, conditions)
    with pytest.raises(ValueError, match="expected \\(2,\\)"):
        policy.velocity(x, torch.tensor([0, 1, 2]), conditions)
    with pytest.raises(TypeError, match="must be int64"):
        policy.velocity(x, torch.tensor([0.0, 1.0]), conditions)
    with pytest.raises(TypeError, match="must be an int or a LongTensor"):
        policy.velocity(x, 1.0, conditions)
    missing = {k: v for k, v in conditions.items() if k != "negative_prompt_embeds"}
    with pytest.raises(ValueError, match="lack \\['negative_prompt_embeds'\\]"):
        policy.velocity(x, 0, missing)
    with pytest.raises(ValueError, match="expected \\[2, L, 32\\]"):
        policy.velocity(x, 0, {**conditions, "prompt_embeds": conditions["prompt_embeds"][:1]})
    with pytest.raises(ValueError, match="latents have shape"):
        policy.velocity(x[:, :, :4], 0, conditions)
