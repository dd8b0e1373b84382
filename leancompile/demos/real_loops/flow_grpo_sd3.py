"""FlowGRPO's ``scripts/train_sd3.py`` on a tiny random-init SD3 (see the package docstring)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from .common import (LoopRun, compiled_as, finish_run, grad_snapshot, phase, reset_accelerate,
                     start_run, unprepare)

__all__ = ["FlowGRPOConfig", "SD3_LORA_TARGETS", "tiny_sd3_pipeline", "sd3_prompt_bank",
           "sd3_sde_step_with_logprob", "sd3_pipeline_with_logprob", "latent_reward",
           "prepare_flow_grpo", "flow_grpo_train_sd3"]

SD3_LORA_TARGETS = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
"""The modules ``train_sd3.py`` puts LoRA adapters on (``config.use_lora``)."""


# ---------------------------------------------------------------------------------------------
# FlowGRPO: scripts/train_sd3.py


@dataclass(frozen=True, kw_only=True)
class FlowGRPOConfig:
    """The ``config`` fields ``train_sd3.py`` reads, shrunk (``config/grpo.py``'s SD3 recipes:
    ``num_batches_per_epoch`` even and ``gradient_accumulation_steps = num_batches // 2``, so
    two optimizer steps per epoch; ``timestep_fraction=0.99``; ``beta=0.04``)."""

    seed: int = 42
    mixed_precision: str = "no"
    """``"no"`` or ``"bf16"`` (the Accelerator's; with LoRA the script adds no autocast of its
    own: the prepared model's forward runs under the Accelerator's)."""
    resolution: int = 32
    num_steps: int = 4
    """``sample.num_steps``: T."""
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    sample_batch_size: int = 4
    """``sample.train_batch_size``: images per sampling batch."""
    num_image_per_prompt: int = 2
    num_batches_per_epoch: int = 2
    same_latent: bool = False
    global_std: bool = True
    per_prompt_stat_tracking: bool = True
    train_batch_size: int = 4
    """``train.batch_size``: rows of the negative-prompt embeddings the training call slices."""
    gradient_accumulation_steps: int = 1
    """``train.gradient_accumulation_steps`` (samples' batches per optimizer step)."""
    num_inner_epochs: int = 1
    timestep_fraction: float = 0.99
    cfg: bool = True
    beta: float = 0.04
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    learning_rate: float = 3e-4
    adam_betas: tuple = (0.9, 0.999)
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lora_rank: int = 4
    lora_alpha: int = 8
    """The script's r=32, alpha=64, shrunk with the same scale (alpha / r = 2)."""
    lora_b_std: float = 0.05
    """LoRA's ``lora_B`` starts at zero, where the policy equals the reference (the KL and its
    gradient vanish) and ``lora_A`` gets no gradient: start from a trained-looking adapter
    (the script's ``train.lora_path``) with ``lora_B ~ N(0, std)`` drawn from its own
    generator. 0: the fresh adapter."""
    epochs: int = 1
    prompts: int = 6
    """Prompts in the data set."""
    text_tokens: int = 8

    @property
    def num_train_timesteps(self) -> int:
        return int(self.num_steps * self.timestep_fraction)


def tiny_sd3_pipeline(seed: int = 0, **sizes):
    """A ``StableDiffusion3Pipeline`` around a random-init 2-layer ``SD3Transformer2DModel``
    shaped like SD3.5-Medium (dual attention in the first block, RMS q/k norms), SD3's
    flow-matching scheduler (shift 3), no text encoders and no VAE (the loop passes prompt
    embeddings and scores latents). 32x32 images: 4x4 latents of 4 channels, 16 tokens.
    ``sizes``: other ``SD3Transformer2DModel`` sizes (``num_layers``, ``attention_head_dim``,
    ``num_attention_heads``, ``sample_size``, ``patch_size``, ``pos_embed_max_size``; the
    caption projection follows the hidden size, as in SD3)."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    torch.manual_seed(seed)
    shape = {"sample_size": 4, "patch_size": 1, "num_layers": 2, "attention_head_dim": 8,
             "num_attention_heads": 2, "pos_embed_max_size": 8, **sizes}
    transformer = SD3Transformer2DModel(
        in_channels=4, joint_attention_dim=32,
        caption_projection_dim=shape["attention_head_dim"] * shape["num_attention_heads"],
        pooled_projection_dim=32, out_channels=4, dual_attention_layers=(0,),
        qk_norm="rms_norm", **shape)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=None, text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def sd3_prompt_bank(prompts: int = 6, tokens: int = 8, seed: int = 1) -> dict:
    """Stand-ins for what ``compute_text_embeddings`` returns: per prompt of the data set its
    embeddings ``[tokens, 32]`` and pooled embedding ``[32]``, and the empty prompt's (the
    negative prompt)."""
    g = torch.Generator().manual_seed(seed)
    return {"prompt_embeds": torch.randn(prompts, tokens, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(prompts, 32, generator=g),
            "neg_prompt_embeds": torch.randn(1, tokens, 32, generator=g),
            "neg_pooled_prompt_embeds": torch.randn(1, 32, generator=g)}


def _k_repeat_batch(dataset_size: int, batch_size: int, k: int, seed: int, epoch: int) -> list:
    """The prompt indices ``DistributedKRepeatSampler`` yields for one sampling batch on one
    process: ``batch_size / k`` distinct prompts, each ``k`` times, in a shuffled order, all
    drawn from a generator seeded with ``seed + epoch``."""
    if batch_size % k:
        raise ValueError(f"{k} images per prompt do not divide a batch of {batch_size}")
    g = torch.Generator().manual_seed(seed + epoch)
    chosen = torch.randperm(dataset_size, generator=g)[:batch_size // k].tolist()
    repeated = [p for p in chosen for _ in range(k)]
    order = torch.randperm(len(repeated), generator=g).tolist()
    return [repeated[i] for i in order]


def sd3_sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7,
                              prev_sample=None, generator=None):
    """FlowGRPO's SDE transition for SD3's flow-matching scheduler, its ``sde`` variant: the
    mean of the next latent from the velocity, the step's standard deviation from the noise
    level, the next latent drawn (from the global generator unless one is given) when
    ``prev_sample`` is None, and the Gaussian log-density of the detached next latent averaged
    over all but the batch dimension. Returns (next latent, log-prob, mean, std)."""
    from diffusers.utils.torch_utils import randn_tensor

    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    index = [scheduler.index_for_timestep(t) for t in timestep]
    view = (-1,) + (1,) * (sample.dim() - 1)
    sigma = scheduler.sigmas[index].view(view)
    sigma_next = scheduler.sigmas[[i + 1 for i in index]].view(view)
    sigma_max = scheduler.sigmas[1].item()
    dt = sigma_next - sigma
    std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = (sample * (1 + std ** 2 / (2 * sigma) * dt)
            + model_output * (1 + std ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    scale = std * torch.sqrt(-1 * dt)
    if prev_sample is None:
        noise = randn_tensor(model_output.shape, generator=generator,
                             device=model_output.device, dtype=model_output.dtype)
        prev_sample = mean + scale * noise
    log_prob = (-((prev_sample.detach() - mean) ** 2) / (2 * scale ** 2) - torch.log(scale)
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.dim())))
    return prev_sample, log_prob, mean, std


@torch.no_grad()
def sd3_pipeline_with_logprob(pipeline, *, prompt_embeds, pooled_prompt_embeds,
                              negative_prompt_embeds, negative_pooled_prompt_embeds,
                              num_inference_steps, guidance_scale, height, width,
                              noise_level=0.7, generator=None):
    """FlowGRPO's SD3 sampling with log-probs: the diffusers pipeline's input checks, prompt
    handling, latent preparation and timesteps, one ``pipeline.transformer`` call per step on
    the unconditional and conditional rows concatenated, guidance, and the SDE step; the VAE
    decode is left out (the loop scores the final latents). Returns (final latents, every
    step's latents [T + 1], every step's log-probs [T])."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
        retrieve_timesteps)

    pipeline.check_inputs(
        None, None, None, height, width, prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds,
        pooled_prompt_embeds=pooled_prompt_embeds,
        negative_pooled_prompt_embeds=negative_pooled_prompt_embeds)
    pipeline._guidance_scale = guidance_scale
    pipeline._clip_skip = None
    pipeline._joint_attention_kwargs = None
    pipeline._interrupt = False
    batch = prompt_embeds.shape[0]
    device = pipeline._execution_device
    prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds, negative_pooled_prompt_embeds = (
        pipeline.encode_prompt(
            prompt=None, prompt_2=None, prompt_3=None,
            do_classifier_free_guidance=pipeline.do_classifier_free_guidance,
            prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds, device=device))
    if pipeline.do_classifier_free_guidance:
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds])
        pooled_prompt_embeds = torch.cat([negative_pooled_prompt_embeds, pooled_prompt_embeds])
    latents = pipeline.prepare_latents(
        batch, pipeline.transformer.config.in_channels, height, width, prompt_embeds.dtype,
        device, generator).float()
    timesteps, _ = retrieve_timesteps(pipeline.scheduler, num_inference_steps, device)
    all_latents, all_log_probs = [latents], []
    for t in timesteps:
        model_input = (torch.cat([latents, latents]) if pipeline.do_classifier_free_guidance
                       else latents)
        velocity = pipeline.transformer(
            hidden_states=model_input, timestep=t.expand(model_input.shape[0]),
            encoder_hidden_states=prompt_embeds, pooled_projections=pooled_prompt_embeds,
            joint_attention_kwargs=pipeline.joint_attention_kwargs, return_dict=False)[0]
        if pipeline.do_classifier_free_guidance:
            uncond, cond = velocity.chunk(2)
            velocity = uncond + pipeline.guidance_scale * (cond - uncond)
        latents, log_prob, _, _ = sd3_sde_step_with_logprob(
            pipeline.scheduler, velocity.float(), t.unsqueeze(0), latents.float(),
            noise_level=noise_level)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return latents, all_latents, all_log_probs


