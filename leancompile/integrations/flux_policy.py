"""FLUX.1 as ``FluxPipeline`` runs it (``FluxPolicy``), as read from diffusers 0.42.

``FluxPipeline``: latents ``[B, C, H/8, W/8]`` are packed into 2x2 patches,
``[B, (h/2)*(w/2), 4C]``; sigmas are ``linspace(1, 1/T, T)`` shifted with
``mu = calculate_shift(image_seq_len)`` (the scheduler's dynamic shifting, ``image_seq_len``
the packed length); the transformer gets ``timestep = t/1000`` (``t`` cast to the model dtype
first), the guidance embedding ``guidance_scale`` when its config has ``guidance_embeds``, and
``img_ids``/``txt_ids`` (``(0, row, col)`` per patch, zeros per text token). No
classifier-free guidance (FLUX.1-dev is guidance-distilled; ``true_cfg_scale`` is not
supported here).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.utils.torch_utils import randn_tensor

from .flow_match import (FlowMatchPolicy, calculate_shift, check_multiples, unwrap_model,
                         vae_value)

__all__ = ["FluxPolicy", "FLUX_SCHEDULER_CONFIG"]

FLUX_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
    "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}
"""``scheduler/scheduler_config.json`` of black-forest-labs/FLUX.1-dev: dynamic shifting between
``base_shift`` at 256 packed tokens and ``max_shift`` at 4096 (``shift`` is then unused). Other
FLUX checkpoints configure their own: pass their scheduler."""

# Values of the real VAE's config, used when no vae_config is given.
_FLUX_VAE = {"scaling_factor": 0.3611, "shift_factor": 0.1159,
             "block_out_channels": (128, 256, 512, 512)}


class FluxPolicy(FlowMatchPolicy):
    """FLUX.1 (``FluxTransformer2DModel``) as ``FluxPipeline`` runs it.

    Args:
        transformer: the FLUX transformer (LoRA may be injected in place).
        num_inference_steps: denoising steps ``T``.
        height, width: image size in pixels; multiples of ``2 * vae_scale_factor``.
        guidance_scale: value of the guidance embedding (ignored when the transformer config has
            no ``guidance_embeds``, as in the pipeline). 3.5 is the pipeline default.
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` whose config sets the schedule; default
            ``FLUX_SCHEDULER_CONFIG`` (FLUX.1-dev's).
        vae_config: the VAE's config (``vae.config``); supplies ``scaling_factor``,
            ``shift_factor`` and, unless given, ``vae_scale_factor``. Default: FLUX.1's VAE
            (0.3611, 0.1159, 8).
        vae_scale_factor: pixels per latent pixel; default from ``vae_config``
            (``2 ** (len(block_out_channels) - 1)``) or 8.

    Conditions: ``prompt_embeds [B, L, joint_attention_dim]`` (T5) and ``pooled_prompt_embeds
    [B, pooled_projection_dim]`` (CLIP). Latents: packed ``[B, (h/2)*(w/2), 4*C]``.
    """

    _transformer_class = FluxTransformer2DModel
    condition_keys = ("prompt_embeds", "pooled_prompt_embeds")

    def __init__(self, transformer: FluxTransformer2DModel, *, num_inference_steps: int,
                 height: int, width: int, guidance_scale: float = 3.5,
                 scheduler: FlowMatchEulerDiscreteScheduler | None = None,
                 vae_config: Mapping | None = None, vae_scale_factor: int | None = None):
        super().__init__(transformer, num_inference_steps=num_inference_steps,
                         guidance_scale=guidance_scale)
        config = unwrap_model(transformer).config
        self._set_image_size(height, width, vae_scale_factor, vae_config, _FLUX_VAE)
        multiple = 2 * self.vae_scale_factor
        check_multiples(self.height, self.width, multiple, multiple,
                         f"VAE scale {self.vae_scale_factor} x 2x2 packing")
        if config.in_channels % 4:
            raise ValueError(f"transformer in_channels={config.in_channels} is not divisible by 4; "
                             f"FLUX packs 2x2 latent patches of in_channels/4 channels")
        self.latent_channels = config.in_channels // 4
        self.latent_height = self.height // self.vae_scale_factor
        self.latent_width = self.width // self.vae_scale_factor
        seq_len = (self.latent_height // 2) * (self.latent_width // 2)
        self.latent_shape = (seq_len, config.in_channels)
        self.scaling_factor = float(
            vae_value(vae_config, _FLUX_VAE, "scaling_factor", "FluxPolicy"))
        self.shift_factor = float(vae_value(vae_config, _FLUX_VAE, "shift_factor", "FluxPolicy"))

        sched = self._fresh_scheduler(scheduler, FLUX_SCHEDULER_CONFIG)
        cfg = sched.config
        self.mu = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256),
                                  cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                  cfg.get("max_shift", 1.15))
        T = self.num_inference_steps
        if cfg.get("use_flow_sigmas", False):
            self._set_schedule(sched, num_inference_steps=T, mu=self.mu)
        else:
            self._set_schedule(sched, sigmas=np.linspace(1.0, 1 / T, T), mu=self.mu)

    def _input_module(self):
        return self.base_transformer.x_embedder

    def _condition_shapes(self):
        config = self.base_transformer.config
        return {"prompt_embeds": (None, config.joint_attention_dim),
                "pooled_prompt_embeds": (config.pooled_projection_dim,)}

    def _draw_latents(self, batch, generator, device, dtype):
        shape = (batch, self.latent_channels, self.latent_height, self.latent_width)
        return self.pack(randn_tensor(shape, generator=generator, device=device, dtype=dtype))

    @staticmethod
    def pack(latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> ``[B, (h/2)*(w/2), 4C]``: 2x2 patches, row-major, channel-major
        inside a patch (FluxPipeline._pack_latents)."""
        b, c, h, w = latents.shape
        patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``pack`` for this policy's size: ``[B, C, h, w]``."""
        b = latents.shape[0]
        h, w, c = self.latent_height, self.latent_width, self.latent_channels
        patches = latents.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return patches.reshape(b, c, h, w)

    def _image_ids(self, device, dtype) -> torch.Tensor:
        rows, cols = self.latent_height // 2, self.latent_width // 2
        ids = torch.zeros(rows, cols, 3, device=device)
        ids[..., 1] = ids[..., 1] + torch.arange(rows, device=device)[:, None]
        ids[..., 2] = ids[..., 2] + torch.arange(cols, device=device)[None, :]
        return ids.reshape(rows * cols, 3).to(dtype)

    def forward(self, latents, step_index, conditions):
        batch, dtype, t, cond = self._step_inputs(latents, step_index, conditions)
        device = latents.device
        prompt_embeds = cond["prompt_embeds"]
        guidance = None
        if self.base_transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance_scale, device=device, dtype=torch.float32)
        output = self.transformer(
            hidden_states=latents.to(dtype),
            timestep=t.to(dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
            img_ids=self._image_ids(device, dtype),
            return_dict=False,
        )[0]
        return output.float()

    def to_vae_latents(self, latents: torch.Tensor, *, dtype: torch.dtype | None = None
                       ) -> torch.Tensor:
        """What FluxPipeline hands to ``vae.decode``: unpacked, ``/ scaling_factor + shift_factor``
        (computed in ``dtype``, default the latents' dtype; the pipeline uses the VAE's)."""
        self._check_latents(latents)
        latents = self.unpack(latents if dtype is None else latents.to(dtype))
        return latents / self.scaling_factor + self.shift_factor
