"""Integrations with model and parallelism libraries (diffusers, torch.distributed/DTensor,
peft). Empty in this version: the diffusers policies land here with LeanGRPO."""

__all__: list[str] = []
