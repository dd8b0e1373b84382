"""``leancompile bench overhead``: what the LeanGRPO wrapper itself costs per call.

A wrapped call (``lean_compile(fn, schedule=...)``) does the compiled function's work plus the
wrapper's: finding the call's tensors, the hook guards, the phase dispatch, and in the phases
the row fingerprints and kept state (rollout), matching and the parameter digest (update).
Timed against the same call under plain ``torch.compile`` with the same backend, on a tiny
function where that per-call work is all there is to see, interleaved over ``rounds`` rounds
(min and median of each row's per-call microseconds):

- ``no_grad``: a call outside the phases under ``torch.no_grad()`` (the inference graph);
- ``grad``: forward + backward outside the phases;
- ``rollout``: a trained rollout call (forward graph, rows fingerprinted, activations kept),
  against plain ``torch.compile``'s no-grad call, which is what the loop ran before;
- ``update``: a reused update call and its backward (no forward), against plain
  ``torch.compile``'s forward + backward.

``--profile`` adds a cProfile of the wrapped calls, by where their time goes (leancompile,
Dynamo, the compiled graphs, the rest of torch).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch

__all__ = ["run_overhead_bench", "main"]


def _policy(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width))


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def run_overhead_bench(*, backend: str = "aot_eager", width: int = 16, batch: int = 4,
                       rounds: int = 5, calls: int = 200, profile: bool = False,
                       log=print) -> dict:
    import leancompile

    torch._dynamo.reset()
    base = _policy(width)
    plain = torch.compile(copy.deepcopy(base), backend=backend)
    lean = leancompile.lean_compile(copy.deepcopy(base), backend=backend, schedule="retain")
    x = torch.randn(batch, width)
    xs = [x + i for i in range(calls)]  # (distinct rows, as a trajectory's steps are)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn(x)
        return call

    def grad(fn):
        return lambda: fn(x).sum().backward()

    def rollout():
        with lean.rollout(), torch.no_grad():
            for xi in xs:
                lean(xi)

    def update():
        with lean.update():
            for xi in xs:
                lean(xi).sum().backward()

    def rollout_and_update():
        # Each update call reuses one kept rollout call: time the two loops apart.
        start = time.perf_counter()
        rollout()
        middle = time.perf_counter()
        update()
        end = time.perf_counter()
        return (middle - start) / calls * 1e6, (end - middle) / calls * 1e6

    rows = {name: [] for name in ("no_grad plain", "no_grad lean", "grad plain", "grad lean",
                                  "rollout lean", "update lean")}
    # warm-up: every graph compiled
    for fn in (no_grad(plain), no_grad(lean), grad(plain), grad(lean)):
        fn()
        fn()
    rollout_and_update()
    for _ in range(rounds):
        rows["no_grad plain"].append(_per_call_us(no_grad(plain), calls))
        rows["no_grad lean"].append(_per_call_us(no_grad(lean), calls))
        rows["grad plain"].append(_per_call_us(grad(plain), calls))
        rows["grad lean"].append(_per_call_us(grad(lean), calls))
        kept, reused = rollout_and_update()
        rows["rollout lean"].append(kept)
        rows["update lean"].append(reused)
        lean.reset_stats()
    result = {"backend": backend, "width": width, "batch": batch, "rounds": rounds,
              "calls": calls, "rows": {k: {"median_us": statistics.median(v), "min_us": min(v)}
                                       for k, v in rows.items()}}
    pairs = [("no_grad", "no_grad lean", "no_grad plain"), ("grad", "grad lean", "grad plain"),
             ("rollout", "rollout lean", "no_grad plain"), ("update", "update lean",
                                                           "grad plain")]
    log(f"per-call microseconds, {backend}, Linear-Tanh-Linear width {width}, batch {batch}, "
        f"{rounds} interleaved rounds of {calls} calls (median / min)")
    log(f"{'call':<10}{'plain torch.compile':>22}{'lean_compile':>18}{'wrapper adds':>16}")
    result["wrapper_us"] = {}
    for name, mine, theirs in pairs:
        m, t = result["rows"][mine], result["rows"][theirs]
        added = m["median_us"] - t["median_us"]
        result["wrapper_us"][name] = added
        log(f"{name:<10}{t['median_us']:>12.1f} / {t['min_us']:<7.1f}"
            f"{m['median_us']:>10.1f} / {m['min_us']:<7.1f}{added:>+10.1f}")
    log("(rollout: a trained call against plain torch.compile's no-grad call; update: a reused "
        "call and its backward against plain forward + backward)")
    if profile:
        result["profile"] = _profile(rollout_and_update, log)
    return result


def _profile(run, log) -> dict:
    """Self time of the wrapped calls by where it is spent."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, self_time, _, _) in pstats.Stats(profiler).stats.items():
        if "/leancompile/" in filename:
            where = "leancompile (the wrapper)"
        elif "/torch/_dynamo/" in filename:
            where = "Dynamo (guards, frame entry)"
        elif filename.startswith("<eval_with_key>") or "fx/graph_module" in filename:
            where = "the compiled graphs"
        elif "/torch/" in filename or name.startswith("<method") or name.startswith(
                "<built-in method torch"):
            where = "the rest of torch (ops, autograd)"
        else:
            where = "Python (contextlib, builtins)"
        totals[where] = totals.get(where, 0.0) + self_time
    whole = sum(totals.values()) or 1.0
    log("where the wrapped rollout + update calls spend their time (cProfile self time):")
    for where, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        log(f"  {where:<38}{100 * seconds / whole:>6.1f}%")
    return {k: v / whole for k, v in totals.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="leancompile bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run_overhead_bench(backend=ns.backend, width=ns.width, batch=ns.batch,
                                rounds=ns.rounds, calls=ns.calls, profile=ns.profile,
                                log=(lambda *a: None) if ns.json else print)
    if ns.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    return 0
