"""``leancompile bench overlap --validate``: the simulator against measurements on this machine.

For 2 and 4 gloo ranks: compile each scheme (sequential, slice, flash, direct) of the TP+SP MLP
layer of ``bench overlap`` (forward + backward, ``aot_eager``), calibrate ``cpu-gloo`` inside
the ranks at the schemes' own matmul shapes, activation size and message size
(``calibrate.py``), time the compiled layers in interleaved rounds (minimum over rounds of the
slowest rank) and simulate the same post-pass graphs on the calibrated profile. Prints both
and the relative error per scheme.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["validate"]

SCHEMES = {
    "sequential": {},
    "slice_2": {"overlap": "slice", "chunks": 2},
    "flash": {"overlap": "flash"},
    "direct": {"overlap": "flash", "variant": "direct"},
}


def _worker(rank, world, init, out, cfg):
    import leancompile

    from ..sim.calibrate import calibrate_cpu_gloo, workload
    from ..sim.simulate import simulate
    from .overlap_layer import layer_step, mlp_layer

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    layer, params = mlp_layer(world, cfg["seq"], cfg["dim"], cfg["hidden"])
    torch.manual_seed(1 + rank)
    x = torch.randn(cfg["seq"] // world, cfg["dim"], requires_grad=True)

    # Every scheme compiled first (each its own backend, so Dynamo keeps one entry per
    # scheme); the graphs that ran are what the compile's report holds after the passes.
    steps, reports = {}, {}
    for name, options in SCHEMES.items():
        steps[name] = layer_step(layer, params, x, **options)
        steps[name]()
        reports[name] = leancompile.last_report()
    # Calibrated at the schemes' own matmul shapes, activation size and largest message.
    profile = calibrate_cpu_gloo(workload=workload(list(reports.values())))
    times = {name: [] for name in SCHEMES}
    for _ in range(cfg["rounds"]):  # interleaved: a slower spell of the machine hits all
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a layer is as slow as its slowest rank
            times[name].append(t.item())
    results = {}
    for name in SCHEMES:
        predicted = simulate(reports[name], profile, world_size=world)
        measured = min(times[name])
        results[name] = {"simulated_s": predicted.total_s, "measured_s": measured,
                         "error": abs(predicted.total_s - measured) / measured,
                         "simulated_exposed_s": predicted.exposed_comm_s,
                         "measured_median_s": sorted(times[name])[len(times[name]) // 2]}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"profile": json.loads(profile.to_json()), "schemes": results}, f)
    dist.barrier()
    dist.destroy_process_group()


def validate(worlds=(2, 4), *, seq: int = 2048, dim: int = 512, hidden: int = 2048,
             rounds: int = 7) -> dict:
    """``{world: {"profile": ..., "schemes": {name: {"simulated_s", "measured_s", "error",
    ...}}}}``."""
    out = {}
    for world in worlds:
        cfg = {"seq": seq, "dim": dim, "hidden": hidden, "rounds": rounds}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), path, cfg),
                     nprocs=world, join=True)
            with open(path) as f:
                out[world] = json.load(f)
    return out
