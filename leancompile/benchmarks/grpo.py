"""``leancompile bench grpo``: plain eager FlowGRPO vs recompute vs retain vs reweight on one
random-init diffusers model, same seeds, measured in one run.

Rows:

``eager``
    What users run today: the same diffusers transformer with no ``torch.compile`` and no
    leancompile. The sampling loop (all denoising steps, the SDE transition and its log-prob)
    runs under ``torch.no_grad()``; then, as FlowGRPO's ``scripts/train_flux.py`` /
    ``train_sd3.py`` do, one forward with grad per selected step (all samples at their j-th
    selected step), the SDE log-prob of the recorded sample, the PPO ratio/clip loss averaged
    over the batch and divided by the number of selected steps (gradient accumulation), and a
    backward that accumulates into ``.grad``. Timed once per round, with the compiled rows.
``<compiler>/recompute|retain|reweight``
    ``GRPOTrainer.compute_gradients`` with that schedule, its policy step compiled by
    ``compiler`` (``aot_eager`` or ``inductor``; several with ``compilers``).

Every row uses the same model, shapes, SDE (``flow_grpo`` for FLUX, ``dance_grpo`` for Wan),
steps, seeds (timestep selection, initial latents, SDE noise) and reward; advantages come from
each row's own rollout, which is the same up to rounding. Each row gets one warm-up call
(captures and compiles the graphs), then one untimed interleaved round, then ``repeats``
interleaved rounds time every row once (rollout and update seconds, in the trainer's sense:
rollout = sampling + rewards + advantages, update = the gradient computation). Reported per
row: the median and the minimum over the rounds, retained bytes, gradient buffers, and the
gradient's cosine and relative L2 error against recompute's (and against eager's).

The ideal ratio is measured from the captured graphs themselves: forward without grad ``F0``,
forward with saving ``F``, backward ``B`` of the full batch at one step; with ``T`` steps of
which ``S`` are trained per sample, ``ideal = (T*F0 + S*(F + B)) / ((T - S)*F0 + S*(F + B))``
(recompute's work over a schedule's that reuses the rollout's forward). ``fraction_of_ideal``
is a lean schedule's ratio to recompute over that ideal, by median and by minimum.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass

import torch

from ..passes.lean_grpo import SCHEDULES
from .grpo_eager import EagerResult, eager_flow_grpo_gradients
from .grpo_report import format_table
from .timing import add_malloc_flag, apply_malloc_flag, ideal_ratio, join_torchrun, step_times

__all__ = ["BenchConfig", "EagerResult", "eager_flow_grpo_gradients", "run_grpo_bench",
           "format_table", "flat_grads", "main"]

COMPILERS = ("aot_eager", "inductor")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What the benchmark runs. The defaults make compute dominate Python overhead on a CPU."""

    model: str = "flux"
    """``flux`` or ``wan``."""
    schedules: tuple[str, ...] = SCHEDULES
    layers: int = 2
    """FLUX: double-stream blocks (and single-stream ones unless ``single_layers``); Wan:
    blocks."""
    single_layers: int | None = None
    """FLUX only: single-stream blocks (``None``: ``layers``; FLUX.1 has 19 double-stream and
    38 single-stream blocks)."""
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
    parallel: str = "ddp"
    """Under torchrun (more than one rank): ``ddp`` or ``fsdp`` (``GRPOTrainer(parallel=)``)."""
    grad_sync: str = "auto"
    """Under torchrun: when Reweight reduces its gradients (``GRPOConfig.grad_sync``)."""
    bucket_cap_mb: float | None = 25.0
    """Under torchrun with ``fsdp``: the step graphs' collectives bucketed to this many MiB
    (``GRPOConfig.bucket_cap_mb``; None: one per parameter)."""
    compiler: str = "aot_eager"
    """The compiler of the report's top-level rows. With ``compilers`` given, it is set to the
    first of them."""
    compilers: tuple[str, ...] | None = None
    """Compilers to time the schedules under, in order (the eager row runs once); None: just
    ``compiler``. After construction this is never None."""
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    """Where the model runs: ``cpu`` or ``cuda`` (``cuda:N``); every timer waits for the
    device's queued work (``leancompile.lean.synchronize``)."""
    dtype: str = "float32"
    """The transformer's weights: ``float32`` or ``bfloat16`` (the SDE and log-probs stay
    float32, as in FlowGRPO and DanceGRPO)."""

    def __post_init__(self):
        if self.model not in ("flux", "wan"):
            raise ValueError(f"model={self.model!r}; use 'flux' or 'wan'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; use one of {tuple(DTYPES)}")
        try:
            device = torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"device={self.device!r}: {error}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}; use 'cpu' or 'cuda' ('cuda:N')")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but this torch sees no CUDA device "
                             f"(torch {torch.__version__}); use device='cpu'")
        unknown = set(self.schedules) - set(SCHEDULES)
        if unknown or "recompute" not in self.schedules:
            raise ValueError(f"schedules={self.schedules}: pick from recompute, retain, reweight "
                             "and include recompute (the reference)")
        if self.hidden % 64:
            raise ValueError(f"hidden={self.hidden} must be a multiple of 64 (the head dim)")
        compilers = (self.compiler,) if self.compilers is None else tuple(self.compilers)
        if not compilers or set(compilers) - set(COMPILERS) or len(set(compilers)) != len(
                compilers):
            raise ValueError(f"compilers={self.compilers}: give one or more distinct names "
                             f"from {COMPILERS}")
        object.__setattr__(self, "compilers", compilers)
        object.__setattr__(self, "compiler", compilers[0])
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be >= 1")
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"parallel={self.parallel!r}; use 'ddp' or 'fsdp'")
        if self.prompts < 1:
            raise ValueError(f"prompts={self.prompts} must be >= 1")
        from ..grpo.config import GRAD_SYNCS

        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync={self.grad_sync!r}; use one of {GRAD_SYNCS}")
        from ..options import check_bucket_cap_mb

        check_bucket_cap_mb(self.bucket_cap_mb)


