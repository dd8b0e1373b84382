"""The drop-in demo: a FlowGRPO-style training loop on a small random-init diffusers FLUX, run
as its users write it and again with LeanGRPO added by three lines (``user_loops.py``):

    velocity = leancompile.lean_compile(policy.velocity, schedule="retain")
    with phase(velocity, "rollout", train=range(n_train), trajectory_steps=T), \
            torch.no_grad(): ...                                     # sampling, unchanged
    with phase(velocity, "update"): ...                                    # training, unchanged

Both runs start from the same weights and seeds. Printed: what the wrapper did (calls reused,
forwards run in the update, kept memory), the parameters' agreement after each iteration, and
the time of each loop.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

__all__ = ["main"]


def main(*, out: str | None = None, iterations: int = 2) -> int:
    from diffusers import FluxTransformer2DModel

    import leancompile

    from ..integrations.diffusers import FluxPolicy
    from .user_loops import LoopConfig, flow_grpo_loop

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=64,
        num_attention_heads=2, joint_attention_dim=128, pooled_projection_dim=128,
        axes_dims_rope=[16, 24, 24], guidance_embeds=True).eval()
    base = FluxPolicy(transformer, num_inference_steps=6, height=16, width=16,
                      vae_scale_factor=1)
    base.requires_grad_(True)
    config = LoopConfig(prompts=2, group_size=2, sample_batch=4, train_batch=2,
                        timestep_fraction=0.75, iterations=iterations, lr=1e-4)
    print("FlowGRPO-style loop: 4 samples (2 prompts x 2), 6 steps, the first 4 trained; "
          "samples shuffled, timesteps permuted per sample, train batch 2 (sampling batch 4), "
          "PPO, AdamW, clip_grad_norm_")
    runs = {}
    for name in ("plain", "wrapped"):
        torch._dynamo.reset()
        policy = copy.deepcopy(base)
        schedule = {"schedule": "retain"} if name == "wrapped" else {}
        fn = leancompile.lean_compile(policy.velocity, backend="aot_eager", **schedule)
        flow_grpo_loop(policy, fn, dataclasses.replace(config, iterations=1))  # compiles
        policy.load_state_dict(base.state_dict())
        if name == "wrapped":
            fn.reset_stats()
        runs[name] = (flow_grpo_loop(policy, fn, config), fn)
    plain, (wrapped, step) = runs["plain"][0], runs["wrapped"]
    print("\nwhat lean_compile(schedule='retain') did:")
    print("  " + step.stats.summary().replace("\n", "\n  "))
    print("\nparameters, wrapped vs plain loop (relative L2 over all of them):")
    for i, (a, b) in enumerate(zip(wrapped.history, plain.history)):
        fa = torch.cat([t.flatten() for t in a.values()])
        fb = torch.cat([t.flatten() for t in b.values()])
        print(f"  after iteration {i + 1}: {((fa - fb).norm() / fb.norm()).item():.2e}")
    p_total = plain.rollout_seconds + plain.update_seconds
    w_total = wrapped.rollout_seconds + wrapped.update_seconds
    print(f"\nseconds: plain {p_total:.2f} (rollout {plain.rollout_seconds:.2f}, update "
          f"{plain.update_seconds:.2f}); wrapped {w_total:.2f} (rollout "
          f"{wrapped.rollout_seconds:.2f}, update {wrapped.update_seconds:.2f}); "
          f"{p_total / w_total:.2f}x")
    return 0
