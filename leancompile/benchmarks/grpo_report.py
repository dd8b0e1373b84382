"""The text table of ``leancompile bench grpo`` (``benchmarks/grpo.py``): ``format_table``
of the report ``run_grpo_bench`` returns."""

from __future__ import annotations

__all__ = ["format_table"]


def _times(value, width: int) -> str:
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}s}"


def _percent(value) -> str:
    return f"{value * 100:8.1f}%" if value is not None else f"{'-':>9s}"


def format_table(report: dict) -> str:
    """The report as text: one line per row, medians and minima over the rounds."""
    cfg = report.get("config", {})
    steps, selected = cfg.get("steps"), cfg.get("selected_steps")
    by_compiler = report.get("by_compiler") or {cfg.get("compiler", "?"): report}
    lines = [f"host allocator: {cfg['malloc']} (--malloc)"] if "malloc" in cfg else []
    for compiler, part in by_compiler.items():
        t = part["step_times"]
        lines.append(f"{compiler}: ideal ratio (T*F0+S*(F+B))/((T-S)*F0+S*(F+B)) = "
                     f"{part['ideal_ratio']:.3f}   (F0 {t['forward_nograd_s'] * 1e3:.1f} ms, "
                     f"F {t['forward_s'] * 1e3:.1f} ms, B {t['backward_s'] * 1e3:.1f} ms per "
                     f"step; T={steps}, S={selected})")
    lines.append(f"{'row':20s} {'rollout s':>9s} {'update s':>8s} {'total s':>7s} {'min s':>6s} "
                 f"{'ratio':>6s} {'r. min':>6s} {'of ideal':>9s} {'id. min':>9s} "
                 f"{'x eager':>7s} {'x e. min':>8s} {'kept MiB':>8s} {'cosine':>10s} "
                 f"{'rel L2':>8s} {'|ratio-1|':>9s} {'syncs':>5s} {'sync MiB':>8s}")
    rows = [("eager", report["schedules"]["eager"])] if "eager" in report["schedules"] else []
    for compiler, part in by_compiler.items():
        rows += [(f"{compiler}/{name}", e) for name, e in part["schedules"].items()
                 if name != "eager"]
    for name, e in rows:
        lines.append(
            f"{name:20s} {e['rollout_s']:9.3f} {e['update_s']:8.3f} {e['total_s']:7.3f} "
            f"{e['total_s_min']:6.3f} {e['ratio_to_recompute']:6.3f} "
            f"{e['ratio_to_recompute_min']:6.3f} {_percent(e['fraction_of_ideal'])} "
            f"{_percent(e['fraction_of_ideal_min'])} {_times(e['ratio_to_eager'], 7)} "
            f"{_times(e['ratio_to_eager_min'], 8)} {e['peak_extra_bytes'] / 2**20:8.2f} "
            f"{e['grad_cosine']:10.7f} {e['grad_rel_l2']:8.2e} "
            f"{e.get('ratio_error', float('nan')):9.2e} {e.get('sync_collectives', 0):5d} "
            f"{e.get('sync_bytes', 0) / 2**20:8.2f}")
    lines.append("ratio: recompute's total / the row's (same compiler; eager: the first "
                 "compiler's recompute); x eager: eager's total / the row's; cosine, rel L2: "
                 "gradient against recompute's; |ratio-1|: the largest PPO ratio error of the "
                 "on-policy update (ratio_error); syncs, sync MiB: gradient reductions per step "
                 "and the bytes they carry per rank (data parallel)")
    if cfg.get("parallel"):
        lines.append(f"data parallel: {cfg.get('world_size')} ranks ({cfg['parallel']}, shared "
                     f"layout, {cfg.get('prompts', 1)} prompt group(s), grad_sync="
                     f"{cfg.get('grad_sync', 'auto')!r}"
                     + (f", bucket_cap_mb={cfg.get('bucket_cap_mb')}" if cfg["parallel"] == "fsdp"
                        else "") + "); no eager row (the eager FlowGRPO loop "
                     "here is single-process); ideal ratio from the full batch's F0, F, B on "
                     "one rank")
    for compiler, part in by_compiler.items():
        if part["best_lean_schedule"]:
            lines.append(f"best lean schedule ({compiler}) by median "
                         f"{part['best_lean_schedule']}: "
                         f"{part['best_fraction_of_ideal'] * 100:.1f}% of the ideal ratio; "
                         f"by min {part['best_lean_schedule_min']}: "
                         f"{part['best_fraction_of_ideal_min'] * 100:.1f}%")
    best = report.get("best_configuration")
    if best and best.get("ratio_to_eager") is not None:
        verdict = "faster" if best["ratio_to_eager"] > 1 else "slower"
        lines.append(f"best configuration (median total): {best['compiler']}/{best['schedule']}, "
                     f"{best['total_s']:.3f} s, {best['ratio_to_eager']:.3f}x eager "
                     f"({verdict} than eager; by min {best['ratio_to_eager_min']:.3f}x)")
    return "\n".join(lines)
