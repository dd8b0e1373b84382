"""Diffusion policies for LeanGRPO: a diffusers transformer plus the schedule its pipeline uses.

A policy is the piece of a diffusers pipeline that GRPO trains: the denoising transformer and
what the pipeline feeds it at each step. ``policy.velocity(x, k, conditions)`` returns the
flow-matching velocity that the pipeline would hand to ``FlowMatchEulerDiscreteScheduler.step``
at step ``k``, so the deterministic Euler rollout

    x = policy.initial_latents(batch, generator)
    for k in range(policy.num_inference_steps):
        x = x + (policy.sigmas[k + 1] - policy.sigmas[k]) * policy.velocity(x, k, conditions)

reproduces ``pipeline(..., latents=x0, output_type="latent")``, and the SDE steps of FlowGRPO
and DanceGRPO (``docs/leangrpo.md`` section 2) are built on the same ``velocity`` and
``sigmas``. Text encoders, tokenizers and the VAE stay outside: conditions are precomputed
prompt embeddings, and ``to_vae_latents`` gives what the pipeline passes to ``vae.decode``.

What each pipeline does, as read from diffusers 0.42 and reproduced here:

- ``FluxPipeline``: latents ``[B, C, H/8, W/8]`` are packed into 2x2 patches,
  ``[B, (h/2)*(w/2), 4C]``; sigmas are ``linspace(1, 1/T, T)`` shifted with
  ``mu = calculate_shift(image_seq_len)`` (the scheduler's dynamic shifting, ``image_seq_len``
  the packed length); the transformer gets ``timestep = t/1000`` (``t`` cast to the model dtype
  first), the guidance embedding ``guidance_scale`` when its config has ``guidance_embeds``, and
  ``img_ids``/``txt_ids`` (``(0, row, col)`` per patch, zeros per text token). No
  classifier-free guidance (FLUX.1-dev is guidance-distilled; ``true_cfg_scale`` is not
  supported here).
- ``StableDiffusion3Pipeline``: latents ``[B, C, H/8, W/8]``; ``set_timesteps(T)`` of a scheduler
  with ``shift=3.0`` (dynamic shifting with ``max_shift`` default 1.16 if the scheduler config
  asks for it); the transformer gets ``t`` in ``[0, 1000]``. With ``guidance_scale > 1`` the
  negative and positive prompts go through the transformer as ONE batch ``[uncond; cond]`` and
  ``v = uncond + g * (cond - uncond)``. Skip-layer guidance is not supported.
- ``WanPipeline``: latents ``[B, C, (F-1)/4 + 1, H/8, W/8]``; the transformer gets ``t`` in
  ``[0, 1000]`` (per token with ``expand_timesteps``, Wan2.2 TI2V). The pipeline's model repos
  ship ``UniPCMultistepScheduler``; this policy uses ``FlowMatchEulerDiscreteScheduler(shift=
  flow_shift)`` instead, the Euler sampler DanceGRPO and FlowGRPO train Wan with (give the same
  scheduler to ``WanPipeline`` to compare). ``WanPipeline`` runs cond and uncond as two
  transformer calls; this policy batches them like SD3, which changes nothing but the batch.
  Wan2.2's two-expert ``transformer_2``/``boundary_ratio`` and image-to-video are not supported.

Dtypes: the transformer runs in its own dtype (latents and conditions are cast to the dtype of
its input projection); ``velocity`` always returns float32, and classifier-free guidance is
combined in float32. The pipelines keep their latents in the model dtype between steps (the
scheduler casts back); a trainer holding float32 latents therefore matches the pipeline in
float32 (bitwise for FLUX and SD3; for Wan up to rounding, from batching cond and uncond) and is
slightly more precise than it in bf16.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.utils.torch_utils import randn_tensor

try:  # diffusers >= 0.33
    from diffusers import WanTransformer3DModel
except ImportError:  # pragma: no cover - WanPolicy explains at construction
    WanTransformer3DModel = None

from ..lean import LeanModule  # noqa: E402
from .sequence_parallel import SequenceParallel, parallelize_ulysses  # noqa: E402

__all__ = [
    "parallelize_ulysses",
    "SequenceParallel",
    "FluxPolicy",
    "SD3Policy",
    "WanPolicy",
    "FlowMatchPolicy",
    "select_conditions",
    "calculate_shift",
    "FLUX_SCHEDULER_CONFIG",
    "SD3_SCHEDULER_CONFIG",
]

FLUX_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
    "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}
"""``scheduler/scheduler_config.json`` of black-forest-labs/FLUX.1-dev: dynamic shifting between
``base_shift`` at 256 packed tokens and ``max_shift`` at 4096 (``shift`` is then unused). Other
FLUX checkpoints configure their own: pass their scheduler."""

SD3_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}
"""``scheduler/scheduler_config.json`` of stabilityai/stable-diffusion-3-medium and 3.5-medium/
large: a fixed shift of 3."""

# Wan2.1 480p (the model card's value; 5.0 for 720p); DanceGRPO trains Wan with --shift 3.
_WAN_DEFAULT_FLOW_SHIFT = 3.0

# Values of the real VAEs' configs, used when no vae_config is given.
_FLUX_VAE = {"scaling_factor": 0.3611, "shift_factor": 0.1159,
             "block_out_channels": (128, 256, 512, 512)}
_SD3_VAE = {"scaling_factor": 1.5305, "shift_factor": 0.0609,
            "block_out_channels": (128, 256, 512, 512)}
_WAN_VAE = {  # Wan2.1 VAE (AutoencoderKLWan defaults, z_dim 16)
    "scale_factor_spatial": 8, "scale_factor_temporal": 4,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """``mu`` of the resolution-dependent shift: linear in the image token count, ``base_shift``
    at ``base_seq_len`` tokens and ``max_shift`` at ``max_seq_len`` (FluxPipeline's rule)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def select_conditions(conditions: Mapping[str, torch.Tensor], index) -> dict[str, torch.Tensor]:
    """Rows ``index`` of every tensor in ``conditions`` (batch first).

    ``index`` is anything tensors index with along dim 0: a LongTensor (``arange(B)
    .repeat_interleave(M)`` repeats each prompt M times), a slice, a list. A plain int keeps the
    batch dimension (one row), so the result is always a valid ``conditions`` dict.
    """
    if not isinstance(conditions, Mapping):
        raise TypeError(f"conditions must be a dict of tensors, got {type(conditions).__name__}")
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        index = slice(int(index), int(index) + 1 if int(index) != -1 else None)
    return {key: value[index] for key, value in conditions.items()}


def _int_arg(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def _check_multiples(height: int, width: int, mult_h: int, mult_w: int, why: str):
    if height % mult_h or width % mult_w:
        raise ValueError(
            f"height={height}, width={width} must be multiples of ({mult_h}, {mult_w}) ({why}); "
            f"use height={height // mult_h * mult_h}, width={width // mult_w * mult_w}")


def _vae_value(vae_config: Mapping | None, defaults: Mapping, key: str, policy: str):
    if vae_config is None:
        return defaults[key]
    value = vae_config.get(key)
    if value is None:
        raise ValueError(f"vae_config has no {key!r} (got {value!r}); {policy} needs it. Pass the "
                         f"config of the VAE the pipeline decodes with (vae.config)")
    return value


def _unwrap_model(module) -> nn.Module:
    """The model inside ``DistributedDataParallel``, ``torch.compile`` and ``lean_compile``
    wrappers."""
    from torch.nn.parallel import DistributedDataParallel

    for _ in range(8):
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            module = module._orig_mod
        elif isinstance(module, LeanModule):
            module = module.module
        elif not isinstance(module, nn.Module) and hasattr(module, "__wrapped__"):
            module = module.__wrapped__
        else:
            break
    return module


def _outer_module(module) -> nn.Module | None:
    """The outermost ``nn.Module`` of a chain of wrappers (what owns the parameters)."""
    for _ in range(8):
        if isinstance(module, nn.Module):
            return module
        module = getattr(module, "__wrapped__", None)
    return None


class FlowMatchPolicy(nn.Module):
    """What the three policies share: the schedule, step indexing, conditions, dtype handling.

    Subclasses set ``condition_keys``, ``latent_shape`` and implement ``forward``.
    ``velocity(latents, step_index, conditions)`` calls the module, so module hooks (FSDP) run.

    Attributes:
        transformer: the diffusers transformer; ``named_parameters()`` yields ``transformer.*``.
        num_inference_steps: ``T``.
        guidance_scale: the guidance the pipeline would use.
        sigmas: float32 ``[T + 1]``, the scheduler's sigmas after the pipeline's
            ``set_timesteps`` (last one 0). A non-persistent buffer: moves with ``.to(device)``,
            stays float32 under ``.to(dtype)``.
        timesteps: float32 ``[T]``, the scheduler's ``t`` values the pipeline loops over
            (``sigma * 1000``).
        scheduler_config: the scheduler config the schedule was built from.
        condition_keys: the keys ``velocity`` reads from ``conditions`` (the negative-prompt
            ones only with classifier-free guidance).
        latent_shape: the shape of one sample's latents, as ``velocity`` takes them.
    """

    _transformer_class: type = nn.Module
    condition_keys: tuple[str, ...] = ()
    latent_shape: tuple[int, ...] = ()

    def __init__(self, transformer: nn.Module, *, num_inference_steps: int, guidance_scale: float):
        super().__init__()
        base = _unwrap_model(transformer)
        if not isinstance(base, self._transformer_class):
            raise TypeError(
                f"{type(self).__name__} wraps a diffusers {self._transformer_class.__name__}, got "
                f"{type(base).__name__}. Inject LoRA in place (transformer.add_adapter("
                f"LoraConfig(...)) or peft.inject_adapter_in_model) rather than wrapping the "
                f"transformer with peft.get_peft_model")
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, numbers.Real):
            raise TypeError(f"guidance_scale must be a number, got {guidance_scale!r}")
        if not isinstance(transformer, nn.Module):
            # A compiled wrapper (lean_compile(DDP(transformer), schedule=...)): the module it
            # wraps is registered, so the policy's parameters are the transformer's.
            self.transformer_module = _outer_module(transformer)
        self.transformer = transformer
        """What ``velocity`` calls: the diffusers transformer, a ``DistributedDataParallel``
        around it (its gradient all-reduce then runs in the user's backward, as in FlowGRPO's
        accelerate loops), or ``lean_compile(...)`` of either."""
        self.num_inference_steps = _int_arg("num_inference_steps", num_inference_steps, minimum=1)
        self.guidance_scale = float(guidance_scale)

    @property
    def base_transformer(self) -> nn.Module:
        """The diffusers transformer (``transformer.module`` when it is wrapped in DDP)."""
        return _unwrap_model(self.transformer)

    # ---- schedule -------------------------------------------------------------------------

    @staticmethod
    def _fresh_scheduler(scheduler, default_config: Mapping) -> FlowMatchEulerDiscreteScheduler:
        """A new scheduler from ``scheduler``'s config (the caller's object is left alone)."""
        if scheduler is None:
            return FlowMatchEulerDiscreteScheduler(**default_config)
        if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            raise TypeError(
                f"scheduler must be a FlowMatchEulerDiscreteScheduler (its config sets the sigma "
                f"schedule of the Euler/SDE steps), got {type(scheduler).__name__}; build one with "
                f"FlowMatchEulerDiscreteScheduler.from_config(...) or leave scheduler=None")
        if scheduler.config.get("invert_sigmas", False):
            raise ValueError("scheduler has invert_sigmas=True (a Mochi-only schedule that ends at "
                             "sigma 1); LeanGRPO policies need sigmas that go down to 0")
        return FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)

    def _set_schedule(self, scheduler: FlowMatchEulerDiscreteScheduler, **set_timesteps_kwargs):
        scheduler.set_timesteps(**set_timesteps_kwargs)
        sigmas = scheduler.sigmas.detach().to("cpu", torch.float32).clone()
        timesteps = scheduler.timesteps.detach().to("cpu", torch.float32).clone()
        assert sigmas.shape == (self.num_inference_steps + 1,), sigmas.shape
        assert timesteps.shape == (self.num_inference_steps,), timesteps.shape
        self.scheduler_config = dict(scheduler.config)
        # Masters kept on CPU in float32: .to(dtype) would otherwise round the schedule.
        self._schedule_master = (sigmas, timesteps)
        self.register_buffer("sigmas", sigmas.clone(), persistent=False)
        self.register_buffer("timesteps", timesteps.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if hasattr(self, "_schedule_master"):
            sigmas, timesteps = self._schedule_master
            self.sigmas = sigmas.to(self.sigmas.device)
            self.timesteps = timesteps.to(self.timesteps.device)
        return self

    def _set_image_size(self, height, width, vae_scale_factor, vae_config, vae_defaults):
        """``height``/``width`` in pixels and the VAE's spatial scale (from ``vae_config``'s
        ``block_out_channels`` when not given, as the pipelines compute it)."""
        if vae_scale_factor is None:
            blocks = _vae_value(vae_config, vae_defaults, "block_out_channels",
                                type(self).__name__)
            vae_scale_factor = 2 ** (len(blocks) - 1)
        self.vae_scale_factor = _int_arg("vae_scale_factor", vae_scale_factor, minimum=1)
        self.height = _int_arg("height", height, minimum=1)
        self.width = _int_arg("width", width, minimum=1)

    def _step_values(self, table: torch.Tensor, step_index, batch: int) -> torch.Tensor:
        """``table[step_index]`` as a ``[batch]`` tensor, with no host sync and no branch on
        tensor values (one traced graph serves every step)."""
        if isinstance(step_index, torch.Tensor):
            if step_index.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"step_index tensor must be int64 (one step per sample), got "
                                f"dtype {step_index.dtype}")
            if step_index.ndim == 0:
                return table[step_index.to(table.device)].expand(batch)
            if tuple(step_index.shape) != (batch,):
                raise ValueError(f"step_index has shape {tuple(step_index.shape)}; expected "
                                 f"({batch},), one step per sample of the batch")
            return table[step_index.to(table.device)]
        if isinstance(step_index, bool) or not isinstance(step_index, numbers.Integral):
            raise TypeError(f"step_index must be an int or a LongTensor of shape [batch], got "
                            f"{step_index!r}")
        if not 0 <= step_index < self.num_inference_steps:
            raise ValueError(f"step_index={step_index} is outside 0..{self.num_inference_steps - 1}"
                             f" (num_inference_steps={self.num_inference_steps})")
        return table[int(step_index)].expand(batch)

    # ---- inputs ---------------------------------------------------------------------------

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the velocity mixes a negative-prompt pass in (the pipelines: ``g > 1``)."""
        return False

    def _input_module(self) -> nn.Module:
        raise NotImplementedError

    def _model_dtype(self) -> torch.dtype:
        """The dtype the transformer's first layer takes (its input projection's weight)."""
        weight = getattr(self._input_module(), "weight", None)
        return weight.dtype if isinstance(weight, torch.Tensor) else self.base_transformer.dtype

    def _model_device(self) -> torch.device:
        weight = getattr(self._input_module(), "weight", None)
        return weight.device if isinstance(weight, torch.Tensor) else self.base_transformer.device

    def _condition_shapes(self) -> dict[str, tuple]:
        """Per key, the shape of one row; ``None`` where any size goes (text length)."""
        raise NotImplementedError

    def _check_latents(self, latents: torch.Tensor) -> int:
        if not isinstance(latents, torch.Tensor):
            raise TypeError(f"latents must be a tensor, got {type(latents).__name__}")
        if tuple(latents.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"latents have shape {tuple(latents.shape)}; {type(self).__name__} expects "
                f"[batch, {', '.join(map(str, self.latent_shape))}] for the height/width it was "
                f"built with (policy.initial_latents(batch) draws them)")
        return latents.shape[0]

    def _conditions(self, conditions, batch: int, device, dtype) -> dict[str, torch.Tensor]:
        if not isinstance(conditions, Mapping):
            raise TypeError(
                f"conditions must be a dict of tensors, got {type(conditions).__name__}")
        missing = [key for key in self.condition_keys if key not in conditions]
        if missing:
            raise ValueError(
                f"conditions lack {missing}; {type(self).__name__} with guidance_scale="
                f"{self.guidance_scale} needs {list(self.condition_keys)} (batch first; "
                f"policy.example_conditions(batch) shows the shapes)")
        out = {}
        for key, row_shape in self._condition_shapes().items():
            value = conditions[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"conditions[{key!r}] must be a tensor, got {type(value).__name__}")
            shape = tuple(value.shape)
            fits = (len(shape) == len(row_shape) + 1 and shape[0] == batch and all(
                want is None or got == want for got, want in zip(shape[1:], row_shape)))
            if not fits:
                want = ", ".join("L" if w is None else str(w) for w in row_shape)
                raise ValueError(f"conditions[{key!r}] has shape {shape}; expected "
                                 f"[{batch}, {want}] (one row per latent of the batch)")
            out[key] = value.to(device=device, dtype=dtype)
        return out

    def select_conditions(self, conditions: Mapping[str, torch.Tensor], index
                          ) -> dict[str, torch.Tensor]:
        """Rows ``index`` of this policy's conditions (see module-level ``select_conditions``)."""
        if not isinstance(conditions, Mapping):
            raise TypeError(
                f"conditions must be a dict of tensors, got {type(conditions).__name__}")
        missing = [key for key in self.condition_keys if key not in conditions]
        if missing:
            raise ValueError(f"conditions lack {missing}; {type(self).__name__} needs "
                             f"{list(self.condition_keys)}")
        return select_conditions({key: conditions[key] for key in self.condition_keys}, index)

    def example_conditions(self, batch: int, generator: torch.Generator | None = None, *,
                           sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        """Random float32 prompt embeddings of the shapes the transformer takes (demos and tests
        without a text encoder). ``sequence_length`` defaults to the pipeline's text length."""
        batch = _int_arg("batch", batch, minimum=1)
        length = _int_arg("sequence_length", sequence_length if sequence_length is not None
                          else self._default_sequence_length, minimum=1)
        out = {}
        for key, row_shape in self._condition_shapes().items():
            shape = (batch,) + tuple(length if size is None else size for size in row_shape)
            out[key] = randn_tensor(shape, generator=generator, device=self._model_device(),
                                    dtype=torch.float32)
        return out

    _default_sequence_length = 512

    def initial_latents(self, batch: int, generator: torch.Generator | list | None = None, *,
                        device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Initial noise in the layout ``velocity`` takes, drawn as the pipeline's
        ``prepare_latents`` draws it (same generator, same values). ``dtype`` is the dtype the
        noise is drawn in: FLUX/SD3 pipelines draw in the prompt-embedding dtype, Wan in float32."""
        batch = _int_arg("batch", batch, minimum=1)
        device = self._model_device() if device is None else torch.device(device)
        return self._draw_latents(batch, generator, device, dtype)

    def _draw_latents(self, batch, generator, device, dtype):
        return randn_tensor((batch,) + self.latent_shape, generator=generator, device=device,
                            dtype=dtype)

    def velocity(self, latents: torch.Tensor, step_index, conditions: Mapping[str, torch.Tensor]
                 ) -> torch.Tensor:
        """Float32 velocity at step ``step_index`` (an int, or a LongTensor ``[B]`` of one step
        per sample), in the layout of ``latents``. Calls the module (``forward``)."""
        return self(latents, step_index, conditions)

    def _guide(self, output: torch.Tensor) -> torch.Tensor:
        """``uncond + g * (cond - uncond)`` on a ``[uncond; cond]`` batch, in float32."""
        output = output.float()
        if not self.do_classifier_free_guidance:
            return output
        uncond, cond = output.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)


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
        config = _unwrap_model(transformer).config
        self._set_image_size(height, width, vae_scale_factor, vae_config, _FLUX_VAE)
        multiple = 2 * self.vae_scale_factor
        _check_multiples(self.height, self.width, multiple, multiple,
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
            _vae_value(vae_config, _FLUX_VAE, "scaling_factor", "FluxPolicy"))
        self.shift_factor = float(_vae_value(vae_config, _FLUX_VAE, "shift_factor", "FluxPolicy"))

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
        batch = self._check_latents(latents)
        dtype, device = self._model_dtype(), latents.device
        t = self._step_values(self.timesteps, step_index, batch)
        cond = self._conditions(conditions, batch, device, dtype)
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
        config = _unwrap_model(transformer).config
        self._set_image_size(height, width, vae_scale_factor, vae_config, _SD3_VAE)
        patch = config.patch_size
        multiple = self.vae_scale_factor * patch
        _check_multiples(self.height, self.width, multiple, multiple,
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
            _vae_value(vae_config, _SD3_VAE, "scaling_factor", "SD3Policy"))
        self.shift_factor = float(_vae_value(vae_config, _SD3_VAE, "shift_factor", "SD3Policy"))

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
        batch = self._check_latents(latents)
        dtype, device = self._model_dtype(), latents.device
        t = self._step_values(self.timesteps, step_index, batch)
        cond = self._conditions(conditions, batch, device, dtype)
        x = latents.to(dtype)
        prompt, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.do_classifier_free_guidance:
            negative = cond["negative_prompt_embeds"]
            if negative.shape[1] != prompt.shape[1]:
                raise ValueError(
                    f"negative_prompt_embeds has {negative.shape[1]} tokens and prompt_embeds "
                    f"{prompt.shape[1]}; they go through the transformer as one batch, pad both "
                    f"to the same length (the pipeline's encoders do)")
            x, t = torch.cat([x, x]), torch.cat([t, t])
            prompt = torch.cat([negative, prompt])
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
        config = _unwrap_model(transformer).config
        if vae_scale_factor_spatial is None:
            vae_scale_factor_spatial = _vae_value(
                vae_config, _WAN_VAE, "scale_factor_spatial", "WanPolicy")
        if vae_scale_factor_temporal is None:
            vae_scale_factor_temporal = _vae_value(
                vae_config, _WAN_VAE, "scale_factor_temporal", "WanPolicy")
        self.vae_scale_factor_spatial = _int_arg(
            "vae_scale_factor_spatial", vae_scale_factor_spatial, minimum=1)
        self.vae_scale_factor_temporal = _int_arg(
            "vae_scale_factor_temporal", vae_scale_factor_temporal, minimum=1)
        self.height = _int_arg("height", height, minimum=1)
        self.width = _int_arg("width", width, minimum=1)
        self.num_frames = _int_arg("num_frames", num_frames, minimum=1)
        p_t, p_h, p_w = config.patch_size
        s, tf = self.vae_scale_factor_spatial, self.vae_scale_factor_temporal
        _check_multiples(self.height, self.width, s * p_h, s * p_w,
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
        self.latents_mean = list(_vae_value(vae_config, _WAN_VAE, "latents_mean", "WanPolicy"))
        self.latents_std = list(_vae_value(vae_config, _WAN_VAE, "latents_std", "WanPolicy"))

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
        batch = self._check_latents(latents)
        dtype, device = self._model_dtype(), latents.device
        t = self._step_values(self.timesteps, step_index, batch)
        cond = self._conditions(conditions, batch, device, dtype)
        x, prompt = latents.to(dtype), cond["prompt_embeds"]
        if self.do_classifier_free_guidance:
            negative = cond["negative_prompt_embeds"]
            if negative.shape[1] != prompt.shape[1]:
                raise ValueError(
                    f"negative_prompt_embeds has {negative.shape[1]} tokens and prompt_embeds "
                    f"{prompt.shape[1]}; they go through the transformer as one batch, pad both "
                    f"to the same length (WanPipeline pads to max_sequence_length)")
            x, t, prompt = torch.cat([x, x]), torch.cat([t, t]), torch.cat([negative, prompt])
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
