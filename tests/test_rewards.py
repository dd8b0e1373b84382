"""LeanGRPO rewards: JPEG sizes against PIL, exact TargetColorReward values, VAE decoding
against diffusers' own decode + postprocess, and check_rewards' errors."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from leancompile.grpo.rewards import (
    TargetColorReward,
    check_rewards,
    decode_latents,
    decoded,
    jpeg_compressibility,
    jpeg_incompressibility,
)


def _flat(color, size=32):
    return torch.tensor(color, dtype=torch.float32).view(3, 1, 1).expand(3, size, size)


def _pil_jpeg_kb(image_chw: torch.Tensor) -> float:
    """Independent reference: 0..255 by numpy rounding, PIL JPEG q95, bytes / 1000."""
    array = np.clip(np.rint(image_chw.numpy().astype(np.float64) * 255), 0, 255)
    array = array.astype(np.uint8).transpose(1, 2, 0).copy()
    buffer = io.BytesIO()
    Image.fromarray(array, mode="RGB").save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


@pytest.fixture(scope="module")
def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4, sample_size=16)
    return vae.eval()


# --- JPEG ---------------------------------------------------------------------------------

def test_flat_image_compresses_better_than_noise():
    torch.manual_seed(0)
    images = torch.stack([_flat((0.2, 0.5, 0.8)), torch.rand(3, 32, 32)])
    comp = jpeg_compressibility(images, {})
    incomp = jpeg_incompressibility(images, {})
    assert comp.dtype == torch.float32 and comp.shape == (2,)
    assert comp[0] > comp[1]
    assert incomp[1] > incomp[0]
    torch.testing.assert_close(comp, -incomp, rtol=0, atol=0)


def test_jpeg_size_matches_pil_reference():
    torch.manual_seed(1)
    # Values slightly outside [0, 1] and on .5 boundaries exercise the clamp and rounding.
    images = torch.rand(3, 3, 24, 40) * 1.2 - 0.1
    images[1] = _flat((1.0, 0.0, 0.0), 24)[:, :, :1].expand(3, 24, 40)
    expected = torch.tensor([_pil_jpeg_kb(image) for image in images])
    torch.testing.assert_close(jpeg_incompressibility(images), expected, rtol=0, atol=0)
    torch.testing.assert_close(jpeg_compressibility(images), -expected, rtol=0, atol=0)
    assert (expected > 0.3).all()  # a real JPEG (headers alone are ~0.6 kB), in kB


def test_jpeg_bf16_images_round_like_float32():
    torch.manual_seed(2)
    images = torch.rand(2, 3, 16, 16).to(torch.bfloat16)
    torch.testing.assert_close(jpeg_incompressibility(images),
                               jpeg_incompressibility(images.float()), rtol=0, atol=0)


def test_jpeg_rejects_latents_and_hwc():
    with pytest.raises(ValueError, match=r"shape \[B, 3, H, W\], got shape \(2, 4, 8, 8\)"):
        jpeg_compressibility(torch.rand(2, 4, 8, 8))
    with pytest.raises(TypeError, match="dtype torch.uint8"):
        jpeg_compressibility(torch.zeros(1, 3, 8, 8, dtype=torch.uint8))


# --- TargetColorReward --------------------------------------------------------------------

def test_target_color_exact_values():
    red, green, gray = _flat((1, 0, 0), 8), _flat((0, 1, 0), 8), _flat((0.5, 0.5, 0.5), 8)
    half = red.clone()
    half[:, :, 4:] = green[:, :, 4:]  # left half red, right half green
    images = torch.stack([red, green, gray, half])
    reward = TargetColorReward(target=(1.0, 0.0, 0.0))
    out = reward(images, {})
    # red: 0; green: 1 + 1; gray: .25 + .25 + .25; half: mean of 0 and 2.
    torch.testing.assert_close(out, torch.tensor([0.0, -2.0, -0.75, -1.0]))
    assert out.dtype == torch.float32


def test_target_brightness_exact_values():
    red, white = _flat((1, 0, 0), 4), _flat((1, 1, 1), 4)
    images = torch.stack([red, white, torch.zeros(3, 4, 4)])
    out = TargetColorReward(target=(0.0, 0.0, 0.0), mode="brightness")(images, None)
    # brightness = mean over channels and pixels: 1/3, 1, 0; target brightness 0.
    torch.testing.assert_close(out, torch.tensor([-(1 / 3) ** 2, -1.0, 0.0]))
    out = TargetColorReward(target=(0.0, 1.0, 0.5), mode="brightness")(images, None)
    torch.testing.assert_close(out, -(torch.tensor([1 / 3, 1.0, 0.0]) - 0.5) ** 2)


def test_target_color_validation():
    assert TargetColorReward(target=[0, 1, 0]).target == (0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="has 2 values"):
        TargetColorReward(target=(1.0, 0.0))
    with pytest.raises(ValueError, match=r"outside \[0, 1\].*1/255"):
        TargetColorReward(target=(255, 0, 0))
    with pytest.raises(ValueError, match=r"mode='hue'.*\('color', 'brightness'\)"):
        TargetColorReward(mode="hue")
    with pytest.raises(TypeError, match="not three numbers"):
        TargetColorReward(target="red")
    with pytest.raises(TypeError):
        TargetColorReward((1.0, 0.0, 0.0))  # keyword-only


# --- VAE decoding -------------------------------------------------------------------------

def test_decode_latents_matches_diffusers_decode_and_postprocess(tiny_vae):
    from diffusers.image_processor import VaeImageProcessor

    torch.manual_seed(3)
    latents = torch.randn(2, 4, 8, 8) * 3
    images = decode_latents(tiny_vae, latents)
    with torch.no_grad():
        raw = tiny_vae.decode(latents, return_dict=False)[0]
    expected = VaeImageProcessor().postprocess(raw, output_type="pt")
    assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32
    assert not images.requires_grad
    torch.testing.assert_close(images, expected, rtol=0, atol=0)
    torch.testing.assert_close(images, (raw / 2 + 0.5).clamp(0, 1), rtol=0, atol=0)
    assert images.min() >= 0 and images.max() <= 1
    assert (raw < -1).any()  # the clamp is exercised, not vacuous
    assert (images == 0).any()


def test_decoded_composes_unpack_decode_reward(tiny_vae):
    scaling = tiny_vae.config.scaling_factor

    def to_vae_latents(latents):  # a token sequence [B, 64, 4] -> [B, 4, 8, 8], unscaled
        return latents.view(-1, 8, 8, 4).permute(0, 3, 1, 2) / scaling

    torch.manual_seed(4)
    packed = torch.randn(3, 64, 4)
    seen = {}

    def mean_red(images, conditions):
        seen["conditions"] = conditions
        return images[:, 0].mean(dim=(1, 2))

    reward = decoded(mean_red, vae=tiny_vae, to_vae_latents=to_vae_latents)
    conditions = {"prompt_embeds": torch.zeros(3, 5)}
    out = reward(packed, conditions)
    assert seen["conditions"] is conditions
    # Reference without our helpers: unpack and unscale by hand, decode, postprocess.
    vae_latents = packed.reshape(3, 8, 8, 4).permute(0, 3, 1, 2) / scaling
    with torch.no_grad():
        raw = tiny_vae.decode(vae_latents, return_dict=False)[0]
    expected = (raw / 2 + 0.5).clamp(0, 1)[:, 0].mean(dim=(1, 2))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert reward.__name__ == "decoded(mean_red)"
    assert repr(reward) == ("decoded(mean_red, vae=AutoencoderKL, "
                            "to_vae_latents=to_vae_latents)")
    target = decoded(TargetColorReward(), vae=tiny_vae, to_vae_latents=to_vae_latents)
    assert target.__name__ == "decoded(TargetColorReward(target=(1.0, 0.0, 0.0), mode='color'))"
    assert check_rewards(target(packed, conditions), 3).shape == (3,)


def test_decoded_rejects_non_callables(tiny_vae):
    with pytest.raises(TypeError, match="to_vae_latents"):
        decoded(jpeg_compressibility, vae=tiny_vae, to_vae_latents=None)
    with pytest.raises(TypeError, match="decode\\(\\) method.*pipe.vae"):
        decoded(jpeg_compressibility, vae=object(), to_vae_latents=lambda x: x)


# --- check_rewards ------------------------------------------------------------------------

def test_check_rewards_accepts_and_returns_float32():
    out = check_rewards(torch.tensor([1.0, -2.0], dtype=torch.float64), 2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0]))


def test_check_rewards_names_non_finite_samples():
    rewards = torch.tensor([0.5, float("nan"), 1.0, float("inf"), -2.0])
    with pytest.raises(ValueError) as info:
        check_rewards(rewards, 5, name="jpeg_compressibility")
    message = str(info.value)
    assert message.startswith("rewards of samples [1, 3] are not finite (nan, inf); check "
                              "the reward function jpeg_compressibility")
    with pytest.raises(ValueError, match=r"samples \[0\] are not finite \(-inf\)"):
        check_rewards(torch.tensor([float("-inf"), 0.0]), 2)


def test_check_rewards_shape_and_type_errors():
    with pytest.raises(ValueError, match=r"shape \(4, 1\), expected \(4,\).*squeeze"):
        check_rewards(torch.zeros(4, 1), 4)
    with pytest.raises(ValueError, match=r"shape \(3,\), expected \(4,\)"):
        check_rewards(torch.zeros(3), 4)
    with pytest.raises(TypeError, match="returned ndarray, not a torch.Tensor"):
        check_rewards(np.zeros(4), 4)
    with pytest.raises(TypeError, match="dtype torch.int64.*rewards.float"):
        check_rewards(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(TypeError, match="number of samples"):
        check_rewards(torch.zeros(4), torch.zeros(4))
