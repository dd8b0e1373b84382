"""The GRPO demo: a few LeanGRPO steps on a small random-init diffusers FLUX, on the CPU.

1. The three schedules compute gradients for the same rollout (same seeds): their agreement
   with recompute (cosine, relative L2) and their measured times.
2. A few ``GRPOTrainer.step`` calls with ``schedule="auto"`` (Adam), decoded through a small
   random-init ``AutoencoderKL``; a reward that prefers red images. Per step: an image grid;
   at the end: the reward curve.
3. A closing table: step time of recompute vs the schedule auto chose, measured in this run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

__all__ = ["main"]


def _progress(iterable, desc):
    try:
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc)
    except ImportError:  # pragma: no cover - tqdm comes with diffusers' dependencies
        return iterable


def _build(seed: int = 0):
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from ..integrations.diffusers import FluxPolicy

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=64,
        axes_dims_rope=[8, 12, 12], guidance_embeds=True).eval()
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                        latent_channels=4, norm_num_groups=4, sample_size=32,
                        scaling_factor=0.3611, shift_factor=0.1159).eval()
    vae.requires_grad_(False)
    # 16x16 latents of 4 channels (packed 8x8 tokens of 16), decoded to 32x32 images.
    policy = FluxPolicy(transformer, num_inference_steps=6, height=16, width=16,
                        vae_scale_factor=1, vae_config=vae.config)
    return policy, vae


def _grid(images: torch.Tensor, path: Path) -> None:
    from PIL import Image

    b, _, h, w = images.shape
    grid = torch.ones(3, h + 4, b * (w + 4))
    for i in range(b):
        grid[:, 2:2 + h, i * (w + 4) + 2:i * (w + 4) + 2 + w] = images[i]
    array = (grid.permute(1, 2, 0).clamp(0, 1) * 255).round().byte().numpy()
    Image.fromarray(array).resize((array.shape[1] * 4, array.shape[0] * 4),
                                  Image.NEAREST).save(path)


def _plot(values, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(range(1, len(values) + 1), values, marker="o")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_title("LeanGRPO on tiny FLUX")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(*, out: str = "leancompile-out", steps: int = 4) -> int:
    from ..grpo.rewards import TargetColorReward, decode_latents, decoded
    from ..grpo.trainer import GRPOConfig, GRPOTrainer

    out_dir = Path(out) / "grpo"
    out_dir.mkdir(parents=True, exist_ok=True)
    policy, vae = _build()
    reward = decoded(TargetColorReward(target=(1.0, 0.0, 0.0)), vae=vae,
                     to_vae_latents=policy.to_vae_latents)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=3e-4)
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=4, schedule="auto")
    trainer = GRPOTrainer(policy, reward, optimizer, config)
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1), sequence_length=16)

    print("== 1. the three schedules on one rollout (same seeds)")
    print(trainer.explain(conditions, torch.Generator().manual_seed(0)))
    results = {}
    for name in _progress(("recompute", "retain", "reweight"), "capture + warm-up"):
        trainer.compute_gradients(conditions, torch.Generator().manual_seed(0), schedule=name)
    for name in ("recompute", "retain", "reweight"):
        results[name] = trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                                  schedule=name)
    ref = torch.cat([g.flatten().double() for g in results["recompute"].grads.values()])
    agreement = {}
    for name, result in results.items():
        g = torch.cat([v.flatten().double() for v in result.grads.values()])
        agreement[name] = (torch.nn.functional.cosine_similarity(g, ref, dim=0).item(),
                           ((g - ref).norm() / ref.norm()).item())

    print(f"\n== 2. {steps} GRPO steps, schedule='auto', images in {out_dir}")
    rewards, chosen = [], []
    for step in _progress(range(steps), "GRPO steps"):
        metrics = trainer.step(conditions, torch.Generator().manual_seed(100 + step))
        rewards.append(metrics["reward_mean"])
        chosen.append(metrics["schedule"])
        with torch.no_grad():
            final = trainer.last_rollout.latents[:, -1]
            _grid(decode_latents(vae, policy.to_vae_latents(final)), out_dir / f"step{step}.png")
        print(f"step {step}: reward {metrics['reward_mean']:+.4f} +- {metrics['reward_std']:.4f}"
              f"  schedule {metrics['schedule']}  grad norm {metrics['grad_norm']:.3e}  "
              f"rollout {metrics['rollout_s']:.2f} s  update {metrics['update_s']:.2f} s")
    if _plot(rewards, out_dir / "reward_curve.png"):
        print(f"reward curve: {out_dir / 'reward_curve.png'}")

    used = chosen[-1]
    print("\n== 3. summary (measured in this run, CPU, aot_eager)")
    print(f"{'schedule':10s} {'step s':>8s} {'speed-up':>9s} {'cosine':>11s} {'rel L2':>9s}")
    base = results["recompute"].rollout_seconds + results["recompute"].update_seconds
    for name, result in results.items():
        seconds = result.rollout_seconds + result.update_seconds
        cos, rel = agreement[name]
        mark = "  <- auto's choice" if name == used else ""
        print(f"{name:10s} {seconds:8.3f} {base / seconds:8.2f}x {cos:11.8f} {rel:9.2e}{mark}")
    ok = agreement["retain"][1] <= 1e-6 and agreement["reweight"][1] <= 1e-5
    print("gradients agree with recompute (retain rel L2 <= 1e-6, reweight <= 1e-5):",
          "yes" if ok else "NO")
    return 0 if ok else 1
