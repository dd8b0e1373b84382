"""``leancompile bench grpo``: recompute vs retain vs reweight on one random-init diffusers
model, same seeds, measured in one run.

For each schedule: one warm-up call (captures the graphs), then ``repeats`` timed calls of
``compute_gradients`` (rollout and update seconds), retained bytes, gradient buffers, and the
gradient's cosine and relative L2 error against recompute's. The ideal ratio is measured from
the captured graphs themselves: forward without grad ``F0``, forward with saving ``F``,
backward ``B`` for the full batch, ``ideal = (F0 + F + B) / (F + B)`` per selected step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["BenchConfig", "run_grpo_bench", "main"]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What the benchmark runs. The defaults make compute dominate Python overhead on a CPU."""

    model: str = "flux"
    """``flux`` or ``wan``."""
    schedules: tuple[str, ...] = ("recompute", "retain", "reweight")
    layers: int = 2
    """FLUX: double-stream and single-stream blocks each; Wan: blocks."""
    hidden: int = 256
    """Transformer width (heads x head dim, 64 per head)."""
    latent: int = 32
    """Latent height and width (FLUX packs 2x2: (latent/2)^2 tokens)."""
    frames: int = 5
    """Wan only: video frames (latent frames (frames-1)/4+1)."""
    text_length: int = 32
    steps: int = 8
    fraction: float = 1.0
    prompts: int = 1
    group_size: int = 2
    repeats: int = 5
    compiler: str = "aot_eager"
    seed: int = 0
    threads: int | None = None

    def __post_init__(self):
        if self.model not in ("flux", "wan"):
            raise ValueError(f"model={self.model!r}; use 'flux' or 'wan'")
        unknown = set(self.schedules) - {"recompute", "retain", "reweight"}
        if unknown or "recompute" not in self.schedules:
            raise ValueError(f"schedules={self.schedules}: pick from recompute, retain, reweight "
                             "and include recompute (the reference)")
        if self.hidden % 64:
            raise ValueError(f"hidden={self.hidden} must be a multiple of 64 (the head dim)")


def build_policy(config: BenchConfig):
    from ..integrations.diffusers import FluxPolicy, WanPolicy

    torch.manual_seed(config.seed)
    heads = config.hidden // 64
    if config.model == "flux":
        from diffusers import FluxTransformer2DModel

        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=config.layers,
            num_single_layers=config.layers, attention_head_dim=64, num_attention_heads=heads,
            joint_attention_dim=config.hidden, pooled_projection_dim=config.hidden,
            axes_dims_rope=[16, 24, 24], guidance_embeds=True).eval()
        return FluxPolicy(transformer, num_inference_steps=config.steps, height=config.latent,
                          width=config.latent, vae_scale_factor=1)
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16,
        out_channels=16, text_dim=config.hidden, freq_dim=256, ffn_dim=2 * config.hidden,
        num_layers=config.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024).eval()
    return WanPolicy(transformer, num_inference_steps=config.steps, height=config.latent * 8,
                     width=config.latent * 8, num_frames=config.frames, guidance_scale=5.0,
                     flow_shift=3.0)


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mean_latent_reward(latents, conditions):
    """A cheap reward (the mean latent), so that the model dominates the timing."""
    return latents.float().flatten(1).mean(1)


