"""``leancompile trace overlap|grpo --out DIR``: one step as Chrome-trace JSON (open in Perfetto or
``chrome://tracing``) and as a PNG timeline, measured here and simulated.

``overlap``: the TP+SP MLP layer of ``bench overlap`` compiled with ``overlap="flash"`` on 2 gloo
ranks, forward + backward. Measured: rank 0 under ``torch.profiler`` (``overlap_measured.json``).
Simulated: the graphs that ran, on the ``cpu-gloo`` profile calibrated in the same ranks
(``overlap_simulated.json``), and the FlashOverlap paper's case at full size on ``--device``
(``overlap_<device>.json``). ``overlap.png``: the three timelines.

``grpo``: one ``GRPOTrainer`` step of the tiny FLUX policy (``make demo``'s) under
``torch.profiler``, its phases marked by the trainer (``leancompile.rollout``, ``.reward``,
``.update``, ``.sync``, ``.optimizer``; the compiled graphs inside them: the kept forwards and
the backwards) (``grpo_measured.json``), and the step ``leancompile plan grpo`` predicts for
``--model`` on ``--device`` laid out as phases (``grpo_simulated.json``). ``grpo.png``: both.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main", "trace_overlap", "trace_grpo"]

_PHASES = ("leancompile.rollout", "leancompile.reward", "leancompile.update",
           "leancompile.sync", "leancompile.optimizer")


def _events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def _measured_rows(trace: dict, rows: dict[str, callable]) -> dict[str, list]:
    """{row: [(start_s, duration_s)]} of a torch.profiler trace's events, picked by ``rows``'
    predicates on the event name, times from the first event."""
    events = _events(trace)
    t0 = min(float(e["ts"]) for e in events) if events else 0.0
    out = {name: [] for name in rows}
    for e in events:
        for name, pick in rows.items():
            if pick(e["name"]):
                out[name].append(((float(e["ts"]) - t0) / 1e6, float(e.get("dur", 0)) / 1e6))
                break
    return out


def _simulated_rows(timeline) -> dict[str, list]:
    rows = {"compute": [], "communication": [], "waiting": []}
    key = {"compute": "compute", "comm": "communication", "wait": "waiting"}
    for s in timeline.spans:
        rows[key[s.stream]].append((s.start, s.end - s.start))
    return rows


def _png(path: Path, panels: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple", "tab:brown",
               "tab:olive", "tab:cyan", "tab:pink", "tab:gray"]
    colors = {}  # one colour per row name across the panels
    for _, rows in panels:
        for name in rows:
            colors.setdefault(name, palette[len(colors) % len(palette)])
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.4 + 0.5 * sum(
        len(rows) for _, rows in panels)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels):
        names = list(rows)
        end = max((s + d for spans in rows.values() for s, d in spans), default=0.0)
        scale, unit = (1.0, "s") if end > 10 else (1e3, "ms")
        for i, name in enumerate(names):
            spans = rows[name]
            ax.broken_barh([(s * scale, d * scale) for s, d in spans], (i - 0.4, 0.8),
                           color=colors[name])
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel(unit)
        ax.set_title(title, fontsize=10, loc="left")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# overlap


def _overlap_worker(rank, world, init, out, cfg):
    import leancompile

    from ..sim.calibrate import calibrate_cpu_gloo, workload
    from ..sim.simulate import simulate
    from .overlap_layer import layer_step, mlp_layer

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    layer, params = mlp_layer(world, cfg["seq"], cfg["dim"], cfg["hidden"])
    x = torch.randn(cfg["seq"] // world, cfg["dim"], requires_grad=True)
    step = layer_step(layer, params, x, overlap="flash")
    step()
    report = leancompile.last_report()
    profile = calibrate_cpu_gloo(repeats=3, workload=workload(report))
    step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    dist.barrier()
    if rank == 0:
        prof.export_chrome_trace(os.path.join(out, "overlap_measured.json"))
        timeline = simulate(report, profile, world_size=world)
        with open(os.path.join(out, "overlap_simulated.json"), "w") as f:
            json.dump(timeline.to_chrome_trace(), f)
    dist.barrier()
    dist.destroy_process_group()


def trace_overlap(out, *, device: str = "h200", seq: int = 2048, dim: int = 512,
                  hidden: int = 2048) -> list[Path]:
    """Write the overlap traces and PNG into ``out``; returns the files."""
    from ..sim.fullscale import fake_group, rewrite, tp_mlp
    from ..sim.simulate import simulate

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"seq": seq, "dim": dim, "hidden": hidden}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_overlap_worker, args=(2, os.path.join(tmp, "init"), str(out), cfg),
                 nprocs=2, join=True)
    with fake_group(4):
        graphs = tp_mlp(4, (32, 4096, 4096))
        paper = simulate(rewrite(graphs["forward"], "forward", overlap="flash")[0], device,
                         world_size=4)
    paper_path = out / f"overlap_{paper.device}.json"
    paper_path.write_text(json.dumps(paper.to_chrome_trace()))
    measured = json.loads((out / "overlap_measured.json").read_text())
    simulated = json.loads((out / "overlap_simulated.json").read_text())

    def is_comm(name):
        return any(k in name for k in ("p2p_start", "all_gather", "reduce_scatter",
                                       "c10d::", "gloo"))

    def is_wait(name):
        return "wait" in name

    def is_compute(name):
        return name.startswith("aten::") and not is_comm(name) and not is_wait(name)

    rows = {"compute": is_compute, "communication": is_comm, "waiting": is_wait}
    sim_rows = {"compute": [], "communication": [], "waiting": []}
    for e in _events(simulated):
        key = {"compute": "compute", "comm": "communication", "wait": "waiting"}[e["cat"]]
        sim_rows[key].append((e["ts"] / 1e6, e["dur"] / 1e6))
    png = out / "overlap.png"
    _png(png, [("measured: rank 0 of 2 (gloo, this CPU), flash, forward + backward",
                _measured_rows(measured, rows)),
               ("simulated: the same graphs on cpu-gloo calibrated here", sim_rows),
               (f"simulated: TP=4 (32, 4096, 4096) forward, flash, on {paper.device}",
                _simulated_rows(paper))])
    return [out / "overlap_measured.json", out / "overlap_simulated.json", paper_path, png]


# ----------------------------------------------------------------------------------------------
# grpo


def _plan_trace(report: dict) -> tuple[dict, dict]:
    """The predicted step of ``plan_grpo``'s chosen (or retain's) schedule as phases: Chrome
    trace and PNG rows."""
    cfg, costs = report["config"], report["costs"]
    schedule = report["auto"] or "recompute"
    S, K = cfg["steps"], report["trained_steps"]
    inf, fw, bw = costs["inference_s"], costs["forward_s"], costs["backward_s"]
    rows = {"inference graph": [], "kept forward": [], "update forward": [], "backward": []}
    t = 0.0
    for k in range(S):
        trained = k < K and schedule != "recompute"
        name, dur = ("kept forward", fw) if trained else ("inference graph", inf)
        rows[name].append((t, dur))
        t += dur
        if trained and schedule == "reweight":
            rows["backward"].append((t, bw))
            t += bw
    for _ in range(K if schedule != "reweight" else 0):
        if schedule == "recompute":
            rows["update forward"].append((t, fw))
            t += fw
        rows["backward"].append((t, bw))
        t += bw
    events = [{"name": name, "cat": "phase", "ph": "X", "pid": 0, "tid": 1, "ts": s * 1e6,
               "dur": d * 1e6, "args": {"schedule": schedule}}
              for name, spans in rows.items() for s, d in spans]
    return {"traceEvents": events, "otherData": {"simulated": True, **cfg,
                                                 "schedule": schedule}}, rows


def trace_grpo(out, *, model: str = "flux-dev", device: str = "a6000",
               plan: dict | None = None) -> list[Path]:
    """Write the GRPO traces and PNG into ``out``; ``plan``: a ``plan_grpo`` report to lay out
    instead of planning ``model`` on ``device``."""
    from ..demos.grpo_demo import TARGET, build_demo
    from ..grpo.rewards import TargetColorReward, decoded
    from ..grpo.trainer import GRPOConfig, GRPOTrainer
    from ..sim.plan import GRPOPlanConfig, plan_grpo

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    policy, vae = build_demo()
    reward = decoded(TargetColorReward(target=TARGET), vae=vae,
                     to_vae_latents=policy.to_vae_latents)
    conditions = policy.example_conditions(2, torch.Generator().manual_seed(1),
                                           sequence_length=16)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],
                                  lr=1e-4)
    trainer = GRPOTrainer(policy, reward, optimizer,
                          GRPOConfig(group_size=4, schedule="retain", compiler="aot_eager"))
    trainer.step(conditions, torch.Generator().manual_seed(0))  # compile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.step(conditions, torch.Generator().manual_seed(1))
    measured_path = out / "grpo_measured.json"
    prof.export_chrome_trace(str(measured_path))
    measured = json.loads(measured_path.read_text())
    rows = {phase.split(".")[1]: (lambda name, phase=phase: name == phase) for phase in _PHASES}
    rows["inference graph"] = lambda name: name == "leancompile.inference_graph"
    rows["kept forward"] = lambda name: name == "leancompile.forward_graph"
    rows["backward"] = lambda name: name == "leancompile.backward_graph"
    report = plan_grpo(GRPOPlanConfig(model=model, device=device)) if plan is None else plan
    simulated, sim_rows = _plan_trace(report)
    simulated_path = out / "grpo_simulated.json"
    simulated_path.write_text(json.dumps(simulated))
    png = out / "grpo.png"
    _png(png, [("measured: one GRPOTrainer step, tiny FLUX, retain, aot_eager (this CPU)",
                _measured_rows(measured, rows)),
               (f"simulated: {model} {report['config']['resolution']}px on "
                f"{report['config']['gpus']} x {report['device']}, {report['auto']} "
                f"(leancompile plan grpo)", sim_rows)])
    return [measured_path, simulated_path, png]


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("overlap", "grpo"))
    p.add_argument("--out", default="leancompile-out/traces")
    p.add_argument("--device", default=None, help="profile of the simulated trace "
                   "(overlap: h200, grpo: a6000)")
    p.add_argument("--model", default="flux-dev", help="grpo: the model plan grpo simulates")
    ns = p.parse_args(argv)
    if ns.what == "overlap":
        files = trace_overlap(ns.out, device=ns.device or "h200")
    else:
        files = trace_grpo(ns.out, model=ns.model, device=ns.device or "a6000")
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
