"""The GRPO demo: LeanGRPO training a small random-init diffusers FLUX on the CPU, visibly.

1. The three schedules compute gradients for the same rollout (same seeds): their agreement
   with recompute (cosine, relative L2) and their measured times.
2. ``GRPOTrainer.step`` calls with ``schedule="auto"`` (Adam, full fine-tuning) on several
   prompts x a group of samples, decoded through a small random-init ``AutoencoderTiny``; the
   reward prefers red images (``TargetColorReward``). Each step draws fresh seeds, except the
   last, which replays the first step's seed, so the first and the last step's images start
   from the same noise and differ only by what training changed. The demo prints the mean
   reward of the first and the last step with their standard errors (std of the step's
   per-sample rewards / sqrt(samples)), says whether the rise exceeds 5 standard errors of the
   first step's mean, and saves ``first_vs_last.png`` (the two steps' images side by side),
   one image grid per step and ``reward_curve.png`` (mean reward with standard-error bars).
3. A closing table: each schedule's step time (median and minimum over interleaved rounds of
   one rollout + update, measured in this run), its speed-up over recompute and its gradient
   agreement.

Why ``AutoencoderTiny``: a random-init ``AutoencoderKL`` decoder normalises its features
(GroupNorm) before the output convolution, so no latent can move the mean colour of its images
much (direct gradient ascent on the latents moves the mean red from 0.46 to 0.49): a colour
reward then has nothing visible to learn. The convolution + ReLU decoder of ``AutoencoderTiny``
passes colour through; ``_tiny_vae`` sets its output bias so that decoded Gaussian latents are
mid-grey on average, so the untrained policy draws near-grey noise and the colour comes from
training. torch runs on one thread during the demo (see ``main``).

Under ``torchrun --nproc-per-node N`` (the environment names ``WORLD_SIZE > 1``) the demo joins
the process group (gloo on CPU, NCCL when CUDA is available), trains with
``parallel="ddp"`` and the shared-prompt layout, and only rank 0 prints and writes images; the
seeds and the numbers match one process up to summation order. ``sp=S`` (``leancompile demo
grpo --sp-size S``; ``--sp`` alone: 2) makes the transformer Ulysses sequence parallel over
groups of ``S`` ranks (``parallelize_ulysses``) and runs data parallelism over the ``N / S``
groups: a ``(dp, sp)`` mesh, as DanceGRPO's ``sp_size``.
"""

from __future__ import annotations

import builtins
import math
import os
import statistics
import time
from pathlib import Path

import torch

__all__ = ["TARGET", "build_demo", "main"]

TARGET = (1.0, 0.0, 0.0)
"""The colour the reward prefers (red)."""


def _progress(iterable, desc, *, quiet=False):
    if quiet:
        return iterable
    try:
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc)
    except ImportError:  # pragma: no cover - tqdm comes with diffusers' dependencies
        return iterable


def _tiny_vae(*, gain: float = 2.0, calibration_samples: int = 64):
    """A random-init ``AutoencoderTiny`` (16 channels, one block per level, 2x upsampling) whose
    last convolution is scaled by ``gain`` (contrast of the decoded noise) and whose output bias
    makes decoded standard-normal latents average mid-grey (0.5) in each RGB channel. Without
    it the non-negative ReLU features give a random, mostly near-black colour cast."""
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny(encoder_block_out_channels=(16, 16),
                          decoder_block_out_channels=(16, 16), num_encoder_blocks=(1, 1),
                          num_decoder_blocks=(1, 1), latent_channels=4).eval()
    vae.requires_grad_(False)
    last = vae.decoder.layers[-1]
    with torch.no_grad():
        last.weight.mul_(gain)
        last.bias.zero_()
        latents = torch.randn(calibration_samples, 4, 16, 16,
                              generator=torch.Generator().manual_seed(0))
        # The decoder maps its output x to pixels clamp(x, 0, 1) (decode: 2x - 1; the
        # postprocessing: / 2 + 0.5), so an output bias of 0.5 - mean(x) centres it on grey.
        mean = vae.decode(latents, return_dict=False)[0].add(1).div(2).mean(dim=(0, 2, 3))
        last.bias.copy_(0.5 - mean)
    return vae


