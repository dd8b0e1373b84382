"""What the diffusers policies share (``FlowMatchPolicy``): the flow-matching sigma schedule
of a ``FlowMatchEulerDiscreteScheduler``, step indexing without a host sync, the checks of
latents and conditions, the transformer's dtype, classifier-free guidance in float32; and the
helpers the per-model policies use (``flux_policy.py``, ``sd3_policy.py``, ``wan_policy.py``;
``diffusers.py`` is the entry that re-exports them).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch
from torch import nn

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from ..lean import LeanModule

__all__ = ["FlowMatchPolicy", "calculate_shift", "select_conditions", "int_arg",
           "check_multiples", "vae_value", "unwrap_model", "outer_module"]


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


def int_arg(name: str, value, *, minimum: int) -> int:
    """``value`` as an int, refused unless it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def check_multiples(height: int, width: int, mult_h: int, mult_w: int, why: str):
    """Refuse a size that is not a multiple of ``(mult_h, mult_w)``, naming the nearest one."""
    if height % mult_h or width % mult_w:
        raise ValueError(
            f"height={height}, width={width} must be multiples of ({mult_h}, {mult_w}) ({why}); "
            f"use height={height // mult_h * mult_h}, width={width // mult_w * mult_w}")


def vae_value(vae_config: Mapping | None, defaults: Mapping, key: str, policy: str):
    """``vae_config[key]``, or the default VAE's when no ``vae_config`` is given."""
    if vae_config is None:
        return defaults[key]
    value = vae_config.get(key)
    if value is None:
        raise ValueError(f"vae_config has no {key!r} (got {value!r}); {policy} needs it. Pass the "
                         f"config of the VAE the pipeline decodes with (vae.config)")
    return value


def unwrap_model(module) -> nn.Module:
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


def outer_module(module) -> nn.Module | None:
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
        base = unwrap_model(transformer)
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
            self.transformer_module = outer_module(transformer)
        self.transformer = transformer
        """What ``velocity`` calls: the diffusers transformer, a ``DistributedDataParallel``
        around it (its gradient all-reduce then runs in the user's backward, as in FlowGRPO's
        accelerate loops), or ``lean_compile(...)`` of either."""
        self.num_inference_steps = int_arg("num_inference_steps", num_inference_steps, minimum=1)
        self.guidance_scale = float(guidance_scale)

    @property
    def base_transformer(self) -> nn.Module:
        """The diffusers transformer (``transformer.module`` when it is wrapped in DDP)."""
        return unwrap_model(self.transformer)

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
            blocks = vae_value(vae_config, vae_defaults, "block_out_channels",
                                type(self).__name__)
            vae_scale_factor = 2 ** (len(blocks) - 1)
        self.vae_scale_factor = int_arg("vae_scale_factor", vae_scale_factor, minimum=1)
        self.height = int_arg("height", height, minimum=1)
        self.width = int_arg("width", width, minimum=1)

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
        batch = int_arg("batch", batch, minimum=1)
        length = int_arg("sequence_length", sequence_length if sequence_length is not None
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
        batch = int_arg("batch", batch, minimum=1)
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

    def _step_inputs(self, latents, step_index, conditions) -> tuple:
        """What every policy's ``forward`` starts from, checked: (batch, the transformer's dtype,
        the step's timesteps ``[batch]``, the conditions in that dtype on the latents'
        device)."""
        batch = self._check_latents(latents)
        dtype = self._model_dtype()
        t = self._step_values(self.timesteps, step_index, batch)
        return batch, dtype, t, self._conditions(conditions, batch, latents.device, dtype)

    def _negative_first(self, negative: torch.Tensor, prompt: torch.Tensor, *, padded_by: str
                        ) -> torch.Tensor:
        """``[negative; prompt]``: the two prompts' embeddings as the one batch classifier-free
        guidance runs; a ``ValueError`` when their token counts differ (``padded_by``: what pads
        them to one length in the pipeline)."""
        if negative.shape[1] != prompt.shape[1]:
            raise ValueError(
                f"negative_prompt_embeds has {negative.shape[1]} tokens and prompt_embeds "
                f"{prompt.shape[1]}; they go through the transformer as one batch, pad both "
                f"to the same length ({padded_by})")
        return torch.cat([negative, prompt])

    def _guide(self, output: torch.Tensor) -> torch.Tensor:
        """``uncond + g * (cond - uncond)`` on a ``[uncond; cond]`` batch, in float32."""
        output = output.float()
        if not self.do_classifier_free_guidance:
            return output
        uncond, cond = output.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)