def build_policy(config: BenchConfig):
    from ..integrations.diffusers import FluxPolicy, WanPolicy

    torch.manual_seed(config.seed)
    heads = config.hidden // 64
    if config.model == "flux":
        from diffusers import FluxTransformer2DModel

        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=config.layers,
            num_single_layers=config.layers if config.single_layers is None
            else config.single_layers, attention_head_dim=64, num_attention_heads=heads,
            joint_attention_dim=config.hidden, pooled_projection_dim=config.hidden,
            axes_dims_rope=[16, 24, 24], guidance_embeds=True).eval()
        transformer.to(config.device, DTYPES[config.dtype])
        return FluxPolicy(transformer, num_inference_steps=config.steps, height=config.latent,
                          width=config.latent, vae_scale_factor=1)
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16,
        out_channels=16, text_dim=config.hidden, freq_dim=256, ffn_dim=2 * config.hidden,
        num_layers=config.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024).eval()
    transformer.to(config.device, DTYPES[config.dtype])
    return WanPolicy(transformer, num_inference_steps=config.steps, height=config.latent * 8,
                     width=config.latent * 8, num_frames=config.frames, guidance_scale=5.0,
                     flow_shift=3.0)


def mean_latent_reward(latents, conditions):
    """A cheap reward (the mean latent), so that the model dominates the timing."""
    return latents.float().flatten(1).mean(1)


