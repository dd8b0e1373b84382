"""FlowGRPO's KL reference (``GRPOConfig.beta > 0``): the policy with frozen weights.

``ReferencePolicy.weights`` names the weights the reference runs with, as the policy's
parameter names under ``policy.``: a copy of the initial trainable weights
(``reference="copy"``), or zeros for LoRA's ``lora_B`` (``reference="adapter"``: every
adapter then adds exactly zero, the base model). ``mean`` runs the policy's velocity with
them (``torch.func.functional_call``; the other parameters are the policy's own) and returns
the reference's SDE transition mean for one call's rows, which the trained calls take as
their last argument (``PolicyStep(with_kl=True)``). Checkpoints save and load ``weights``
(``reference.safetensors``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .fsdp import full_shapes, sharding_of
from .policy_step import Velocity
from .sde import sde_step

__all__ = ["ReferencePolicy", "make_reference"]


class ReferencePolicy:
    """The KL's reference policy: ``policy`` with ``weights`` (module docstring)."""

    def __init__(self, policy: nn.Module, weights: dict[str, torch.Tensor]):
        self.policy = policy
        self.weights = weights
        """``{"policy.<parameter name>": tensor}``: full size on every rank."""
        self._velocity = Velocity(policy)

    def mean(self, args, keys, noise, *, sde: str, eta: float) -> torch.Tensor:
        """The reference policy's transition mean for one call's rows (no grad); ``args`` are
        the call's positional arguments (``policy_step.call_args``)."""
        x, step = args[0], args[1]
        cond = dict(zip(keys, args[2:2 + len(keys)]))
        with torch.no_grad():
            v = torch.func.functional_call(self._velocity, self.weights, (x, step, cond),
                                           strict=False)
            sigmas = self.policy.sigmas.to(x.device)
            out = sde_step(sde, latents=x, velocity=v, sigma=sigmas[step],
                           sigma_next=sigmas[step + 1], eta=eta, sigma_max=sigmas[1],
                           noise=noise)
        return out.mean


def make_reference(policy: nn.Module, *, mode: str, trainable, fsdp: bool) -> ReferencePolicy:
    """The reference of ``GRPOConfig.reference`` ``mode`` for ``policy`` (whose trainable
    parameters are ``trainable``), built before ``parallel="fsdp"`` (``fsdp``) shards it."""
    has_lora = any("lora_B" in n for n in trainable)
    if mode == "auto":
        mode = "adapter" if has_lora else "copy"
    if mode == "adapter":
        if not has_lora:
            raise ValueError("reference='adapter' needs a peft LoRA policy (parameters named"
                             " ...lora_B...); use reference='copy'")
        # lora_B = 0 makes every adapter add exactly zero: the base model.
        shapes = full_shapes(policy)
        if not fsdp:
            return ReferencePolicy(policy, {f"policy.{n}": p.new_zeros(shapes[n])
                                            for n, p in policy.named_parameters()
                                            if "lora_B" in n})
        # parallel="fsdp": the policy's trainable parameters are (or are about to be)
        # parts, so the reference names every one of them at full size. Zero lora_B
        # cancels an adapter whatever its lora_A; any other trainable parameter (a
        # weight outside the adapters, DoRA's magnitude vectors) would have to be gathered
        # for every reference call.
        zeroed = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
        other = [n for n in trainable if not any(z in n for z in zeroed)]
        if other:
            raise ValueError(
                f"reference='adapter' with parallel='fsdp': {other[:4]}"
                f"{' ...' if len(other) > 4 else ''} are trainable parameters that zero "
                "lora_B does not cancel (weights outside the LoRA adapters, DoRA's "
                "magnitude vectors); they are sharded and the reference would need them "
                "gathered on every reference call: use reference='copy' (a full copy on "
                "every rank) or freeze them")
        params = dict(policy.named_parameters())
        return ReferencePolicy(policy, {f"policy.{n}": params[n].new_zeros(shapes[n])
                                        for n in trainable})
    held = sharding_of(policy)
    if held is not None:  # a policy an earlier fsdp trainer sharded: gather it
        return ReferencePolicy(policy, {f"policy.{n}": t
                                        for n, t in held.full_parameters(policy).items()})
    return ReferencePolicy(policy, {f"policy.{n}": p.detach().clone()
                                    for n, p in policy.named_parameters() if p.requires_grad})
