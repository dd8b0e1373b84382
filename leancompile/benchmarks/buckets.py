"""``leancompile bench buckets`` (under torchrun): ``GRPOTrainer(parallel="fsdp")`` with the step
graphs' collectives bucketed (``GRPOConfig(bucket_cap_mb=...)``) against one collective per
parameter, measured in one run.

The bench's FLUX policy (``bench grpo``'s sizes) is sharded once per variant (two copies of one
initialisation); every schedule of every variant computes the gradients of the same batch,
interleaved over ``rounds`` rounds (the variants' order alternates from round to round; min and
median printed). Per schedule: seconds per ``compute_gradients`` (rollout and update), the
speedup of the buckets, the gradient reductions per step (``GradResult.sync_collectives``),
the all-gathers one forward of the step issues, and the relative L2 distance of the bucketed
gradients to the per-parameter ones (largest over the ranks).

Retain runs a third variant, buckets with the gathered weights kept for the backward
(``GRPOConfig(reshard_after_forward=False)``) instead of gathered again: what each costs in
time and what the kept calls hold (``GradResult.retained_bytes``).
"""

from __future__ import annotations

import copy
import json
import statistics

import torch

__all__ = ["run_bucket_bench", "main"]

_AG = "_c10d_functional.all_gather_into_tensor.default"


def _gathered_peaks(trainer, keys, schedule) -> dict[str, int]:
    """Per graph of ``schedule``'s step, the most bytes of gathered weights alive at once."""
    from ..passes.gather_at_use import peak_gathered_bytes

    graph = trainer.lean_step(keys, None, trainer._regathers(schedule)).graphs[0]
    return {name: peak_gathered_bytes(gm) for name, gm in (
        ("forward", graph.forward), ("inference", graph.inference)) if gm is not None}


def _gathers_per_forward(trainer) -> int:
    """All-gathers in the forward graph of the trainer's step, after the passes."""
    counts = [r.op_counts_after.get(_AG, 0) for step in trainer._steps.values()
              for g in step.graphs if g.report is not None for r in g.report.graphs
              if r.phase == "forward"]
    return max(counts, default=0)


def run_bucket_bench(*, cap_mb: float = 25.0, rounds: int = 3, steps: int = 4, layers: int = 2,
                     hidden: int = 256, latent: int = 32,
                     schedules: tuple[str, ...] = ("recompute", "retain", "reweight"),
                     compiler: str = "aot_eager", log=print) -> dict:
    import torch.distributed as dist

    from ..grpo.trainer import GRPOConfig, GRPOTrainer
    from .grpo import BenchConfig, build_policy, flat_grads, mean_latent_reward

    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise SystemExit("leancompile bench buckets runs under torchrun with 2 or more ranks, "
                         "e.g. torchrun --nproc-per-node 2 -m leancompile.cli bench buckets")
    if not cap_mb > 0:
        raise ValueError(f"cap_mb={cap_mb!r} must be > 0")
    bench = BenchConfig(steps=steps, layers=layers, hidden=hidden, latent=latent)
    base = build_policy(bench)
    conditions = base.example_conditions(1, torch.Generator().manual_seed(1),
                                         sequence_length=bench.text_length)
    kept = "buckets, weights kept"
    variants = {"per-parameter": {"bucket_cap_mb": None},
                f"buckets of {cap_mb:g} MiB": {"bucket_cap_mb": cap_mb},
                kept: {"bucket_cap_mb": cap_mb, "reshard_after_forward": False}}
    trainers = {name: GRPOTrainer(copy.deepcopy(base), mean_latent_reward, None, GRPOConfig(
        sde="flow_grpo", eta=0.9, group_size=bench.group_size, compiler=compiler, **options),
        parallel="fsdp") for name, options in variants.items()}

    def run(name, schedule):
        return trainers[name].compute_gradients(
            conditions, torch.Generator().manual_seed(7), schedule=schedule)

    def names(s):  # the kept weights differ from the buckets under Retain only
        return [n for n in variants if n != kept or s == "retain"]

    rows = [(name, s) for s in schedules for name in names(s)]
    for row in rows:
        log(f"[bench] {row[0]}/{row[1]}: warm-up (captures and compiles the graphs)")
        run(*row)
    times = {row: [] for row in rows}
    syncs, grads, retained = {}, {}, {}
    for i in range(rounds):
        for s in schedules:
            for name in (names(s) if i % 2 == 0 else names(s)[::-1]):
                result = run(name, s)
                times[name, s].append(result.rollout_seconds + result.update_seconds)
                syncs[name, s] = result.sync_collectives
                retained[name, s] = result.retained_bytes
                grads[name, s] = flat_grads(result.grads)
                del result
                log(f"[bench] round {i + 1} {name}/{s}: {times[name, s][-1]:.3f} s")
    plain, bucketed, _ = variants

    def rel_l2(name, s):
        diff = (grads[name, s] - grads[plain, s]).norm() / grads[plain, s].norm().clamp_min(
            1e-30)
        rel = torch.tensor([float(diff)])
        dist.all_reduce(rel, op=dist.ReduceOp.MAX)
        return float(rel)

    out = {}
    for s in schedules:
        a, b = times[plain, s], times[bucketed, s]
        out[s] = {name: {"median_s": statistics.median(times[name, s]),
                         "min_s": min(times[name, s]), "reductions": syncs[name, s],
                         "gathers_per_forward": _gathers_per_forward(trainers[name]),
                         "retained_bytes": retained[name, s],
                         "gathered_peak_bytes": _gathered_peaks(trainers[name],
                                                                list(conditions), s)}
                  for name in names(s)}
        out[s]["speedup"] = statistics.median(a) / statistics.median(b)
        out[s]["speedup_min"] = min(a) / min(b)
        out[s]["grad_rel_l2"] = rel_l2(bucketed, s)
        if s == "retain":  # gathered again in the backward vs kept: seconds and bytes
            k = times[kept, s]
            out[s]["regather_time_ratio"] = statistics.median(b) / statistics.median(k)
            out[s]["regather_time_ratio_min"] = min(b) / min(k)
            out[s]["kept_grad_rel_l2"] = rel_l2(kept, s)
    return {"config": {"cap_mb": cap_mb, "rounds": rounds, "steps": steps, "layers": layers,
                       "hidden": hidden, "latent": latent, "compiler": compiler,
                       "world_size": dist.get_world_size(),
                       "backend": dist.get_backend(), "threads": torch.get_num_threads()},
            "variants": list(variants), "schedules": out}


