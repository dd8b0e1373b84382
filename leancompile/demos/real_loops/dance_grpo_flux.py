"""DanceGRPO's ``fastvideo/train_grpo_flux.py`` on a tiny random-init FLUX (see the package
docstring)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .common import LoopRun, compiled_as, finish_run, grad_snapshot, phase, start_run
from .flow_grpo_sd3 import latent_reward

__all__ = ["DanceGRPOConfig", "tiny_flux_transformer", "flux_prompt_bank", "prepare_dance_grpo",
           "dance_grpo_train_flux"]


# ---------------------------------------------------------------------------------------------
# DanceGRPO: fastvideo/train_grpo_flux.py


@dataclass(frozen=True, kw_only=True)
class DanceGRPOConfig:
    """The ``args`` ``train_grpo_flux.py`` reads, shrunk from
    ``scripts/finetune/finetune_flux_grpo.sh`` (one prompt per step, ``use_group``,
    ``init_same_noise``, ``timestep_fraction=0.6``, ``eta=0.3``, ``shift=3``; 4 generations
    and 2 accumulation steps instead of 12 and 4: two optimizer steps per rollout)."""

    seed: int = 42
    mixed_precision: str = "no"
    """``"bf16"``: the script's ``torch.autocast(..., torch.bfloat16)`` around the transformer
    calls and its bfloat16 initial noise, on the latents' device; ``"no"``: float32 throughout
    (the script's autocast names ``"cuda"``, which does nothing to CPU tensors, and its
    bfloat16 noise would then meet float32 weights)."""
    h: int = 64
    w: int = 64
    sampling_steps: int = 5
    eta: float = 0.3
    shift: float = 3.0
    num_generations: int = 4
    train_batch_size: int = 1
    use_group: bool = True
    init_same_noise: bool = True
    timestep_fraction: float = 0.6
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    gradient_accumulation_steps: int = 2
    learning_rate: float = 1e-5
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    max_train_steps: int = 1
    prompts: int = 4
    sampler_seed: int = 1223627
    text_tokens: int = 8


def tiny_flux_transformer(seed: int = 0):
    """A random-init ``FluxTransformer2DModel`` (1 double + 1 single block, the tests'
    ``tiny_flux_policy`` sizes) taking DanceGRPO's packed latents: 16 latent channels packed
    2x2 into 64."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=True)


def flux_prompt_bank(prompts: int = 4, tokens: int = 8, seed: int = 1) -> dict:
    """Stand-ins for the preprocessed embeddings DanceGRPO's data set loads: per prompt the T5
    embeddings ``[tokens, 32]``, the pooled CLIP embedding ``[32]`` and the text ids ``[3]``
    (zeros; ``FluxPipeline.encode_prompt``'s ``[tokens, 3]`` indexed by sample)."""
    g = torch.Generator().manual_seed(seed)
    return {"encoder_hidden_states": torch.randn(prompts, tokens, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(prompts, 32, generator=g),
            "text_ids": torch.zeros(prompts, 3)}


def _sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def _dance_flux_step(model_output, latents, eta, sigmas, index, prev_sample):
    """DanceGRPO's GRPO transition (its ``sde_solver`` form): the Euler mean plus the score
    correction, the next latent drawn with ``randn_like`` when ``prev_sample`` is None, and the
    log-density of the detached next latent, averaged over all but the batch dimension.
    Returns (next latent, predicted clean latent, log-prob)."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    mean = latents + dsigma * model_output
    x0 = latents - sigma * model_output
    std = eta * math.sqrt(sigma - sigmas[index + 1])
    score = -(latents - x0 * (1 - sigma)) / sigma ** 2
    mean = mean + (-0.5 * eta ** 2 * score) * dsigma
    if prev_sample is None:
        prev_sample = mean + torch.randn_like(mean) * std
    log_prob = (-((prev_sample.detach().float() - mean.float()) ** 2) / (2 * std ** 2)
                - math.log(std) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev_sample, x0, log_prob.mean(dim=tuple(range(1, log_prob.dim())))


def _pack(latents, batch, channels, height, width):
    x = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(batch, (height // 2) * (width // 2), channels * 4)


def _image_ids(height, width, device, dtype):
    ids = torch.zeros(height, width, 3)
    ids[..., 1] += torch.arange(height)[:, None]
    ids[..., 2] += torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(device=device, dtype=dtype)


def prepare_dance_grpo(transformer, config: DanceGRPOConfig = DanceGRPOConfig(), *,
                       compile: str = "eager", backend: str = "inductor",
                       schedule: str = "retain"):
    """``train_grpo_flux.py``'s model lines on ``transformer`` (``tiny_flux_transformer``;
    changed in place: pass a copy): float32 master weights on the device, every parameter
    trained (the script wraps it in FSDP here: one process has no FSDP), then the ``compile``
    line. Returns the transformer as the loop holds it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    transformer = transformer.to(device)
    return compiled_as(transformer, compile, backend, schedule)  # LeanGRPO