def latent_reward(latents: torch.Tensor) -> torch.Tensor:
    """Per sample, a score of its latents (the stand-in for decoding and an image reward)."""
    x = latents.float().flatten(1)
    return -(x - 0.3).square().mean(1) + 0.5 * x.mean(1)


def _per_prompt_advantages(prompt_ids: list, rewards: torch.Tensor, global_std: bool):
    """``PerPromptStatTracker.update``: each reward centred on its prompt's mean and divided by
    its prompt's standard deviation, or every reward's (``global_std``), plus 1e-4; in float64
    as numpy computes it there. ``rewards``: ``[samples, timesteps]``."""
    rewards = rewards.double()
    ids = torch.as_tensor(prompt_ids)
    out = torch.zeros_like(rewards)
    for p in ids.unique():
        rows = ids == p
        group = rewards[rows]
        std = (rewards.std(0, unbiased=False, keepdim=True) if global_std
               else group.std(0, unbiased=False, keepdim=True)) + 1e-4
        out[rows] = (group - group.mean(0, keepdim=True)) / std
    return out


def _flow_compute_log_prob(transformer, pipeline, sample, j, embeds, pooled_embeds, config):
    """One trained step: the transformer on the step's latents (twice, unconditional and
    conditional rows, with ``train.cfg``), guidance, and the SDE step scoring the recorded next
    latents."""
    if config.cfg:
        velocity = transformer(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds, pooled_projections=pooled_embeds,
            return_dict=False)[0]
        uncond, cond = velocity.chunk(2)
        velocity = uncond + config.guidance_scale * (cond - uncond)
    else:
        velocity = transformer(
            hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
            encoder_hidden_states=embeds, pooled_projections=pooled_embeds,
            return_dict=False)[0]
    return sd3_sde_step_with_logprob(
        pipeline.scheduler, velocity.float(), sample["timesteps"][:, j],
        sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
        noise_level=config.noise_level)