def format_table(report: dict) -> str:
    cfg = report["config"]
    lines = [f"fsdp over {cfg['world_size']} ranks ({cfg['backend']}, {cfg['compiler']}), "
             f"bench FLUX {cfg['layers']}+{cfg['layers']} blocks, hidden {cfg['hidden']}, "
             f"{cfg['steps']} steps; {cfg['rounds']} interleaved rounds",
             f"{'schedule':10s} {'variant':22s} {'median s':>9s} {'min s':>7s} "
             f"{'reductions':>10s} {'gathers/fwd':>11s} {'kept MiB':>9s} "
             f"{'gathered MiB inf/fwd':>21s}"]
    for s, entry in report["schedules"].items():
        for name in report["variants"]:
            if name not in entry:
                continue
            e = entry[name]
            lines.append(f"{s:10s} {name:22s} {e['median_s']:9.3f} {e['min_s']:7.3f} "
                         f"{e['reductions']:10d} {e['gathers_per_forward']:11d} "
                         f"{e['retained_bytes'] / 2**20:9.2f} "
                         f"{e['gathered_peak_bytes']['inference'] / 2**20:13.2f}/"
                         f"{e['gathered_peak_bytes'].get('forward', 0) / 2**20:.2f}")
        lines.append(f"{'':10s} {'speedup of buckets':22s} {entry['speedup']:8.2f}x "
                     f"{entry['speedup_min']:6.2f}x   (median, min); gradients rel L2 "
                     f"{entry['grad_rel_l2']:.1e}")
        if "regather_time_ratio" in entry:
            lines.append(f"{'':10s} {'re-gather / kept':22s} "
                         f"{entry['regather_time_ratio']:8.2f}x "
                         f"{entry['regather_time_ratio_min']:6.2f}x   (time, median, min); "
                         f"gradients rel L2 {entry['kept_grad_rel_l2']:.1e}")
    lines.append("reductions: gradient reduce-scatters (or bucketed ones) per compute_gradients "
                 "call; gathers/fwd: all-gathers in one forward of the step graph; kept MiB: "
                 "what Retain's kept calls hold at the peak (reshard_after_forward: the "
                 "parameters gathered again in the backward, or the gathered weights kept); "
                 "gathered MiB: gathered weights alive at once in one call of the step's "
                 "inference / forward graph (buckets follow the order of use, "
                 "passes/gather_at_use.py: a cap below the model's size shows it)")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    import torch.distributed as dist

    from .timing import join_torchrun

    p = argparse.ArgumentParser(prog="leancompile bench buckets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-mb", type=float, default=25.0, help="bucket cap in MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--schedules", default="recompute,retain,reweight")
    p.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor"))
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    joined, log = join_torchrun(ns.json)
    quiet = dist.is_initialized() and dist.get_rank() != 0
    try:
        report = run_bucket_bench(cap_mb=ns.cap_mb, rounds=ns.rounds, steps=ns.steps,
                                  layers=ns.layers, hidden=ns.hidden, latent=ns.latent,
                                  schedules=tuple(ns.schedules.split(",")),
                                  compiler=ns.compiler, log=log)
    finally:
        if joined:
            dist.destroy_process_group()
    if not quiet:
        print(json.dumps(report, indent=2) if ns.json else format_table(report))
    return 0
