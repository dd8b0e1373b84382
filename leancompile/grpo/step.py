"""The import path ``leancompile.grpo.step`` of earlier releases: the policy's denoising step
(``PolicyStep``) now lives in ``leancompile/grpo/policy_step.py``."""

from .policy_step import PolicyStep

__all__ = ["PolicyStep"]
