"""Stable Diffusion 3 / 3.5 as ``StableDiffusion3Pipeline`` runs it (``SD3Policy``), as read
from diffusers 0.42.

``StableDiffusion3Pipeline``: latents ``[B, C, H/8, W/8]``; ``set_timesteps(T)`` of a scheduler
with ``shift=3.0`` (dynamic shifting with ``max_shift`` default 1.16 if the scheduler config
asks for it); the transformer gets ``t`` in ``[0, 1000]``. With ``guidance_scale > 1`` the
negative and positive prompts go through the transformer as ONE batch ``[uncond; cond]`` and
``v = uncond + g * (cond - uncond)``. Skip-layer guidance is not supported.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

from .flow_match import (FlowMatchPolicy, calculate_shift, check_multiples, unwrap_model,
                         vae_value)

__all__ = ["SD3Policy", "SD3_SCHEDULER_CONFIG"]

SD3_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}
"""``scheduler/scheduler_config.json`` of stabilityai/stable-diffusion-3-medium and 3.5-medium/
large: a fixed shift of 3."""

# Values of the real VAE's config, used when no vae_config is given.
_SD3_VAE = {"scaling_factor": 1.5305, "shift_factor": 0.0609,
            "block_out_channels": (128, 256, 512, 512)}


class SD3Policy(FlowMatchPolicy):
    """Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``) as ``StableDiffusion3Pipeline`` runs it.

    Args:
        transformer: the SD3 transformer (LoRA may be injected in place).
        num_inference_steps: denoising steps ``T``.
        height, width: image size in pixels; multiples of ``vae_scale_factor * patch_size``.
        guidance_scale: classifier-free guidance; ``> 1`` batches negative and positive prompts
            through the transformer. 7.0 is the pipeline default (FlowGRPO trains SD3.5-M at 4.5).
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` whose config sets the schedule; default
            ``SD3_SCHEDULER_CONFIG`` (shift 3).
        vae_config: the VAE's config (``vae.config``); default SD3's VAE (1.5305, 0.0609, 8).
        vae_scale_factor: pixels per latent pixel; default from ``vae_config`` or 8.

    Conditions: ``prompt_embeds [B, L, joint_attention_dim]`` (CLIP-L/G + T5, 77 + 256 tokens in
    the pipeline), ``pooled_prompt_embeds [B, pooled_projection_dim]``, and with guidance the
    ``negative_`` versions. Latents: ``[B, C, H/8, W/8]``.
    """

    _transformer_class = SD3Transformer2DModel
    _default_sequence_length = 77 + 256

    def __init__(self, transformer: SD3Transformer2DModel, *, num_inference_steps: int,
                 height: int, width: int, guidance_scale: float = 7.0,
                 scheduler: FlowMatchEulerDiscreteScheduler | None = None,
                 vae_config: Mapping | None = None, vae_scale_factor: int | None = None):
        super().__init__(transformer, num_inference_steps=num_inference_steps,
                         guidance_scale=guidance_scale)
        config = unwrap_model(transformer).config
        self._set_image_size(height, width, vae_scale_factor, vae_config, _SD3_VAE)
        patch = config.patch_size
        multiple = self.vae_scale_factor * patch
        check_multiples(self.height, self.width, multiple, multiple,
                         f"VAE scale {self.vae_scale_factor} x patch {patch}")
        h, w = self.height // self.vae_scale_factor, self.width // self.vae_scale_factor
        max_size = config.get("pos_embed_max_size")
        if max_size is not None and max(h, w) // patch > max_size:
            raise ValueError(
                f"height={height}, width={width} give {h // patch}x{w // patch} patches; the "
                f"transformer's position embedding covers at most {max_size}x{max_size} "
                f"(pos_embed_max_size); use at most {max_size * multiple} pixels per side")
        self.latent_shape = (config.in_channels, h, w)
        self.scaling_factor = float(
            vae_value(vae_config, _SD3_VAE, "scaling_factor", "SD3Policy"))
        self.shift_factor = float(vae_value(vae_config, _SD3_VAE, "shift_factor", "SD3Policy"))

        sched = self._fresh_scheduler(scheduler, SD3_SCHEDULER_CONFIG)
        cfg = sched.config
        self.mu = None
        if cfg.get("use_dynamic_shifting", False):
            self.mu = calculate_shift(
                (h // patch) * (w // patch), cfg.get("base_image_seq_len", 256),
                cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                cfg.get("max_shift", 1.16))
        self._set_schedule(sched, num_inference_steps=self.num_inference_steps, mu=self.mu)
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        if self.do_classifier_free_guidance:
            keys += ("negative_prompt_embeds", "negative_pooled_prompt_embeds")
        self.condition_keys = keys

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > 1

    def _input_module(self):
        return self.base_transformer.pos_embed.proj

    def _condition_shapes(self):
        config = self.base_transformer.config
        shapes = {"prompt_embeds": (None, config.joint_attention_dim),
                  "pooled_prompt_embeds": (config.pooled_projection_dim,)}
        if self.do_classifier_free_guidance:
            shapes["negative_prompt_embeds"] = shapes["prompt_embeds"]
            shapes["negative_pooled_prompt_embeds"] = shapes["pooled_prompt_embeds"]
        return shapes

    def forward(self, latents, step_index, conditions):
        _, dtype, t, cond = self._step_inputs(latents, step_index, conditions)
        x = latents.to(dtype)
        prompt, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.do_classifier_free_guidance:
            prompt = self._negative_first(cond["negative_prompt_embeds"], prompt,
                                          padded_by="the pipeline's encoders do")
            x, t = torch.cat([x, x]), torch.cat([t, t])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        output = self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=prompt,
                                  pooled_projections=pooled, return_dict=False)[0]
        return self._guide(output)

    def to_vae_latents(self, latents: torch.Tensor, *, dtype: torch.dtype | None = None
                       ) -> torch.Tensor:
        """What StableDiffusion3Pipeline hands to ``vae.decode``: ``/ scaling_factor +
        shift_factor`` (in ``dtype``, default the latents' dtype)."""
        self._check_latents(latents)
        latents = latents if dtype is None else latents.to(dtype)
        return latents / self.scaling_factor + self.shift_factor