# -- the benchmark -----------------------------------------------------------------------------
def flat_grads(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every gradient of ``grads`` flattened into one float64 vector (in the dict's order)."""
    return torch.cat([g.detach().flatten().double() for g in grads.values()])


def _agreement(g: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    cosine = torch.nn.functional.cosine_similarity(g, reference, dim=0).item()
    return cosine, ((g - reference).norm() / reference.norm()).item()


def _entry(done, retained: int, buffered: int) -> dict:
    totals = [r + u for r, u in done]
    return {"rollout_s": statistics.median(r for r, _ in done),
            "update_s": statistics.median(u for _, u in done),
            "total_s": statistics.median(totals),
            "total_s_min": min(totals), "total_s_max": max(totals),
            "retained_bytes": retained, "buffer_bytes": buffered,
            "peak_extra_bytes": max(retained, buffered)}


def _step_times(trainer, policy, conditions, config: BenchConfig, gen) -> dict:
    """``F0``, ``F`` and ``B`` of the full batch at one step, through the trainer's LeanStep."""
    keys = list(conditions)
    batch = config.prompts * config.group_size
    lean = trainer.lean_step(keys)
    latents = policy.initial_latents(batch, gen()).float()
    cond = [conditions[k].repeat_interleave(config.group_size, 0) for k in keys]
    args = [latents, torch.full((batch,), 1, dtype=torch.long, device=latents.device)] + cond
    noise = torch.randn_like(latents)
    return step_times(lambda: lean(*args, noise=noise), lambda out: out[1].sum(),
                      policy.parameters(), device=latents.device)


def _best_lean(results: dict) -> dict:
    lean = [k for k in results if k != "recompute"]
    if not lean:
        return {"best_lean_schedule": None, "best_fraction_of_ideal": None,
                "best_lean_schedule_min": None, "best_fraction_of_ideal_min": None}
    best = max(lean, key=lambda k: results[k]["ratio_to_recompute"])
    best_min = max(lean, key=lambda k: results[k]["ratio_to_recompute_min"])
    return {"best_lean_schedule": best,
            "best_fraction_of_ideal": results[best]["fraction_of_ideal"],
            "best_lean_schedule_min": best_min,
            "best_fraction_of_ideal_min": results[best_min]["fraction_of_ideal_min"]}


def run_grpo_bench(config: BenchConfig, *, log=print) -> dict:
    """Time the eager row and every (compiler, schedule) in interleaved rounds; see the module
    docstring. The top-level ``schedules`` holds ``eager`` and the first compiler's rows;
    ``by_compiler`` every compiler's."""
    import torch.distributed as dist

    from ..grpo.trainer import GRPOConfig, GRPOTrainer

    if config.threads:
        torch.set_num_threads(config.threads)
    policy = build_policy(config)
    sde = "dance_grpo" if config.model == "wan" else "flow_grpo"
    # Under torchrun: data parallel (the shared layout), and no eager row (FlowGRPO's eager loop
    # here is single-process).
    world = dist.get_world_size() if dist.is_initialized() else 1
    parallel = config.parallel if world > 1 else None
    trainers = {c: GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(
        sde=sde, eta=0.3 if sde == "dance_grpo" else 0.9, group_size=config.group_size,
        timestep_fraction=config.fraction, compiler=c, grad_sync=config.grad_sync,
        bucket_cap_mb=config.bucket_cap_mb),
        parallel=parallel)
        for c in config.compilers}
    grpo_config = trainers[config.compiler].config
    conditions = policy.example_conditions(config.prompts, torch.Generator().manual_seed(1),
                                           sequence_length=config.text_length)

    def gen():
        return torch.Generator().manual_seed(config.seed + 7)

    rows = ([("eager", None)] if parallel is None else []) + \
        [(c, s) for c in config.compilers for s in config.schedules]

    def run(compiler, schedule):
        if compiler == "eager":
            return eager_flow_grpo_gradients(policy, grpo_config, conditions,
                                             mean_latent_reward, gen())
        return trainers[compiler].compute_gradients(conditions, gen(), schedule=schedule)

    def label(compiler, schedule):
        return "eager" if compiler == "eager" else f"{compiler}/{schedule}"

    for row in rows:
        log(f"[bench] {label(*row)}: warm-up (captures and compiles the graphs)")
        run(*row)
    # One more untimed round in the timed order: the host heap reaches the size the rows need
    # side by side (the first rounds otherwise pay the page faults of its growth, Retain most).
    log("[bench] warm-up round")
    for row in rows:
        run(*row)
    # Rounds interleave the rows, so drift on the machine hits them alike. Only timings and the
    # last gradients are kept (holding every result's tensors skews the allocator, and so the
    # timings, of later runs).
    times = {row: [] for row in rows}
    last = {}
    ratio_errors = {row: 0.0 for row in rows}
    syncs = {row: (0, 0) for row in rows}
    for i in range(config.repeats):
        for row in rows:
            result = run(*row)
            times[row].append((result.rollout_seconds, result.update_seconds))
            ratio_errors[row] = max(ratio_errors[row], result.ratio_error or 0.0)
            syncs[row] = (getattr(result, "sync_collectives", 0),
                          getattr(result, "sync_bytes", 0))
            last[row] = (flat_grads(result.grads), getattr(result, "retained_bytes", 0),
                         getattr(result, "buffer_bytes", 0))
            del result
            log(f"[bench] round {i + 1} {label(*row)}: rollout {times[row][-1][0]:.3f} s, "
                f"update {times[row][-1][1]:.3f} s")

    entries, grads = {}, {}
    for row, done in times.items():
        grads[row], retained, buffered = last[row]
        entries[row] = _entry(done, retained, buffered)
        entries[row]["ratio_error"] = ratio_errors[row]
        entries[row]["sync_collectives"], entries[row]["sync_bytes"] = syncs[row]
    eager = entries.get(("eager", None))
    eager_grad = grads.get(("eager", None))

    num_steps = config.steps
    num_selected = grpo_config.selection.num_selected(num_steps)
    by_compiler = {}
    for compiler in config.compilers:
        model_times = _step_times(trainers[compiler], policy, conditions, config, gen)
        ideal = ideal_ratio(model_times, num_steps, num_selected)
        base = entries[(compiler, "recompute")]
        reference = grads[(compiler, "recompute")]
        results = {}
        for schedule in config.schedules:
            entry = entries[(compiler, schedule)]
            entry["compiler"] = compiler
            entry["ratio_to_recompute"] = base["total_s"] / entry["total_s"]
            entry["ratio_to_recompute_min"] = base["total_s_min"] / entry["total_s_min"]
            lean = schedule != "recompute"
            entry["fraction_of_ideal"] = entry["ratio_to_recompute"] / ideal if lean else None
            entry["fraction_of_ideal_min"] = (entry["ratio_to_recompute_min"] / ideal
                                              if lean else None)
            entry["ratio_to_eager"] = (eager["total_s"] / entry["total_s"]
                                       if eager else None)
            entry["ratio_to_eager_min"] = (eager["total_s_min"] / entry["total_s_min"]
                                           if eager else None)
            entry["grad_cosine"], entry["grad_rel_l2"] = _agreement(
                grads[(compiler, schedule)], reference)
            entry["grad_cosine_to_eager"], entry["grad_rel_l2_to_eager"] = _agreement(
                grads[(compiler, schedule)], eager_grad) if eager else (None, None)
            results[schedule] = entry
        by_compiler[compiler] = {"step_times": model_times, "ideal_ratio": ideal,
                                 **_best_lean(results), "schedules": results}

    # The eager row, against the first compiler's recompute.
    first = by_compiler[config.compiler]
    base = first["schedules"]["recompute"]
    if eager:
        _eager_row(eager, eager_grad, base, grads[(config.compiler, "recompute")])
    best = min(((c, s) for c in config.compilers for s in config.schedules),
               key=lambda row: entries[row]["total_s"])
    best_entry = entries[best]
    return {
        "config": {**asdict(config), "sde": sde, "batch": config.prompts * config.group_size,
                   "selected_steps": num_selected,
                   "tokens": (config.latent // 2) ** 2 if config.model == "flux" else None,
                   "threads": torch.get_num_threads(),
                   "device_name": _device_name(config.device),
                   "world_size": world, "parallel": parallel,
                   "note": "random-init model; the defaults are sized so that compute "
                           "dominates Python overhead on a CPU"},
        "step_times": first["step_times"],
        "ideal_ratio": first["ideal_ratio"],
        **{k: first[k] for k in ("best_lean_schedule", "best_fraction_of_ideal",
                                 "best_lean_schedule_min", "best_fraction_of_ideal_min")},
        "schedules": {**({"eager": eager} if eager else {}), **first["schedules"]},
        "by_compiler": by_compiler,
        "best_configuration": {"compiler": best[0], "schedule": best[1],
                               "total_s": best_entry["total_s"],
                               "ratio_to_eager": best_entry["ratio_to_eager"],
                               "ratio_to_eager_min": best_entry["ratio_to_eager_min"]},
    }


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _eager_row(eager, eager_grad, base, base_grad) -> None:
    """Fill the eager row's ratios (against ``base``, the first compiler's recompute)."""
    eager.update(compiler=None, ratio_to_recompute=base["total_s"] / eager["total_s"],
                 ratio_to_recompute_min=base["total_s_min"] / eager["total_s_min"],
                 fraction_of_ideal=None, fraction_of_ideal_min=None, ratio_to_eager=1.0,
                 ratio_to_eager_min=1.0, sync_collectives=0, sync_bytes=0)
    eager["grad_cosine"], eager["grad_rel_l2"] = _agreement(eager_grad, base_grad)
    eager["grad_cosine_to_eager"], eager["grad_rel_l2_to_eager"] = 1.0, 0.0


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile bench grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux", choices=("flux", "wan"))
    p.add_argument("--schedules", default="recompute,retain,reweight")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=2,
                   help="FLUX: double-stream blocks (and single-stream unless --single-layers); "
                        "Wan: blocks")
    p.add_argument("--single-layers", type=int, default=None,
                   help="FLUX: single-stream blocks (default: --layers)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--prompts", type=int, default=1,
                   help="prompt groups per step (each of --group-size samples)")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--fraction", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"),
                   help="under torchrun: replicated (ddp) or sharded (fsdp) parameters")
    from ..grpo.config import GRAD_SYNCS

    p.add_argument("--grad-sync", default="auto", choices=GRAD_SYNCS,
                   help="under torchrun: Reweight's gradient reductions once per round of "
                        "prompt groups or once per update (GRPOConfig.grad_sync; auto: group "
                        "under fsdp)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="under torchrun with --parallel fsdp: merge the step graphs' "
                        "all-gathers and reduce-scatters into buckets of this many MiB "
                        "(GRPOConfig.bucket_cap_mb; 0: one collective per parameter)")
    p.add_argument("--compiler", default=None, choices=COMPILERS,
                   help="compiler of the schedules (default aot_eager)")
    p.add_argument("--compilers", default=None,
                   help="comma list of compilers to time the schedules under in one run, e.g. "
                        "aot_eager,inductor (the first gives the top-level rows); default: "
                        "--compiler")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda (cuda:N): where the model and the rollout run")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                   help="the transformer's weights (the SDE and log-probs stay float32)")
    p.add_argument("--text-length", type=int, default=32, help="prompt tokens")
    p.add_argument("--frames", type=int, default=5, help="Wan: video frames")
    p.add_argument("--json", action="store_true", help="print the report as JSON (logs go to "
                                                       "stderr)")
    add_malloc_flag(p)
    ns = p.parse_args(argv)
    if ns.compilers is not None:
        compilers = tuple(c.strip() for c in ns.compilers.split(",") if c.strip())
        if ns.compiler is not None and compilers[:1] != (ns.compiler,):
            p.error(f"--compiler {ns.compiler} and --compilers {ns.compilers}: the first of "
                    "--compilers is the top-level compiler; give one of the two")
    else:
        compilers = (ns.compiler or "aot_eager",)
    try:
        config = BenchConfig(model=ns.model, schedules=tuple(ns.schedules.split(",")),
                             steps=ns.steps, layers=ns.layers,
                             single_layers=ns.single_layers, hidden=ns.hidden,
                             latent=ns.latent, prompts=ns.prompts, group_size=ns.group_size,
                             fraction=ns.fraction, repeats=ns.repeats, parallel=ns.parallel,
                             grad_sync=ns.grad_sync, compiler=compilers[0],
                             bucket_cap_mb=ns.bucket_cap_mb or None,
                             compilers=compilers, device=ns.device, dtype=ns.dtype,
                             text_length=ns.text_length, frames=ns.frames)
    except ValueError as error:
        p.error(str(error))
    import torch.distributed as dist

    # torchrun: data parallel over the launched ranks; rank 0 reports.
    joined, log = join_torchrun(ns.json, ns.device)
    quiet = dist.is_initialized() and dist.get_rank() != 0
    malloc = apply_malloc_flag(ns.malloc)
    try:
        report = run_grpo_bench(config, log=log)
        report["config"]["malloc"] = malloc
    finally:
        if joined:
            dist.destroy_process_group()
    if quiet:
        return 0
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0