def dance_grpo_train_flux(transformer, prompts: dict, config: DanceGRPOConfig = DanceGRPOConfig(),
                          *, schedule: str | None = None, reward=latent_reward) -> LoopRun:
    """``train_grpo_flux.py``'s ``main`` and ``train_one_step`` on a ``prepare_dance_grpo``
    transformer and ``prompts`` (``flux_prompt_bank``). ``schedule``: the LeanGRPO rollouts'
    schedule (None: the wrapper's).

    As the script: ``set_seed(seed + rank)``, ``transformer.train()``, AdamW, a constant LR
    schedule; per step: ``optimizer.zero_grad()``, the step's prompts repeated
    ``num_generations`` times, one initial noise shared by the batch (``init_same_noise``), the
    samples drawn one at a time (``transformer.eval()`` before every sampling call, the SDE's
    noise drawn inside with ``randn_like``), rewards of the last predicted clean latents,
    per-group advantages; every sample's first ``T - 1`` steps permuted by its own ``randperm``
    (after the rollout), and each sample trained alone on the first ``int((T - 1) *
    timestep_fraction)`` of its permuted steps (``transformer.train()`` before every call),
    loss over ``gradient_accumulation_steps * train_timesteps``, ``backward``; every
    ``gradient_accumulation_steps`` samples ``clip_grad_norm_``, ``optimizer.step()``, the LR
    step and ``zero_grad``.

    Left out: FSDP and its mixed-precision policy, gradient checkpointing, sequence
    parallelism, the VAE decode, image saving and the HPS/PickScore reward (``reward`` scores
    the predicted clean latents), EMA, logging, checkpoints."""
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler

    set_seed(config.seed + 0)
    device = next(transformer.parameters()).device
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=config.weight_decay, eps=1e-8)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer,
                                 num_warmup_steps=0, num_training_steps=1000000)
    run = start_run(transformer)  # (measurement)
    bf16 = config.mixed_precision == "bf16"
    noise_dtype = torch.bfloat16 if bf16 else torch.float32
    order = torch.randperm(config.prompts, generator=torch.Generator().manual_seed(
        config.sampler_seed)).tolist()
    bank = {k: v.to(device) for k, v in prompts.items()}
    T = config.sampling_steps
    channels, latent_h, latent_w = 16, config.h // 8, config.w // 8

    def autocast():
        return torch.autocast(device.type, torch.bfloat16, enabled=bf16)

    def call(latents, embeds, pooled, text_ids, image_ids, timesteps):
        with autocast():
            return transformer(
                hidden_states=latents, encoder_hidden_states=embeds, timestep=timesteps / 1000,
                guidance=torch.tensor([3.5], device=latents.device, dtype=torch.bfloat16),
                txt_ids=text_ids.repeat(embeds.shape[1], 1), pooled_projections=pooled,
                img_ids=image_ids, joint_attention_kwargs=None, return_dict=False)[0]

    for step in range(1, config.max_train_steps + 1):
        optimizer.zero_grad()
        chosen = [order[(step - 1) * config.train_batch_size + b]
                  for b in range(config.train_batch_size)]
        embeds = bank["encoder_hidden_states"][chosen]
        pooled = bank["pooled_prompt_embeds"][chosen]
        text_ids = bank["text_ids"][chosen]
        if config.use_group:
            embeds = embeds.repeat_interleave(config.num_generations, 0)
            pooled = pooled.repeat_interleave(config.num_generations, 0)
            text_ids = text_ids.repeat_interleave(config.num_generations, 0)

        # sample_reference_model
        start = time.perf_counter()
        sigmas = _sd3_time_shift(config.shift, torch.linspace(1, 0, T + 1))
        B = embeds.shape[0]
        all_latents, all_log_probs, rewards, all_image_ids = [], [], [], []
        if config.init_same_noise:
            noise = torch.randn((1, channels, latent_h, latent_w), device=device,
                                dtype=noise_dtype)
        with phase(transformer, "rollout", train=range(T - 1), trajectory_steps=T,  # LeanGRPO
                    schedule=schedule):
            for index in range(B):
                rows = slice(index, index + 1)
                if not config.init_same_noise:
                    noise = torch.randn((1, channels, latent_h, latent_w), device=device,
                                        dtype=noise_dtype)
                z = _pack(noise, 1, channels, latent_h, latent_w)
                image_ids = _image_ids(latent_h // 2, latent_w // 2, device, torch.bfloat16)
                with torch.no_grad():
                    trajectory, log_probs = [z], []
                    for i in range(T):
                        timesteps = torch.full([1], int(sigmas[i] * 1000), device=device,
                                               dtype=torch.long)
                        transformer.eval()
                        pred = call(z, embeds[rows], pooled[rows], text_ids[rows], image_ids,
                                    timesteps)
                        z, x0, log_prob = _dance_flux_step(pred, z.to(torch.float32), config.eta,
                                                           sigmas, i, None)
                        trajectory.append(z)
                        log_probs.append(log_prob)
                all_latents.append(torch.stack(trajectory, dim=1))
                all_log_probs.append(torch.stack(log_probs, dim=1))
                all_image_ids.append(image_ids)
                rewards.append(reward(x0).to(device).float())
        all_latents = torch.cat(all_latents)
        all_log_probs = torch.cat(all_log_probs)
        rewards = torch.cat(rewards)
        all_image_ids = torch.stack(all_image_ids)
        run.log_probs = all_log_probs.detach().clone()
        run.rewards.append(rewards.mean().item())
        run.rollout_seconds += time.perf_counter() - start

        start = time.perf_counter()
        timestep_values = [int(s * 1000) for s in sigmas][:T]
        timesteps = torch.tensor([timestep_values] * B, device=device, dtype=torch.long)
        samples = {"timesteps": timesteps[:, :-1], "latents": all_latents[:, :-1][:, :-1],
                   "next_latents": all_latents[:, 1:][:, :-1],
                   "log_probs": all_log_probs[:, :-1], "rewards": rewards,
                   "image_ids": all_image_ids, "text_ids": text_ids,
                   "encoder_hidden_states": embeds, "pooled_prompt_embeds": pooled}
        if config.use_group:
            advantages = torch.zeros_like(samples["rewards"])
            for g in range(len(samples["rewards"]) // config.num_generations):
                part = slice(g * config.num_generations, (g + 1) * config.num_generations)
                group = samples["rewards"][part]
                advantages[part] = (group - group.mean()) / (group.std() + 1e-8)
        else:
            r = samples["rewards"]
            advantages = (r - r.mean()) / (r.std() + 1e-8)
        samples["advantages"] = advantages
        perms = torch.stack([torch.randperm(len(samples["timesteps"][0]))
                             for _ in range(B)]).to(device)
        for key in ("timesteps", "latents", "next_latents", "log_probs"):
            samples[key] = samples[key][torch.arange(B, device=device)[:, None], perms]
        batched = {k: v.unsqueeze(1) for k, v in samples.items()}
        batched = [dict(zip(batched, x)) for x in zip(*batched.values())]
        train_timesteps = int(len(samples["timesteps"][0]) * config.timestep_fraction)
        with phase(transformer, "update"):  # LeanGRPO
            for i, sample in enumerate(batched):
                for k in range(train_timesteps):
                    transformer.train()
                    pred = call(sample["latents"][:, k], sample["encoder_hidden_states"],
                                sample["pooled_prompt_embeds"], sample["text_ids"],
                                sample["image_ids"].squeeze(0), sample["timesteps"][:, k])
                    _, _, new_log_prob = _dance_flux_step(
                        pred, sample["latents"][:, k].to(torch.float32), config.eta, sigmas,
                        perms[i][k], sample["next_latents"][:, k].to(torch.float32))
                    adv = torch.clamp(sample["advantages"], -config.adv_clip_max,
                                      config.adv_clip_max)
                    ratio = torch.exp(new_log_prob - sample["log_probs"][:, k])
                    run.record_call(ratio, new_log_prob, sample["log_probs"][:, k],  # (measurement)
                                    clip_range=config.clip_range, step=int(perms[i][k]), samples=1)
                    clipped = torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)
                    loss = torch.mean(torch.maximum(-adv * ratio, -adv * clipped)) / (
                        config.gradient_accumulation_steps * train_timesteps)
                    loss.backward()
                if (i + 1) % config.gradient_accumulation_steps == 0:
                    torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                    run.grads.append(grad_snapshot(transformer))  # (measurement)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
        run.update_seconds += time.perf_counter() - start
    return finish_run(run, transformer)