def _adapter_owner(transformer):
    """The peft model whose ``disable_adapter()`` the KL's reference pass enters. The script
    runs under DDP, where ``transformer`` is the DDP module and ``transformer.module`` the peft
    model; in one process there is no DDP: the wrapper's ``.module`` when it has one, else the
    module itself (``torch.compile``'s forwards the attribute)."""
    module = getattr(transformer, "module", None)
    return transformer if module is None else module


def prepare_flow_grpo(pipeline, config: FlowGRPOConfig = FlowGRPOConfig(), *,
                      compile: str = "eager", backend: str = "inductor",
                      schedule: str = "retain"):
    """``train_sd3.py``'s model lines on ``pipeline`` (``tiny_sd3_pipeline``; changed in place:
    pass a copy): the transformer frozen and moved to the device, peft LoRA on
    ``SD3_LORA_TARGETS`` (r, alpha, gaussian init; seeded with ``config.seed`` as the script's
    ``set_seed`` before it), then the ``compile`` line. Returns the pipeline."""
    from accelerate.utils import set_seed
    from peft import LoraConfig, get_peft_model

    set_seed(config.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipeline.transformer.requires_grad_(False)
    pipeline.transformer.to(device)
    pipeline.transformer = get_peft_model(pipeline.transformer, LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, init_lora_weights="gaussian",
        target_modules=list(SD3_LORA_TARGETS)))
    if config.lora_b_std:
        g = torch.Generator().manual_seed(config.seed + 1)
        with torch.no_grad():
            for name, p in pipeline.transformer.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g).to(p) * config.lora_b_std)
    pipeline.transformer = compiled_as(pipeline.transformer, compile, backend, schedule)  # LeanGRPO
    return pipeline


