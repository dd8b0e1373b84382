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

Each pipeline's policy is in its own module, as read from diffusers 0.42 and reproduced there:
``flux_policy.py`` (``FluxPolicy``, ``FluxPipeline``), ``sd3_policy.py`` (``SD3Policy``,
``StableDiffusion3Pipeline``), ``wan_policy.py`` (``WanPolicy``, ``WanPipeline``); what they
share, the schedule, step indexing and the checks of latents and conditions, is
``flow_match.py`` (``FlowMatchPolicy``). This module is the entry that gathers them, with
sequence parallelism (``sequence_parallel.py``).

Dtypes: the transformer runs in its own dtype (latents and conditions are cast to the dtype of
its input projection); ``velocity`` always returns float32, and classifier-free guidance is
combined in float32. The pipelines keep their latents in the model dtype between steps (the
scheduler casts back); a trainer holding float32 latents therefore matches the pipeline in
float32 (bitwise for FLUX and SD3; for Wan up to rounding, from batching cond and uncond) and is
slightly more precise than it in bf16.
"""

from __future__ import annotations

from .flow_match import FlowMatchPolicy, calculate_shift, select_conditions
from .flux_policy import FLUX_SCHEDULER_CONFIG, FluxPolicy
from .sd3_policy import SD3_SCHEDULER_CONFIG, SD3Policy
from .sequence_parallel import SequenceParallel, parallelize_ulysses
from .wan_policy import WanPolicy

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