def build_demo(*, seed: int = 0, num_inference_steps: int = 6, attention_head_dim: int = 32):
    """``(policy, vae)`` of the demo: a one-block Flux transformer (two heads of
    ``attention_head_dim``, a multiple of 16) as a ``FluxPolicy`` on 16x16 latents and a tiny
    VAE decoding them to 32x32 images (random weights, seeded)."""
    from diffusers import FluxTransformer2DModel

    from ..integrations.diffusers import FluxPolicy

    if attention_head_dim < 16 or attention_head_dim % 16:
        raise ValueError(f"attention_head_dim={attention_head_dim}: the three rotary axes take "
                         "1/4, 3/8 and 3/8 of it in sin/cos pairs; pass a multiple of 16")
    torch.manual_seed(seed)
    d = attention_head_dim
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=d,
        num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=64,
        axes_dims_rope=[d // 4, 3 * d // 8, 3 * d // 8], guidance_embeds=True).eval()
    vae = _tiny_vae()
    # 16x16 latents of 4 channels (packed 8x8 tokens of 16), decoded to 32x32 images.
    policy = FluxPolicy(transformer, num_inference_steps=num_inference_steps, height=16,
                        width=16, vae_scale_factor=1, vae_config=vae.config)
    return policy, vae


def _grid(images: torch.Tensor, *, columns: int, scale: int = 4):
    """``[B, 3, h, w]`` images in [0, 1] as a PIL image: ``columns`` per row, 2-pixel white
    borders, enlarged ``scale`` times (nearest neighbour)."""
    from PIL import Image

    b, _, h, w = images.shape
    rows = -(-b // columns)
    grid = torch.ones(3, rows * (h + 4), columns * (w + 4))
    for i in range(b):
        r, c = divmod(i, columns)
        grid[:, r * (h + 4) + 2:r * (h + 4) + 2 + h,
             c * (w + 4) + 2:c * (w + 4) + 2 + w] = images[i]
    array = (grid.permute(1, 2, 0).clamp(0, 1) * 255).round().byte().numpy()
    return Image.fromarray(array).resize((array.shape[1] * scale, array.shape[0] * scale),
                                         Image.NEAREST)


def _side_by_side(panels, path: Path) -> None:
    """``panels``: (title, PIL image) pairs, saved next to each other with their titles above."""
    from PIL import Image, ImageDraw

    gap, header = 24, 28
    width = sum(image.width for _, image in panels) + gap * (len(panels) + 1)
    height = max(image.height for _, image in panels) + header + gap
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = gap
    for title, image in panels:
        draw.text((x, 8), title, fill="black")
        canvas.paste(image, (x, header))
        x += image.width + gap
    canvas.save(path)


def _plot(means, errors, threshold, path: Path) -> bool:
    """Mean reward per step with standard-error bars, and the first step's mean + 5 SE."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.4))
    steps = range(1, len(means) + 1)
    ax.errorbar(steps, means, yerr=errors, marker="o", capsize=3, label="mean reward +- SE")
    ax.axhline(threshold, color="grey", linestyle="--", linewidth=1,
               label="first step + 5 SE")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (- distance to red)")
    ax.set_title("LeanGRPO on tiny FLUX")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(*, out: str = "leancompile-out", steps: int = 20, prompts: int = 4,
         group_size: int = 4, lr: float = 3e-3, num_inference_steps: int = 6,
         threads: int | None = 1, rounds: int = 5, sp: int | None = None) -> int:
    """Run the demo; images and plots go to ``out/grpo``. Returns 0 when the schedules'
    gradients agree with recompute and the mean reward rose by more than 5 standard errors.

    ``threads``: torch's intra-op threads while the demo runs (restored on return; None: leave
    them). This model's ops are too small to gain from threads, and on a shared machine
    OpenMP's barriers between busy threads made a step 10-40x slower (2 threads, 2 cores).

    ``rounds``: interleaved rounds (recompute, retain, reweight, again) timed for the closing
    table, which prints the median and the minimum of each.

    ``sp``: ranks per sequence-parallel group (module docstring); it must divide the world size.
    """
    import torch.distributed as dist

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    joined = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        joined = True
    try:
        return _run(out=out, steps=steps, prompts=prompts, group_size=group_size, lr=lr,
                    num_inference_steps=num_inference_steps, rounds=rounds, sp=sp)
    finally:
        torch.set_num_threads(previous)
        if joined:
            dist.destroy_process_group()


def _final_latents(trainer) -> torch.Tensor:
    """The last rollout's final latents, every row (data parallel: gathered from the ranks)."""
    rollout = trainer.last_rollout
    final = rollout.latents[:, -1]
    if rollout.rows is None:
        return final
    owned = torch.zeros(final.shape[0], dtype=torch.bool)
    owned[rollout.rows] = True
    return trainer.parallel.gather_rows(final, owned)


def _mesh(sp: int | None):
    """(data-parallel group or None, sequence-parallel group or None) of this job."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if sp is None:
        return (dist.group.WORLD if world > 1 else None), None
    if sp < 2 or world % sp:
        raise ValueError(f"sp={sp}: the sequence-parallel groups need at least 2 ranks and must "
                         f"divide the {world} ranks of the job (torchrun --nproc-per-node N "
                         "with N a multiple of sp)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu",
                            (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return (mesh.get_group("dp") if world > sp else None), mesh.get_group("sp")


def _run(*, out, steps, prompts, group_size, lr, num_inference_steps, rounds, sp) -> int:
    import torch.distributed as dist

    from ..grpo.rewards import TargetColorReward, decode_latents, decoded
    from ..grpo.trainer import GRPOConfig, GRPOTrainer
    from ..integrations.diffusers import parallelize_ulysses

    dp_group, sp_group = _mesh(sp)
    parallel = "ddp" if dp_group is not None else None
    quiet = dist.is_initialized() and dist.get_rank() != 0

    def print(*args, **kwargs):  # noqa: A001 - rank 0 speaks for everyone
        if not quiet:
            builtins.print(*args, **kwargs)

    if steps < 2:
        raise ValueError(f"steps={steps}: the demo compares a first and a last step")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: the closing table needs at least one timed round")
    out_dir = Path(out) / "grpo"
    out_dir.mkdir(parents=True, exist_ok=True)
    policy, vae = build_demo(num_inference_steps=num_inference_steps)
    if sp_group is not None:
        parallelize_ulysses(policy.transformer, sp_group)
    reward = decoded(TargetColorReward(target=TARGET), vae=vae,
                     to_vae_latents=policy.to_vae_latents)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=lr)
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=group_size, schedule="auto")
    trainer = GRPOTrainer(policy, reward, optimizer, config, parallel=parallel,
                          process_group=dp_group)
    if sp_group is not None:
        print(f"sequence parallel: {dist.get_world_size() // sp} group(s) of {sp} ranks "
              f"({dist.get_backend()}), each rank holding 1/{sp} of the tokens; data parallel "
              f"over the groups, layout {config.layout!r}; gradients summed over both")
    elif parallel:
        print(f"data parallel: {dist.get_world_size()} ranks ({dist.get_backend()}), layout "
              f"{config.layout!r}, one gradient all-reduce per update")
    names = ("recompute", "retain", "reweight")
    one_prompt = policy.example_conditions(1, torch.Generator().manual_seed(1),
                                           sequence_length=16)

    print("== 1. the three schedules on one rollout (same seeds)")
    print(trainer.explain(one_prompt, torch.Generator().manual_seed(0)))
    results = {}
    for name in _progress(names, "capture + warm-up", quiet=quiet):
        trainer.compute_gradients(one_prompt, torch.Generator().manual_seed(0), schedule=name)
    seconds = {name: [] for name in names}
    for _ in range(rounds):  # interleaved rounds: the machine's drift hits every schedule
        for name in seconds:
            results[name] = trainer.compute_gradients(
                one_prompt, torch.Generator().manual_seed(0), schedule=name)
            seconds[name].append(results[name].rollout_seconds + results[name].update_seconds)
    ref = torch.cat([g.flatten().double() for g in results["recompute"].grads.values()])
    agreement = {}
    for name, result in results.items():
        g = torch.cat([v.flatten().double() for v in result.grads.values()])
        agreement[name] = (torch.nn.functional.cosine_similarity(g, ref, dim=0).item(),
                           ((g - ref).norm() / ref.norm()).item())

    conditions = policy.example_conditions(prompts, torch.Generator().manual_seed(2),
                                           sequence_length=16)
    samples = prompts * group_size
    print(f"\n== 2. {steps} GRPO steps, schedule='auto', {prompts} prompts x {group_size} "
          f"samples, Adam lr {lr:g}, reward: closeness of the decoded pixels to red; "
          f"images in {out_dir}")
    means, errors, chosen, grids = [], [], [], {}
    start = time.perf_counter()
    for step in _progress(range(steps), "GRPO steps", quiet=quiet):
        # Fresh seeds each step; the last replays the first one's (same noise, trained policy).
        seed = 100 if step == steps - 1 else 100 + step
        metrics = trainer.step(conditions, torch.Generator().manual_seed(seed))
        means.append(metrics["reward_mean"])
        errors.append(metrics["reward_std"] / math.sqrt(samples))
        chosen.append(metrics["schedule"])
        final = _final_latents(trainer)
        if quiet:
            continue
        with torch.no_grad():
            grid = _grid(decode_latents(vae, policy.to_vae_latents(final)), columns=group_size)
        grid.save(out_dir / f"step{step + 1}.png")
        if step in (0, steps - 1):
            grids[step] = grid
        print(f"step {step + 1}: reward {means[-1]:+.4f} +- {errors[-1]:.4f} (SE)  "
              f"schedule {metrics['schedule']}  grad norm {metrics['grad_norm']:.3e}  "
              f"rollout {metrics['rollout_s']:.2f} s  update {metrics['update_s']:.2f} s")
    train_s = time.perf_counter() - start

    if quiet:
        return 0
    rise = means[-1] - means[0]
    rise_se = rise / errors[0] if errors[0] > 0 else math.inf
    risen = rise_se > 5
    print(f"start (step 1):  mean reward {means[0]:+.4f} +- {errors[0]:.4f} (SE, {samples} "
          f"samples)")
    print(f"end (step {steps}): mean reward {means[-1]:+.4f} +- {errors[-1]:.4f} (SE, same seeds "
          "as step 1)")
    print(f"rise {rise:+.4f} = {rise_se:.1f} SE of the start; more than 5 SE: "
          f"{'yes' if risen else 'NO'}  ({steps} steps in {train_s:.0f} s)")
    _side_by_side([(f"step 1: mean reward {means[0]:+.3f} +- {errors[0]:.3f}", grids[0]),
                   (f"step {steps}: mean reward {means[-1]:+.3f} +- {errors[-1]:.3f}",
                    grids[steps - 1])], out_dir / "first_vs_last.png")
    print(f"first vs last step (rows: prompts, columns: group samples): "
          f"{out_dir / 'first_vs_last.png'}")
    if _plot(means, errors, means[0] + 5 * errors[0], out_dir / "reward_curve.png"):
        print(f"reward curve: {out_dir / 'reward_curve.png'}")

    used = chosen[-1]
    print("\n== 3. summary (measured in this run, CPU, aot_eager)")
    print(f"step seconds over {rounds} interleaved rounds of one rollout + update "
          "(one prompt); speed-up = recompute's / the schedule's")
    print(f"{'schedule':10s} {'median s':>9s} {'min s':>7s} {'speed-up':>9s} {'(by min)':>9s} "
          f"{'cosine':>11s} {'rel L2':>9s}")
    base = statistics.median(seconds["recompute"]), min(seconds["recompute"])
    for name in results:
        median, least = statistics.median(seconds[name]), min(seconds[name])
        cos, rel = agreement[name]
        mark = "  <- auto's choice" if name == used else ""
        print(f"{name:10s} {median:9.3f} {least:7.3f} {base[0] / median:8.2f}x "
              f"{base[1] / least:8.2f}x {cos:11.8f} {rel:9.2e}{mark}")
    ok = agreement["retain"][1] <= 1e-6 and agreement["reweight"][1] <= 1e-5
    print("gradients agree with recompute (retain rel L2 <= 1e-6, reweight <= 1e-5):",
          "yes" if ok else "NO")
    print(f"mean reward rose by more than 5 SE of step 1's mean: {'yes' if risen else 'NO'}")
    return 0 if ok and risen else 1
