"""Compiling each captured graph on its first run, measured: the first
``GRPOTrainer.compute_gradients`` (tiny FLUX policy, 2 samples, 3 steps, Retain, Inductor) with
the graphs compiled on first run (the library) against all of them compiled at capture (what the
capture did before: ``StepGraphs.compile()`` right after it). Each run is a fresh process with
an empty Inductor cache; the two alternate for ``--rounds`` rounds. Prints per run the wall and
CPU seconds of the call and each compile's seconds by phase, then min and median per variant.

    OMP_NUM_THREADS=1 .venv/bin/python tools/compile_on_first_run.py [--rounds 2]

Figures: docs/measured.md ("compile on first run")."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _one(variant: str) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import torch

    import leancompile.capture.assemble as assemble
    import leancompile.lean.api as api

    torch.set_num_threads(1)
    seconds: dict = {}
    compile_graph = assemble.compile_graph

    def timed(graph, phase, **kwargs):
        start = time.perf_counter()
        run = compile_graph(graph, phase, **kwargs)
        seconds.setdefault(phase, []).append(round(time.perf_counter() - start, 1))
        return run
    assemble.compile_graph = timed
    if variant == "at_capture":
        capture = assemble.capture_graph

        def compiled_at_capture(*args, **kwargs):
            graphs = capture(*args, **kwargs)
            graphs.compile()
            return graphs
        api.capture_graph = compiled_at_capture

    from models import tiny_flux_policy
    from test_grpo_trainer import mean_latent_reward

    from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer

    policy = tiny_flux_policy(steps=3)
    conditions = policy.example_conditions(2, torch.Generator().manual_seed(1))
    trainer = GRPOTrainer(policy, mean_latent_reward, None,
                          GRPOConfig(group_size=2, compiler="inductor"))
    start, cpu = time.perf_counter(), time.process_time()
    trainer.compute_gradients(conditions, torch.Generator().manual_seed(0), schedule="retain")
    return {"variant": variant, "wall_s": round(time.perf_counter() - start, 1),
            "cpu_s": round(time.process_time() - cpu, 1), "compiles_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=["first_run", "at_capture"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    runs: dict = {"first_run": [], "at_capture": []}
    for _ in range(args.rounds):
        for variant in ("at_capture", "first_run"):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                out = subprocess.run([sys.executable, __file__, "--one", variant], env=env,
                                     check=True, capture_output=True, text=True).stdout
            record = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(record), flush=True)
            runs[variant].append(record)
    for variant, records in runs.items():
        walls = [r["wall_s"] for r in records]
        cpus = [r["cpu_s"] for r in records]
        print(f"{variant:>10}: wall min {min(walls):.1f} s, median {statistics.median(walls):.1f}"
              f" s; cpu min {min(cpus):.1f} s, median {statistics.median(cpus):.1f} s")


if __name__ == "__main__":
    main()