def flow_grpo_train_sd3(pipeline, prompts: dict, config: FlowGRPOConfig = FlowGRPOConfig(), *,
                        schedule: str | None = None, reward=latent_reward) -> LoopRun:
    """``train_sd3.py``'s training on a ``prepare_flow_grpo`` pipeline and ``prompts``
    (``sd3_prompt_bank``). ``schedule``: the LeanGRPO rollouts' schedule (None: the
    wrapper's).

    As the script: ``Accelerator(mixed_precision=..., gradient_accumulation_steps=
    gradient_accumulation_steps * num_train_timesteps)``, ``set_seed(seed,
    device_specific=True)``, AdamW over the trainable parameters, ``accelerator.prepare``; per
    epoch: ``transformer.eval()``, for each of ``num_batches_per_epoch`` sampling batches the
    k-repeat sampler's prompts, their embeddings (in the inference dtype),
    ``pipeline_with_logprob`` with the negative prompt (classifier-free guidance; initial
    latents and SDE noise from the global generator), the latents and log-probs stacked, the
    scheduler's timesteps, rewards; rewards repeated over the trained timesteps, per-prompt
    advantages, the all-zero-advantage filter; per inner epoch a ``randperm`` shuffle of the
    samples, re-batching into ``num_batches_per_epoch`` batches, ``transformer.train()``, and
    for each batch and each of its first ``num_train_timesteps`` timesteps under
    ``accelerator.accumulate``: the log-prob with the ``train.cfg`` concatenation, the
    reference's mean under ``no_grad`` with the adapter disabled (``beta > 0``), the clipped
    PPO loss plus ``beta`` times the KL, ``accelerator.backward``, ``clip_grad_norm_`` when the
    window syncs, ``optimizer.step()``, ``optimizer.zero_grad()``.

    Left out: the evaluation pass (``eval_freq``), checkpoints, wandb, the text encoders and
    tokenizers (prompt identity is the data-set index), the VAE decode and the image reward
    (``reward`` scores the final latents), the reward thread pool (called in place), the EMA
    copy (it updates a shadow copy, not the trained parameters)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    reset_accelerate()
    n_train = config.num_train_timesteps
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.gradient_accumulation_steps * n_train)
    set_seed(config.seed, device_specific=True)
    inference_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
        accelerator.mixed_precision, torch.float32)
    device = accelerator.device
    transformer = pipeline.transformer
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, betas=config.adam_betas,
        weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)

    bank = {k: v.to(device, inference_dtype) for k, v in prompts.items()}
    neg, neg_pooled = bank["neg_prompt_embeds"], bank["neg_pooled_prompt_embeds"]
    sample_neg = neg.repeat(config.sample_batch_size, 1, 1)
    sample_neg_pooled = neg_pooled.repeat(config.sample_batch_size, 1)
    train_neg = neg.repeat(config.train_batch_size, 1, 1)
    train_neg_pooled = neg_pooled.repeat(config.train_batch_size, 1)
    per_prompt = config.per_prompt_stat_tracking and config.num_image_per_prompt > 1
    autocast = contextlib.nullcontext  # the script: LoRA trains without an autocast of its own
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    run = start_run(transformer)  # (measurement)

    for epoch in range(config.epochs):
        start = time.perf_counter()
        pipeline.transformer.eval()
        samples = []
        with phase(pipeline.transformer, "rollout", train=range(n_train),  # LeanGRPO
                    trajectory_steps=config.num_steps, schedule=schedule):
            for i in range(config.num_batches_per_epoch):
                ids = _k_repeat_batch(config.prompts, config.sample_batch_size,
                                      config.num_image_per_prompt, 42,
                                      epoch * config.num_batches_per_epoch + i)
                embeds = bank["prompt_embeds"][ids]
                pooled = bank["pooled_prompt_embeds"][ids]
                generator = None
                if config.same_latent:
                    base = epoch * 10000 + i
                    generator = [torch.Generator().manual_seed((base + p) % 2 ** 31) for p in ids]
                with autocast(), torch.no_grad():
                    final, latents, log_probs = sd3_pipeline_with_logprob(
                        pipeline, prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                        negative_prompt_embeds=sample_neg,
                        negative_pooled_prompt_embeds=sample_neg_pooled,
                        num_inference_steps=config.num_steps,
                        guidance_scale=config.guidance_scale, height=config.resolution,
                        width=config.resolution, noise_level=config.noise_level,
                        generator=generator)
                latents = torch.stack(latents, dim=1)
                log_probs = torch.stack(log_probs, dim=1)
                timesteps = pipeline.scheduler.timesteps.repeat(config.sample_batch_size, 1)
                samples.append({
                    "prompt_ids": torch.as_tensor(ids, device=device),
                    "prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
                    "timesteps": timesteps, "latents": latents[:, :-1],
                    "next_latents": latents[:, 1:], "log_probs": log_probs,
                    "rewards": {"avg": reward(final).to(device).float()}})
        samples = {k: (torch.cat([s[k] for s in samples]) if not isinstance(samples[0][k], dict)
                       else {kk: torch.cat([s[k][kk] for s in samples]) for kk in samples[0][k]})
                   for k in samples[0]}
        run.log_probs = samples["log_probs"].detach().clone()
        run.rewards.append(samples["rewards"]["avg"].mean().item())
        avg = samples["rewards"]["avg"].unsqueeze(1).repeat(1, n_train)
        if per_prompt:
            advantages = _per_prompt_advantages(samples["prompt_ids"].tolist(), avg.cpu(),
                                                config.global_std)
        else:
            a = avg.cpu().double()
            advantages = (a - a.mean()) / (a.std(unbiased=False) + 1e-4)
        samples["advantages"] = advantages.to(device)
        del samples["rewards"], samples["prompt_ids"]
        mask = samples["advantages"].abs().sum(dim=1) != 0
        count = int(mask.sum())
        if count % config.num_batches_per_epoch:
            off = torch.where(~mask)[0]
            need = config.num_batches_per_epoch - count % config.num_batches_per_epoch
            if len(off) >= need:
                mask[off[torch.randperm(len(off))[:need]]] = True
        samples = {k: v[mask] for k, v in samples.items()}
        total, num_timesteps = samples["timesteps"].shape
        assert num_timesteps == config.num_steps
        run.rollout_seconds += time.perf_counter() - start

        start = time.perf_counter()
        with phase(transformer, "update"):  # LeanGRPO
            for _inner in range(config.num_inner_epochs):
                perm = torch.randperm(total, device=device)
                samples = {k: v[perm] for k, v in samples.items()}
                per_batch = total // config.num_batches_per_epoch
                batched = {k: v.reshape(-1, per_batch, *v.shape[1:]) for k, v in samples.items()}
                batched = [dict(zip(batched, x)) for x in zip(*batched.values())]
                pipeline.transformer.train()
                for sample in batched:
                    rows = len(sample["prompt_embeds"])
                    if config.cfg:
                        embeds = torch.cat([train_neg[:rows], sample["prompt_embeds"]])
                        pooled = torch.cat([train_neg_pooled[:rows],
                                            sample["pooled_prompt_embeds"]])
                    else:
                        embeds, pooled = sample["prompt_embeds"], sample["pooled_prompt_embeds"]
                    for j in range(n_train):
                        with accelerator.accumulate(transformer):
                            with autocast():
                                _, log_prob, mean, std = _flow_compute_log_prob(
                                    transformer, pipeline, sample, j, embeds, pooled, config)
                                if config.beta > 0:
                                    with torch.no_grad(), \
                                            _adapter_owner(transformer).disable_adapter():
                                        _, _, mean_ref, _ = _flow_compute_log_prob(
                                            transformer, pipeline, sample, j, embeds, pooled,
                                            config)
                            adv = torch.clamp(sample["advantages"][:, j], -config.adv_clip_max,
                                              config.adv_clip_max)
                            ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                            run.record_call(  # (the script's clipfrac; the rest: measurement)
                                ratio, log_prob, sample["log_probs"][:, j],
                                clip_range=config.clip_range, step=j, samples=rows)
                            clipped = torch.clamp(ratio, 1.0 - config.clip_range,
                                                  1.0 + config.clip_range)
                            policy_loss = torch.mean(torch.maximum(-adv * ratio, -adv * clipped))
                            if config.beta > 0:
                                kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) \
                                    / (2 * std ** 2)
                                loss = policy_loss + config.beta * torch.mean(kl)
                                run.kl_loss.append(torch.mean(kl).item())  # (measurement)
                            else:
                                loss = policy_loss
                            accelerator.backward(loss)
                            if accelerator.sync_gradients:
                                accelerator.clip_grad_norm_(transformer.parameters(),
                                                            config.max_grad_norm)
                                run.grads.append(grad_snapshot(transformer))  # (measurement)
                            optimizer.step()
                            optimizer.zero_grad()
        run.update_seconds += time.perf_counter() - start
    finish_run(run, transformer)
    unprepare(transformer)
    return run


