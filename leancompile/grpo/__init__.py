"""Diffusion GRPO pieces (LeanGRPO): SDE transitions with log-probs, group advantages,
timestep selection, rewards, and the trainer that runs compiler-produced schedules."""

__all__: list[str] = []
