"""``leancompile bench soak``: many steps in one process, watching what must not grow.

Three runs, each printing its figures:

* ``trainer``: ``GRPOTrainer.step`` on a small FLUX policy, alternating ``retain`` and
  ``reweight``. After every step: the LeanStep's kept activation bytes, gradient-buffer bytes,
  kept calls and per-sample buffers must be back to 0; the number of compiled graphs and the
  trainer's caches must stop growing after the first steps; RSS is sampled.
* ``wrapper``: the FlowGRPO-style loop of ``leancompile.demos.user_loops`` with
  ``lean_compile(policy.velocity, schedule="retain")``, one iteration per round: the same
  checks on the wrapper.
* ``overlap``: the TP+SP layer of ``bench overlap`` compiled with ``overlap="flash"`` on 2 gloo
  ranks, forward + backward per step: no P2P exchange left pending after a step
  (``leancompile.runtime.p2p.pending_exchanges``), graphs constant, RSS sampled.

RSS is reported (first, after warm-up, last; MiB), not asserted: the allocator returns memory
to the system when it likes. The figures that must stay flat are counts and kept bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import torch

__all__ = ["main", "soak"]


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _live(step) -> dict:
    state = step._state
    return {"kept_bytes": state.kept_bytes, "buffer_bytes": state.buffer_bytes,
            "kept_calls": len(state.kept), "indexed_rows": len(state.index),
            "sample_buffers": len(state.sample_grads), "graphs": len(step.graphs)}


def _summary(rows: list[dict], warmup: int) -> dict:
    after = rows[min(warmup, len(rows) - 1):]
    return {
        "steps": len(rows),
        "max_kept_bytes_after_step": max(r["kept_bytes"] for r in rows),
        "max_buffer_bytes_after_step": max(r["buffer_bytes"] for r in rows),
        "max_kept_calls_after_step": max(r["kept_calls"] for r in rows),
        "max_sample_buffers_after_step": max(r["sample_buffers"] for r in rows),
        "graphs_after_warmup": [after[0]["graphs"], after[-1]["graphs"]],
        "rss_mib": [rows[0]["rss_mib"], after[0]["rss_mib"], rows[-1]["rss_mib"]],
    }


def _policy():
    from .grpo import BenchConfig, build_policy

    # one single-stream FLUX block: what is kept and freed per step is the point, not the depth
    return build_policy(BenchConfig(layers=0, single_layers=1, hidden=64, latent=8, steps=3))


def _reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


def soak_trainer(steps: int, warmup: int = 4) -> dict:
    from ..grpo.trainer import GRPOConfig, GRPOTrainer

    policy = _policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4)
    trainer = GRPOTrainer(policy, _reward, optimizer, GRPOConfig(group_size=2, eta=0.9))
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1),
                                           sequence_length=8)
    rows = []
    for k in range(steps):
        schedule = ("retain", "reweight")[k % 2]
        trainer.config = dataclasses.replace(trainer.config, schedule=schedule)
        trainer.step(conditions, torch.Generator().manual_seed(k))
        (lean,) = set(trainer._steps.values())
        rows.append({**_live(lean), "rss_mib": _rss_mib(), "lean_steps": len(trainer._steps),
                     "cost_cache": len(trainer._cost_cache)})
    out = _summary(rows, warmup)
    out["trainer_caches_after_warmup"] = [
        (rows[warmup]["lean_steps"], rows[warmup]["cost_cache"]),
        (rows[-1]["lean_steps"], rows[-1]["cost_cache"])]
    return out


def soak_wrapper(steps: int, warmup: int = 2) -> dict:
    from .. import lean_compile
    from ..demos.user_loops import LoopConfig, flow_grpo_loop

    policy = _policy()
    policy.requires_grad_(True)
    step = lean_compile(policy.velocity, backend="aot_eager", schedule="retain")
    config = LoopConfig(prompts=1, group_size=2, sample_batch=2, train_batch=2, iterations=1)
    rows = []
    for k in range(steps):
        flow_grpo_loop(policy, step, config, seed=k)
        rows.append({**_live(step), "rss_mib": _rss_mib()})
    return _summary(rows, warmup)


def _overlap_worker(rank, world, init, out, steps):
    import torch.distributed as dist

    import leancompile
    from leancompile.runtime.p2p import pending_exchanges

    from .overlap_layer import mlp_layer

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    layer, params = mlp_layer(world, 64, 32, 64)
    compiled = torch.compile(layer, backend=leancompile.backend(compiler="aot_eager",
                                                                overlap="flash"))
    x = torch.randn(64 // world, 32, requires_grad=True)
    rows = []
    for _ in range(steps):
        compiled(x).square().sum().backward()
        x.grad = None
        for p in params:
            p.grad = None
        rows.append({"pending": pending_exchanges(), "rss_mib": _rss_mib(),
                     "reports": len(leancompile.last_report().graphs)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": steps, "max_pending_after_step": max(r["pending"] for r in rows),
                       "graphs": [rows[0]["reports"], rows[-1]["reports"]],
                       "rss_mib": [rows[0]["rss_mib"], rows[min(2, steps - 1)]["rss_mib"],
                                   rows[-1]["rss_mib"]]}, f)
    dist.barrier()
    dist.destroy_process_group()


def soak_overlap(steps: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_overlap_worker, args=(2, os.path.join(tmp, "init"), out, steps), nprocs=2,
                 join=True)
        with open(out) as f:
            return json.load(f)


def soak(steps: int = 200, runs=("trainer", "wrapper", "overlap")) -> dict:
    runners = {"trainer": soak_trainer, "wrapper": soak_wrapper, "overlap": soak_overlap}
    return {name: runners[name](steps) for name in runs}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--runs", default="trainer,wrapper,overlap")
    ns = p.parse_args(argv)
    report = soak(ns.steps, tuple(ns.runs.split(",")))
    for name, figures in report.items():
        print(f"{name}: {json.dumps(figures)}")
    flat = all(
        r.get("max_kept_bytes_after_step", 0) == 0 and r.get("max_buffer_bytes_after_step", 0)
        == 0 and r.get("max_pending_after_step", 0) == 0
        and len(set(map(str, r.get("graphs_after_warmup", r.get("graphs", [0]))))) == 1
        for r in report.values())
    print("kept bytes back to 0 after every step, graph counts flat, no pending P2P:",
          "yes" if flat else "NO")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
