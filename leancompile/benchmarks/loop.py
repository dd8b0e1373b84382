"""``leancompile bench loop``: a FlowGRPO-style loop (``leancompile/demos/user_loops.py``) as its
users run it, against the same loop with its velocity wrapped by ``lean_compile(schedule=
"retain")``, measured in one run.

Four variants, interleaved over ``rounds`` rounds (min and median printed): the plain loop and
the wrapped loop with aligned batches (the update repeats the rollout's batches: every update
call is one kept call), and both with FlowGRPO's regrouping (samples shuffled, timesteps
permuted per sample, a train batch of half the sampling batch: kept rows are gathered). The
plain loop's velocity is compiled with the same backend (``lean_compile`` without a schedule),
so only the reuse differs. The ideal ratio comes from the step itself, timed through the same
wrapper: ``F0`` (forward, no grad), ``F`` (forward with grad), ``B`` (backward), full batch:
``(T F0 + S (F + B)) / ((T - S) F0 + S (F + B))`` for ``T`` steps of which ``S`` are trained,
which is ``(F0 + F + B) / (F + B)`` when all are. Gradients of every variant are compared with
its plain loop's (relative L2 over all parameters).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import time

import torch

from .timing import add_malloc_flag, apply_malloc_flag, ideal_ratio, step_times

__all__ = ["run_loop_bench", "main"]


def run_loop_bench(*, rounds: int = 3, steps: int = 6, layers: int = 2, hidden: int = 256,
                   latent: int = 32, compiler: str = "aot_eager", log=print,
                   single_layers: int | None = None) -> dict:
    import leancompile

    from ..demos.user_loops import LoopConfig, flow_grpo_loop
    from .grpo import BenchConfig, build_policy

    policy = build_policy(BenchConfig(steps=steps, layers=layers, single_layers=single_layers,
                                      hidden=hidden, latent=latent))
    policy.requires_grad_(True)
    initial = copy.deepcopy(policy.state_dict())
    aligned = LoopConfig(prompts=2, group_size=2, sample_batch=4, train_batch=4,
                         timestep_fraction=1.0, shuffle=False, lr=1e-4)
    regrouped = dataclasses.replace(aligned, train_batch=2, shuffle=True)
    plain = leancompile.lean_compile(policy.velocity, backend=compiler)
    lean = leancompile.lean_compile(policy.velocity, backend=compiler, schedule="retain")
    variants = {"plain aligned": (plain, aligned), "lean aligned": (lean, aligned),
                "plain regrouped": (plain, regrouped), "lean regrouped": (lean, regrouped)}

    def run(name):
        fn, config = variants[name]
        policy.load_state_dict(initial)
        if fn is lean:
            lean.reset_stats()
        start = time.perf_counter()
        result = flow_grpo_loop(policy, fn, config, seed=1)
        return time.perf_counter() - start, result

    for name in variants:
        log(f"[bench] {name}: warm-up (compiles)")
        run(name)
    times = {name: [] for name in variants}
    grads, stats = {}, {}
    for i in range(rounds):
        for name in variants:
            seconds, result = run(name)
            times[name].append(seconds)
            grads[name] = torch.cat([g.flatten() for g in result.grads[0].values()])
            if name.startswith("lean"):
                stats[name] = lean.stats
            log(f"[bench] round {i + 1} {name}: {seconds:.3f} s")

    # The ideal ratio, from the step timed through the same wrapper (full batch, one step).
    gen = torch.Generator().manual_seed(0)
    x = policy.initial_latents(4, gen).float()
    cond = policy.example_conditions(4, gen)
    k = torch.full((4,), 1, dtype=torch.long)
    model_times = step_times(lambda: lean(x, k, cond), lambda out: out.square().mean(),
                             policy.parameters())
    ideal = ideal_ratio(model_times, steps, steps)  # timestep_fraction=1.0: every step trained

    out = {"config": {"rounds": rounds, "steps": steps, "layers": layers, "hidden": hidden,
                      "latent": latent, "compiler": compiler, "samples": 4,
                      "threads": torch.get_num_threads()},
           "step_times": model_times,
           "ideal_ratio": ideal, "variants": {}}
    for name, done in times.items():
        entry = {"seconds_min": min(done), "seconds_median": statistics.median(done)}
        base = "plain " + name.split(" ", 1)[1]
        if name.startswith("lean"):
            entry["ratio_min"] = min(times[base]) / min(done)
            entry["ratio_median"] = statistics.median(times[base]) / statistics.median(done)
            entry["fraction_of_ideal"] = entry["ratio_median"] / ideal
            g, ref = grads[name], grads[base]
            entry["grad_rel_l2"] = ((g - ref).norm() / ref.norm()).item()
            s = stats[name]
            entry.update(update_calls=s.update_calls, reused_calls=s.reused_calls,
                         forwards_run=s.forwards_run, mechanisms=dict(s.mechanisms),
                         kept_mib=s.peak_kept_bytes / 2**20,
                         gathered_mib=s.gathered_bytes / 2**20, gather_s=s.gather_seconds)
        out["variants"][name] = entry
    aligned_s = out["variants"]["lean aligned"]["seconds_median"]
    regrouped_s = out["variants"]["lean regrouped"]["seconds_median"]
    out["regroup_cost_s"] = regrouped_s - aligned_s
    return out


def format_table(report: dict) -> str:
    t = report["step_times"]
    lines = [f"host allocator: {report['malloc']} (--malloc)"] if "malloc" in report else []
    lines += [f"ideal ratio = {report['ideal_ratio']:.3f}   "
              f"(F0 {t['forward_nograd_s'] * 1e3:.1f} ms, "
              f"F {t['forward_s'] * 1e3:.1f} ms, B {t['backward_s'] * 1e3:.1f} ms per step)",
              f"{'variant':16s} {'min s':>7s} {'median s':>9s} {'ratio':>6s} {'of ideal':>9s} "
              f"{'update fwd':>10s} {'grad rel L2':>12s}"]
    for name, e in report["variants"].items():
        if name.startswith("lean"):
            lines.append(f"{name:16s} {e['seconds_min']:7.3f} {e['seconds_median']:9.3f} "
                         f"{e['ratio_median']:6.3f} {e['fraction_of_ideal'] * 100:8.1f}% "
                         f"{e['forwards_run']:>4d}/{e['update_calls']:<5d} "
                         f"{e['grad_rel_l2']:12.2e}")
        else:
            lines.append(f"{name:16s} {e['seconds_min']:7.3f} {e['seconds_median']:9.3f}")
    g = report["variants"]["lean regrouped"]
    lines.append(f"regrouped rows: {g['gathered_mib']:.1f} MiB gathered in {g['gather_s']:.3f} s "
                 f"per loop; the regrouped loop takes {report['regroup_cost_s']:+.3f} s against "
                 "the aligned one (median)")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile bench loop", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor"))
    p.add_argument("--json", action="store_true")
    add_malloc_flag(p)
    ns = p.parse_args(argv)
    log = (lambda *a: print(*a, file=sys.stderr)) if ns.json else print
    malloc = apply_malloc_flag(ns.malloc)
    report = run_loop_bench(rounds=ns.rounds, steps=ns.steps, layers=ns.layers,
                            hidden=ns.hidden, latent=ns.latent, compiler=ns.compiler, log=log)
    report["malloc"] = malloc
    print(json.dumps(report, indent=2) if ns.json else format_table(report))
    return 0
