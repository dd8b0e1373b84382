"""Tiny models the tests share, and an eager-autograd reference to compare against."""

from __future__ import annotations

import torch
import torch.nn as nn


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32),
                         nn.Linear(32, 8))


def tiny_flux(seed: int = 0, single_layers: int = 1):
    """A random-init FLUX: 1 double block and ``single_layers`` single blocks."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=single_layers,
        attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=True)


def flux_inputs(batch: int = 2, height: int = 4, width: int = 4, text: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(height * width, 3)
    img_ids[:, 1] = torch.arange(height).repeat_interleave(width)
    img_ids[:, 2] = torch.arange(width).repeat(height)
    return dict(
        hidden_states=torch.randn(batch, height * width, 4, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.rand(batch, generator=g),
        guidance=torch.full((batch,), 3.5),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 3),
    )


def flux_step(model):
    """A training-step function over the flux model: (latents, text, pooled, t) -> velocity."""
    def step(hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance,
             img_ids, txt_ids):
        return model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                     pooled_projections=pooled_projections, timestep=timestep,
                     guidance=guidance, img_ids=img_ids, txt_ids=txt_ids,
                     return_dict=False)[0]
    return step


def outputs_and_grads(model, fn, args, *, seed: int = 123):
    """Run fn(*args), backprop a fixed random cotangent, return (output, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = fn(*args)
    g = torch.Generator().manual_seed(seed)
    cotangent = torch.randn(out.shape, generator=g, dtype=out.dtype)
    out.backward(cotangent)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def assert_same_training_step(model, eager_fn, compiled_fn, args, *, atol=1e-5, rtol=1e-5):
    out_ref, grads_ref = outputs_and_grads(model, eager_fn, args)
    out, grads = outputs_and_grads(model, compiled_fn, args)
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)
    assert grads.keys() == grads_ref.keys() and grads_ref
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def tiny_flux_policy(steps: int = 4, seed: int = 0, *, double_blocks: int = 0,
                     single_blocks: int = 1):
    """A random-init FLUX behind ``FluxPolicy``: 8x8 latents, 16 packed tokens, one
    single-stream block (text and image tokens through one joint attention, as in FLUX's
    deeper 38 of 57 blocks). Its dual-stream blocks (the other 19: text and image with their own
    projections) run where ``double_blocks=1`` is named (test_grpo_trainer.py's shared trainer),
    in the Ulysses and DanceGRPO loop tests and in the demos. One block, not 1+1:
    a capture of the policy step costs 0.67 of the 1+1 model's (12.2 s against 18.1 s of CPU
    for a trainer's first compute_gradients, one process, 2026-12-07), and the tests capture
    it dozens of times."""
    from diffusers import FluxTransformer2DModel

    from leancompile.integrations.diffusers import FluxPolicy

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=double_blocks, num_single_layers=single_blocks,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=[4, 4, 8], guidance_embeds=True).eval()
    return FluxPolicy(transformer, num_inference_steps=steps, height=8, width=8,
                      vae_scale_factor=1, guidance_scale=3.5)


def bf16_flux(lora: bool = False, steps: int = 3):
    """``tiny_flux_policy`` cast to bfloat16, as a new user would; ``lora``: peft adapters on
    the attention projections (the base frozen), ``lora_B`` moved off zero."""
    import pytest

    policy = tiny_flux_policy(steps=steps)
    policy.transformer.to(torch.bfloat16)
    if lora:
        pytest.importorskip("peft")
        from peft import LoraConfig

        policy.transformer.requires_grad_(False)
        policy.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4,
                                                  target_modules=["to_q", "to_k", "to_v"]))
        with torch.no_grad():  # lora_B starts at zero: move it so lora_A's gradients are live
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        policy.transformer.to(torch.bfloat16)
    return policy


def tiny_wan_policy(steps: int = 3, seed: int = 0):
    """A random-init Wan (1 layer) behind ``WanPolicy`` with classifier-free guidance."""
    from diffusers import WanTransformer3DModel

    from leancompile.integrations.diffusers import WanPolicy

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    return WanPolicy(transformer, num_inference_steps=steps, height=32, width=32, num_frames=5,
                     guidance_scale=5.0, flow_shift=5.0)


class ToyFlowPolicy(torch.nn.Module):
    """A small flow-matching policy (an MLP velocity) with the policy contract of
    ``leancompile.integrations.diffusers``: for trainer tests where the model is not the point
    and capture must be quick."""

    condition_keys = ("prompt_embeds",)

    def __init__(self, *, steps: int = 4, dim: int = 8, dropout: float = 0.0, seed: int = 0,
                 checkpointing: bool = False):
        super().__init__()
        self.checkpointing = checkpointing  # activation checkpointing of the MLP
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(dim + 4, 32), torch.nn.GELU()]
        if dropout:
            layers.append(torch.nn.Dropout(dropout))
        layers.append(torch.nn.Linear(32, dim))
        self.net = torch.nn.Sequential(*layers)
        self.dim = dim
        self.register_buffer("sigmas", torch.linspace(1, 0, steps + 1), persistent=False)

    def velocity(self, latents, step_index, conditions):
        if isinstance(step_index, int):
            step_index = torch.full((latents.shape[0],), step_index, dtype=torch.long)
        t = self.sigmas[step_index].reshape(-1, 1)
        h = torch.cat([latents, conditions["prompt_embeds"], t], dim=1)
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(self.net, h, use_reentrant=False)
        return self.net(h)

    def initial_latents(self, batch, generator=None):
        return torch.randn(batch, self.dim, generator=generator)

    def example_conditions(self, batch, generator=None):
        return {"prompt_embeds": torch.randn(batch, 3, generator=generator)}


def register_shards(module: nn.Module, full: dict, rank: int, world: int) -> dict[str, int]:
    """Each tensor of ``full`` registered on ``module`` as this rank's ``Shard(0)`` part
    (``torch.chunk`` rows, zero-padded to one size per rank), as FSDP-style sharding keeps
    it; returns each tensor's rows (for ``gather_shard``)."""
    for name, t in full.items():
        per = -(-t.shape[0] // world)
        padded = torch.cat([t, t.new_zeros(per * world - t.shape[0], *t.shape[1:])])
        module.register_parameter(name, nn.Parameter(padded[rank * per:(rank + 1) * per].clone()))
    return {n: t.shape[0] for n, t in full.items()}


def gather_shard(part: torch.Tensor, rows: int, dtype=None) -> torch.Tensor:
    """The full tensor from every rank's part (``register_shards``), gathered inside the traced
    graph with the autograd-aware functional collective (backward: a reduce-scatter); cast to
    ``dtype`` first, as a mixed-precision policy does."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if dtype is not None:
        part = part.to(dtype)
    return funcol.all_gather_tensor_autograd(part, 0, dist.group.WORLD)[:rows]