def run_grpo_bench(config: BenchConfig, *, log=print) -> dict:
    from ..grpo.trainer import GRPOConfig, GRPOTrainer

    if config.threads:
        torch.set_num_threads(config.threads)
    policy = build_policy(config)
    sde = "dance_grpo" if config.model == "wan" else "flow_grpo"
    trainer = GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(
        sde=sde, eta=0.3 if sde == "dance_grpo" else 0.9, group_size=config.group_size,
        timestep_fraction=config.fraction, compiler=config.compiler))
    conditions = policy.example_conditions(config.prompts, torch.Generator().manual_seed(1),
                                           sequence_length=config.text_length)

    def gen():
        return torch.Generator().manual_seed(config.seed + 7)

    for name in config.schedules:
        log(f"[bench] {name}: warm-up (captures and compiles the graphs)")
        trainer.compute_gradients(conditions, gen(), schedule=name)
    # Rounds interleave the schedules, so drift on the machine hits them alike; medians. Only
    # timings and the last gradients are kept (holding every result's tensors skews the
    # allocator, and so the timings, of later runs).
    times = {name: [] for name in config.schedules}
    last = {}
    for i in range(config.repeats):
        for name in config.schedules:
            result = trainer.compute_gradients(conditions, gen(), schedule=name)
            times[name].append((result.rollout_seconds, result.update_seconds))
            last[name] = (torch.cat([g.flatten().double() for g in result.grads.values()]),
                          result.retained_bytes, result.buffer_bytes)
            del result
            log(f"[bench] round {i + 1} {name}: rollout {times[name][-1][0]:.3f} s, "
                f"update {times[name][-1][1]:.3f} s")
    results, grads = {}, {}
    for name, done in times.items():
        totals = [r + u for r, u in done]
        grads[name], retained, buffered = last[name]
        results[name] = {"rollout_s": statistics.median(r for r, _ in done),
                         "update_s": statistics.median(u for _, u in done),
                         "total_s": statistics.median(totals),
                         "total_s_min": min(totals), "total_s_max": max(totals),
                         "retained_bytes": retained, "buffer_bytes": buffered,
                         "peak_extra_bytes": max(retained, buffered)}

    reference = grads["recompute"]
    base_total = results["recompute"]["total_s"]
    for name, entry in results.items():
        g = grads[name]
        entry["ratio_to_recompute"] = base_total / entry["total_s"]
        entry["grad_cosine"] = torch.nn.functional.cosine_similarity(g, reference, dim=0).item()
        entry["grad_rel_l2"] = ((g - reference).norm() / reference.norm()).item()

    # The ideal ratio from the step itself, full batch at one step: its inference graph (F0),
    # its forward graph with grad (F) and its backward graph (B), through the same LeanStep.
    keys = list(conditions)
    batch = config.prompts * config.group_size
    lean = trainer.lean_step(keys)
    latents = policy.initial_latents(batch, gen()).float()
    cond = [conditions[k].repeat_interleave(config.group_size, 0) for k in keys]
    args = [latents, torch.full((batch,), 1, dtype=torch.long)] + cond
    noise = torch.randn_like(latents)
    with torch.no_grad():
        f0 = _median_seconds(lambda: lean(*args, noise=noise), 5)
    f = _median_seconds(lambda: lean(*args, noise=noise), 5)
    def backward():
        out = lean(*args, noise=noise)
        start = time.perf_counter()
        out[1].sum().backward()
        return time.perf_counter() - start
    b = statistics.median(backward() for _ in range(5))
    for p in policy.parameters():
        p.grad = None
    ideal = (f0 + f + b) / (f + b)
    lean = {k: v for k, v in results.items() if k != "recompute"}
    best = max(lean, key=lambda k: lean[k]["ratio_to_recompute"]) if lean else None
    return {
        "config": {**asdict(config), "sde": sde, "batch": batch,
                   "tokens": (config.latent // 2) ** 2 if config.model == "flux" else None,
                   "threads": torch.get_num_threads(), "device": "cpu",
                   "note": "tiny random-init model; compute dominates Python overhead at these "
                           "sizes on CPU"},
        "step_times": {"forward_nograd_s": f0, "forward_s": f, "backward_s": b},
        "ideal_ratio": ideal,
        "best_lean_schedule": best,
        "best_fraction_of_ideal": (lean[best]["ratio_to_recompute"] / ideal) if best else None,
        "schedules": results,
    }


def format_table(report: dict) -> str:
    lines = [f"ideal ratio (F0+F+B)/(F+B) = {report['ideal_ratio']:.3f}   "
             f"(F0 {report['step_times']['forward_nograd_s'] * 1e3:.1f} ms, "
             f"F {report['step_times']['forward_s'] * 1e3:.1f} ms, "
             f"B {report['step_times']['backward_s'] * 1e3:.1f} ms per step)",
             f"{'schedule':10s} {'rollout s':>10s} {'update s':>9s} {'total s':>8s} "
             f"{'ratio':>6s} {'kept MiB':>9s} {'cosine':>10s} {'rel L2':>9s}"]
    for name, e in report["schedules"].items():
        lines.append(f"{name:10s} {e['rollout_s']:10.3f} {e['update_s']:9.3f} {e['total_s']:8.3f} "
                     f"{e['ratio_to_recompute']:6.3f} {e['peak_extra_bytes'] / 2**20:9.2f} "
                     f"{e['grad_cosine']:10.7f} {e['grad_rel_l2']:9.2e}")
    if report["best_lean_schedule"]:
        lines.append(f"best lean schedule {report['best_lean_schedule']}: "
                     f"{report['best_fraction_of_ideal'] * 100:.1f}% of the ideal ratio")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile bench grpo", description=__doc__)
    p.add_argument("--model", default="flux", choices=("flux", "wan"))
    p.add_argument("--schedules", default="recompute,retain,reweight")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--fraction", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor"))
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    config = BenchConfig(model=ns.model, schedules=tuple(ns.schedules.split(",")),
                         steps=ns.steps, layers=ns.layers, hidden=ns.hidden, latent=ns.latent,
                         group_size=ns.group_size, fraction=ns.fraction, repeats=ns.repeats,
                         compiler=ns.compiler)
    log = (lambda *a: print(*a, file=sys.stderr)) if ns.json else print
    report = run_grpo_bench(config, log=log)
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0
