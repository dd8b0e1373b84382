"""Wan 2.1 / 2.2 text-to-video with flow-matching Euler sampling (``WanPolicy``), as read from
diffusers 0.42.

``WanPipeline``: latents ``[B, C, (F-1)/4 + 1, H/8, W/8]``; the transformer gets ``t`` in
``[0, 1000]`` (per token with ``expand_timesteps``, Wan2.2 TI2V). The pipeline's model repos
ship ``UniPCMultistepScheduler``; this policy uses ``FlowMatchEulerDiscreteScheduler(shift=
flow_shift)`` instead, the Euler sampler DanceGRPO and FlowGRPO train Wan with (give the same
scheduler to ``WanPipeline`` to compare). ``WanPipeline`` runs cond and uncond as two
transformer calls; this policy batches them like SD3, which changes nothing but the batch.
Wan2.2's two-expert ``transformer_2``/``boundary_ratio`` and image-to-video are not supported.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diffusers import FlowMatchEulerDiscreteScheduler

try:  # diffusers >= 0.33
    from diffusers import WanTransformer3DModel
except ImportError:  # pragma: no cover - WanPolicy explains at construction
    WanTransformer3DModel = None

from .flow_match import FlowMatchPolicy, check_multiples, int_arg, unwrap_model, vae_value

__all__ = ["WanPolicy"]

# Wan2.1 480p (the model card's value; 5.0 for 720p); DanceGRPO trains Wan with --shift 3.
_WAN_DEFAULT_FLOW_SHIFT = 3.0

# Values of the real VAE's config, used when no vae_config is given.
_WAN_VAE = {  # Wan2.1 VAE (AutoencoderKLWan defaults, z_dim 16)
    "scale_factor_spatial": 8, "scale_factor_temporal": 4,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}


class WanPolicy(FlowMatchPolicy):
    """Wan 2.1 / 2.2 text-to-video (``WanTransformer3DModel``) with flow-matching Euler sampling.

    Args:
        transformer: the Wan transformer (LoRA may be injected in place).
        num_inference_steps: denoising steps ``T``.
        height, width: frame size in pixels; multiples of ``vae_scale_factor_spatial * patch``.
        num_frames: video frames; ``num_frames - 1`` a multiple of ``vae_scale_factor_temporal``.
        guidance_scale: classifier-free guidance (pipeline default 5.0); ``> 1`` batches negative
            and positive prompts through the transformer.
        flow_shift: shift of the sigma schedule, ``FlowMatchEulerDiscreteScheduler(shift=
            flow_shift)``; default 3.0 (Wan2.1 480p; the model card uses 5.0 for 720p). Leave it
            None when passing ``scheduler``.
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` whose config sets the schedule (the
            model repos' ``UniPCMultistepScheduler`` is not an Euler step and is refused).
        expand_timesteps: give the transformer one timestep per token (``WanPipeline(
            expand_timesteps=True)``, Wan2.2 TI2V-5B); for text-to-video every token gets ``t``.
        vae_config: the VAE's config (``vae.config``): ``latents_mean``, ``latents_std`` and,
            unless given, the scale factors. Default: the Wan2.1 VAE (z_dim 16, 8, 4).
        vae_scale_factor_spatial, vae_scale_factor_temporal: default from ``vae_config`` or 8, 4.

    Conditions: ``prompt_embeds [B, L, text_dim]`` (UMT5, 512 tokens in the pipeline) and with
    guidance ``negative_prompt_embeds``. Latents: ``[B, C, (F-1)/4 + 1, H/8, W/8]``.
    """

    _transformer_class = WanTransformer3DModel

    def __init__(self, transformer: WanTransformer3DModel, *, num_inference_steps: int,
                 height: int, width: int, num_frames: int, guidance_scale: float = 5.0,
                 flow_shift: float | None = None,
                 scheduler: FlowMatchEulerDiscreteScheduler | None = None,
                 expand_timesteps: bool = False, vae_config: Mapping | None = None,
                 vae_scale_factor_spatial: int | None = None,
                 vae_scale_factor_temporal: int | None = None):
        if WanTransformer3DModel is None:
            import diffusers
            raise ImportError(f"WanPolicy needs diffusers >= 0.33 (WanTransformer3DModel); "
                              f"this is diffusers {diffusers.__version__}")
        super().__init__(transformer, num_inference_steps=num_inference_steps,
                         guidance_scale=guidance_scale)
        config = unwrap_model(transformer).config
        if vae_scale_factor_spatial is None:
            vae_scale_factor_spatial = vae_value(
                vae_config, _WAN_VAE, "scale_factor_spatial", "WanPolicy")
        if vae_scale_factor_temporal is None:
            vae_scale_factor_temporal = vae_value(
                vae_config, _WAN_VAE, "scale_factor_temporal", "WanPolicy")
        self.vae_scale_factor_spatial = int_arg(
            "vae_scale_factor_spatial", vae_scale_factor_spatial, minimum=1)
        self.vae_scale_factor_temporal = int_arg(
            "vae_scale_factor_temporal", vae_scale_factor_temporal, minimum=1)
        self.height = int_arg("height", height, minimum=1)
        self.width = int_arg("width", width, minimum=1)
        self.num_frames = int_arg("num_frames", num_frames, minimum=1)
        p_t, p_h, p_w = config.patch_size
        s, tf = self.vae_scale_factor_spatial, self.vae_scale_factor_temporal
        check_multiples(self.height, self.width, s * p_h, s * p_w,
                         f"VAE scale {s} x patch ({p_h}, {p_w})")
        if (self.num_frames - 1) % tf:
            raise ValueError(
                f"num_frames={num_frames}: num_frames - 1 must be a multiple of {tf} (the VAE's "
                f"temporal scale); use num_frames={(self.num_frames - 1) // tf * tf + 1}")
        frames = (self.num_frames - 1) // tf + 1
        if frames % p_t:
            raise ValueError(f"num_frames={num_frames} gives {frames} latent frames, not a "
                             f"multiple of the temporal patch {p_t}")
        h, w = self.height // s, self.width // s
        self.latent_shape = (config.in_channels, frames, h, w)
        self.expand_timesteps = bool(expand_timesteps)
        self.num_tokens = (frames // p_t) * (h // p_h) * (w // p_w)
        self.latents_mean = list(vae_value(vae_config, _WAN_VAE, "latents_mean", "WanPolicy"))
        self.latents_std = list(vae_value(vae_config, _WAN_VAE, "latents_std", "WanPolicy"))

        if scheduler is None:
            shift = _WAN_DEFAULT_FLOW_SHIFT if flow_shift is None else float(flow_shift)
            sched = self._fresh_scheduler(None, {"num_train_timesteps": 1000, "shift": shift})
        else:
            sched = self._fresh_scheduler(scheduler, {})
            if flow_shift is not None and float(flow_shift) != float(sched.config.shift):
                raise ValueError(f"flow_shift={flow_shift} disagrees with the scheduler's shift="
                                 f"{sched.config.shift}; pass one of them")
        self.flow_shift = float(sched.config.shift)
        self._set_schedule(sched, num_inference_steps=self.num_inference_steps)
        keys = ("prompt_embeds",)
        if self.do_classifier_free_guidance:
            keys += ("negative_prompt_embeds",)
        self.condition_keys = keys

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > 1

    def _input_module(self):
        return self.base_transformer.patch_embedding

    def _condition_shapes(self):
        shapes = {"prompt_embeds": (None, self.base_transformer.config.text_dim)}
        if self.do_classifier_free_guidance:
            shapes["negative_prompt_embeds"] = shapes["prompt_embeds"]
        return shapes

    def forward(self, latents, step_index, conditions):
        _, dtype, t, cond = self._step_inputs(latents, step_index, conditions)
        x, prompt = latents.to(dtype), cond["prompt_embeds"]
        if self.do_classifier_free_guidance:
            prompt = self._negative_first(cond["negative_prompt_embeds"], prompt,
                                          padded_by="WanPipeline pads to max_sequence_length")
            x, t = torch.cat([x, x]), torch.cat([t, t])
        if self.expand_timesteps:
            t = t[:, None].expand(t.shape[0], self.num_tokens)
        output = self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=prompt,
                                  return_dict=False)[0]
        return self._guide(output)

    def to_vae_latents(self, latents: torch.Tensor, *, dtype: torch.dtype | None = None
                       ) -> torch.Tensor:
        """What WanPipeline hands to ``vae.decode``: ``latents / (1 / latents_std) +
        latents_mean`` per channel (in ``dtype``, default the latents' dtype)."""
        self._check_latents(latents)
        channels = latents.shape[1]
        if len(self.latents_mean) != channels or len(self.latents_std) != channels:
            raise ValueError(
                f"the VAE statistics have {len(self.latents_mean)} channels and the latents "
                f"{channels}; pass vae_config=vae.config of the VAE that matches the transformer")
        latents = latents if dtype is None else latents.to(dtype)
        view = (1, channels, 1, 1, 1)
        mean = torch.tensor(self.latents_mean).view(view).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.latents_std).view(view).to(latents.device, latents.dtype)
        return latents / inv_std + mean
