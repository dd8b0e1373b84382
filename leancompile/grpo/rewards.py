"""Reward functions for LeanGRPO, and the checks every reward's output goes through.

A reward is any callable ``reward(images_or_latents, conditions) -> Tensor[B]``: one float32
reward per sample. ``conditions`` is a dict of batch-first tensors (prompt embeddings, ids,
...) that the reward may use or ignore. Image rewards take ``images`` of shape [B, 3, H, W]
with values in [0, 1]; ``decoded(reward, vae=..., to_vae_latents=...)`` turns one into a
latent reward by decoding through a diffusers ``AutoencoderKL`` first.

What is here:

* ``jpeg_compressibility`` / ``jpeg_incompressibility``: the JPEG-size rewards of DDPO
  (kvablack/ddpo-pytorch, ``ddpo_pytorch/rewards.py``), same conversion, quality and units.
* ``TargetColorReward``: a cheap, exact toy reward (distance of the pixels, or of the mean
  brightness, to a target colour) for tests and first runs.
* ``decode_latents`` and ``decoded``: VAE decoding with diffusers' postprocessing.
* ``check_rewards``: shape, dtype and finiteness of a reward's output, with errors that name
  the samples at fault.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from collections.abc import Callable, Mapping

import numpy as np
import torch

__all__ = [
    "Reward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "TargetColorReward",
    "decode_latents",
    "decoded",
    "check_rewards",
]

Reward = Callable[[torch.Tensor, Mapping[str, torch.Tensor] | None], torch.Tensor]
"""The reward signature: ``(images_or_latents, conditions) -> Tensor[B]`` (float32)."""

JPEG_QUALITY = 95
"""JPEG quality of the compressibility rewards (DDPO's value)."""

TARGET_COLOR_MODES = ("color", "brightness")


def _check_images(images, who: str) -> None:
    """Raise if ``images`` is not a floating [B, 3, H, W] tensor."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"{who} takes images as a torch.Tensor of shape [B, 3, H, W] with values in "
            f"[0, 1], got {type(images).__name__}; decode latents first, e.g. with "
            "decoded(reward, vae=..., to_vae_latents=...)")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            f"{who} takes images of shape [B, 3, H, W], got shape {tuple(images.shape)}; "
            "pass RGB images channels-first (for HWC use images.permute(0, 3, 1, 2))")
    if not images.is_floating_point():
        raise TypeError(
            f"{who} takes float images with values in [0, 1], got dtype {images.dtype}; "
            "convert uint8 images with images.float() / 255")


def _jpeg_size_kb(images: torch.Tensor) -> torch.Tensor:
    """JPEG size in kB (1 kB = 1000 bytes) of each image, as DDPO computes it.

    Each image goes ``(x * 255).round().clamp(0, 255)`` to uint8, channels-last, to a PIL
    RGB image saved as JPEG at quality 95 into a ``BytesIO``; the size is the buffer's
    length / 1000. The scaling is done in float32 so that bf16/fp16 images round the same.
    """
    from PIL import Image

    pixels = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    pixels = pixels.cpu().numpy().transpose(0, 2, 3, 1)  # NCHW -> NHWC
    sizes = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).save(
            buffer, format="JPEG", quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32, device=images.device)


def jpeg_incompressibility(images: torch.Tensor, conditions=None) -> torch.Tensor:
    """Reward = JPEG size in kB of each image: ``+size_kb`` (larger files score higher).

    ``images``: float [B, 3, H, W] in [0, 1] (values outside are clamped after scaling to
    0..255, as in DDPO). ``conditions`` is ignored. Not differentiable. Returns float32 [B]
    on the images' device.
    """
    _check_images(images, "jpeg_incompressibility")
    return _jpeg_size_kb(images)


def jpeg_compressibility(images: torch.Tensor, conditions=None) -> torch.Tensor:
    """Reward = minus the JPEG size in kB of each image: ``-size_kb`` (smaller files score
    higher), DDPO's compressibility reward.

    Same conversion as ``jpeg_incompressibility``. FlowGRPO's version divides this by a
    further 500 (``-size_kb / 500``); we keep DDPO's unscaled kB, since the group-normalised
    GRPO advantage does not depend on a constant factor.
    """
    _check_images(images, "jpeg_compressibility")
    return -_jpeg_size_kb(images)


@dataclass(frozen=True, kw_only=True)
class TargetColorReward:
    """Negative squared distance of an image to a target colour; exact, cheap, for tests.

    For images ``x`` of shape [B, 3, H, W] and ``target = (t_r, t_g, t_b)``:

    * ``mode="color"``: ``r_b = -(1 / (H*W)) * sum_{h,w} sum_c (x[b, c, h, w] - t_c)**2``,
      the mean over pixels of each pixel's squared Euclidean RGB distance to the target.
      An all-red image scores 0 against red and -2 against green.
    * ``mode="brightness"``: ``r_b = -(mean_{c,h,w} x[b, c, h, w] - mean_c t_c)**2``, the
      squared difference between the image's mean brightness (mean over channels and
      pixels) and the target's (mean of its three values).

    Computed in float32; differentiable in ``x``. ``conditions`` is ignored.
    """

    target: tuple[float, float, float] = (1.0, 0.0, 0.0)
    """Target RGB colour, three floats in [0, 1] (default red)."""

    mode: str = "color"
    """``"color"``: distance of every pixel to ``target``; ``"brightness"``: distance of the
    image's mean brightness to the target's mean brightness."""

    def __post_init__(self):
        try:
            target = tuple(float(v) for v in self.target)
        except (TypeError, ValueError):
            raise TypeError(
                f"TargetColorReward target={self.target!r} is not three numbers; pass an "
                "RGB triple in [0, 1], e.g. target=(1.0, 0.0, 0.0)") from None
        if len(target) != 3:
            raise ValueError(
                f"TargetColorReward target={self.target!r} has {len(target)} values; pass "
                "an RGB triple in [0, 1], e.g. target=(1.0, 0.0, 0.0)")
        if not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in target):
            raise ValueError(
                f"TargetColorReward target={target!r} has values outside [0, 1]; scale "
                "0..255 colours by 1/255, e.g. (255, 128, 0) -> (1.0, 0.502, 0.0)")
        object.__setattr__(self, "target", target)
        if self.mode not in TARGET_COLOR_MODES:
            raise ValueError(
                f"TargetColorReward mode={self.mode!r} is not supported; use one of "
                f"{TARGET_COLOR_MODES}")

    def __call__(self, images: torch.Tensor, conditions=None) -> torch.Tensor:
        _check_images(images, "TargetColorReward")
        x = images.float()
        target = torch.tensor(self.target, dtype=torch.float32, device=x.device)
        if self.mode == "color":
            squared = (x - target.view(1, 3, 1, 1)).square().sum(dim=1)  # [B, H, W]
            return -squared.mean(dim=(1, 2))
        brightness = x.mean(dim=(1, 2, 3))  # [B]
        return -(brightness - target.mean()).square()


def decode_latents(vae, vae_latents: torch.Tensor) -> torch.Tensor:
    """Decode VAE latents to float32 images [B, 3, H, W] in [0, 1], without gradients.

    ``vae`` is a diffusers ``AutoencoderKL``; ``vae_latents`` are in the VAE's own space
    (already unpacked, divided by ``scaling_factor`` and shifted by ``shift_factor``, as the
    pipelines do before ``vae.decode``). The latents are cast to the VAE's device and dtype,
    decoded with ``vae.decode(latents, return_dict=False)[0]``, and mapped from [-1, 1] to
    [0, 1] by ``(x / 2 + 0.5).clamp(0, 1)``, which is ``VaeImageProcessor.denormalize``
    (``images * 0.5 + 0.5`` clamped) that the pipelines' ``postprocess`` applies.
    """
    if not callable(getattr(vae, "decode", None)):
        raise TypeError(
            f"decode_latents needs a VAE with a decode() method (a diffusers "
            f"AutoencoderKL), got {type(vae).__name__}; pass pipe.vae")
    if not isinstance(vae_latents, torch.Tensor):
        raise TypeError(
            f"decode_latents takes the latents as a torch.Tensor, got "
            f"{type(vae_latents).__name__}")
    dtype = getattr(vae, "dtype", vae_latents.dtype)
    device = getattr(vae, "device", vae_latents.device)
    with torch.no_grad():
        images = vae.decode(vae_latents.to(device=device, dtype=dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


def _reward_name(reward) -> str:
    name = getattr(reward, "__name__", None)
    if isinstance(name, str):
        return name
    return repr(reward)


class _DecodedReward:
    """A latent reward: ``latents -> to_vae_latents -> decode_latents(vae, .) -> reward``."""

    def __init__(self, reward, vae, to_vae_latents):
        self.reward = reward
        self.vae = vae
        self.to_vae_latents = to_vae_latents
        self.__name__ = f"decoded({_reward_name(reward)})"

    def __call__(self, latents: torch.Tensor, conditions=None) -> torch.Tensor:
        images = decode_latents(self.vae, self.to_vae_latents(latents))
        return self.reward(images, conditions)

    def __repr__(self) -> str:
        return (f"decoded({_reward_name(self.reward)}, vae={type(self.vae).__name__}, "
                f"to_vae_latents={_reward_name(self.to_vae_latents)})")


def decoded(reward, *, vae, to_vae_latents) -> Reward:
    """Wrap an image reward into a reward on the policy's latents.

    The returned callable computes ``reward(decode_latents(vae, to_vae_latents(latents)),
    conditions)``. ``to_vae_latents`` is supplied by the policy: it maps the sampler's
    latents to the VAE's space (for FLUX: unpack the 2x2 patch sequence, then
    ``latents / scaling_factor + shift_factor``). Decoding runs without gradients, so the
    result is a non-differentiable reward, as GRPO needs. Its ``__name__`` is
    ``"decoded(<reward name>)"``.
    """
    if not callable(reward):
        raise TypeError(
            f"decoded() wraps an image reward callable (images, conditions) -> Tensor[B], "
            f"got {type(reward).__name__}")
    if not callable(to_vae_latents):
        raise TypeError(
            f"decoded() needs to_vae_latents, a callable latents -> VAE latents (the "
            f"policy provides it), got {type(to_vae_latents).__name__}")
    if not callable(getattr(vae, "decode", None)):
        raise TypeError(
            f"decoded() needs a VAE with a decode() method (a diffusers AutoencoderKL), "
            f"got {type(vae).__name__}; pass pipe.vae")
    return _DecodedReward(reward, vae, to_vae_latents)


def check_rewards(rewards, batch: int, *, name: str | None = None) -> torch.Tensor:
    """Check a reward function's output and return it as float32.

    ``rewards`` must be a 1-D floating tensor of length ``batch`` (the number of samples the
    reward was given) with only finite values; ``name`` (the reward's name) goes into the
    error messages. Raises ``TypeError`` for a non-tensor or a non-float dtype,
    ``ValueError`` for a wrong shape or for NaN/inf values, naming the samples at fault.
    """
    who = f"the reward function {name}" if name else "the reward function"
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise TypeError(
            f"check_rewards takes batch as the number of samples (an int >= 0), got "
            f"{batch!r}; pass images.shape[0]")
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(
            f"{who} returned {type(rewards).__name__}, not a torch.Tensor; return "
            f"torch.as_tensor(rewards, dtype=torch.float32) of shape [{batch}]")
    if not rewards.is_floating_point():
        raise TypeError(
            f"{who} returned dtype {rewards.dtype}; rewards must be floating point, return "
            "rewards.float()")
    if tuple(rewards.shape) != (batch,):
        raise ValueError(
            f"{who} returned shape {tuple(rewards.shape)}, expected ({batch},): one reward "
            f"per sample; e.g. reduce per-pixel scores with .mean(dim=(1, 2, 3)) or drop a "
            "trailing 1 with .squeeze(-1)")
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        values = ", ".join(str(v) for v in rewards[bad].tolist())
        raise ValueError(
            f"rewards of samples {bad} are not finite ({values}); check {who} on those "
            "samples (a division by zero, a log of 0, or images outside [0, 1])")
    return rewards.float()
