"""Integrations with model and parallelism libraries.

``leancompile.integrations.diffusers``: ``FluxPolicy``, ``WanPolicy``, ``SD3Policy`` wrap the
diffusers transformers with the pipelines' sigma schedules, latent layouts and guidance, for
the LeanGRPO trainer. (torch.distributed / DTensor integration lands with FlashOverlap.)
"""

__all__: list[str] = []
