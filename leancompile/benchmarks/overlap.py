"""``leancompile bench overlap --nproc 2|4``: one tensor+sequence-parallel MLP layer, forward and
backward, compiled without the pass (sequential), with ``overlap="slice"``, ``"flash"`` (ring)
and ``"flash"`` with ``variant="direct"``, timed in one run on gloo; ratios to sequential and
the largest difference of outputs and gradients from sequential's. ``--case attention``: one
TP+SP self-attention layer, the same schemes and ``flash_projection`` (``attention_split=False``:
the attention whole, then Flash-RS on the output projection alone). ``--case ulysses``: one
Ulysses sequence-parallel attention layer (QKV projection, all-to-alls, attention, output
projection; ``--dim`` split into ``--heads`` heads), sequential against ``"flash"`` (query-split
attention).

On a 2-core CPU machine the ranks share the cores and gloo's transfers are memory copies, so no
overlap gain is expected here: the numbers show correctness and the overhead of the decomposed
schedules. The same command on a multi-GPU NCCL machine measures the overlap.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from .overlap_layer import layer_step, mlp_layer

__all__ = ["main", "SCHEMES"]

SCHEMES = {
    "sequential": {},
    "slice": {"overlap": "slice", "chunks": 2},
    "flash": {"overlap": "flash"},
    "direct": {"overlap": "flash", "variant": "direct"},
}


def _ulysses_layer(world, seq, dim, heads):
    """One self-attention layer over a sequence split across the ranks (Ulysses)."""
    from ..integrations.sequence_parallel import ulysses_attention

    torch.manual_seed(0)
    wqkv = (torch.randn(dim, 3 * dim) / dim ** 0.5).requires_grad_()
    wo = (torch.randn(dim, dim) / dim ** 0.5).requires_grad_()
    group = dist.group.WORLD

    def attention(q, k, v):  # [B, S, H, D] in and out
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)

    def layer(x):
        s = x.shape[0]
        q, k, v = (x @ wqkv).view(1, s, 3, heads, dim // heads).unbind(2)
        return ulysses_attention(q, k, v, group, attention).reshape(s, dim) @ wo

    return layer, [wqkv, wo]


def _attention_layer(world, seq, dim, heads):
    """One tensor + sequence parallel self-attention layer (no mask, as in a DiT): gather the
    sequence, this rank's heads of the QKV projection, attention, the row-parallel output
    projection reduce-scattered back to sequence shards."""
    import torch.distributed._functional_collectives as funcol

    torch.manual_seed(0)
    local, hd = heads // world, dim // heads
    wqkv = (torch.randn(dim, 3 * local * hd) / dim ** 0.5).requires_grad_()
    wo = (torch.randn(local * hd, dim) / dim ** 0.5).requires_grad_()
    group = dist.group.WORLD

    def layer(x):
        h = funcol.all_gather_tensor(x, 0, group)
        s = h.shape[0]
        q, k, v = (h @ wqkv).view(1, s, 3, local, hd).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        att = att.transpose(1, 2).reshape(s, local * hd)
        return funcol.reduce_scatter_tensor(att @ wo, "sum", 0, group)

    return layer, [wqkv, wo]


def _worker(rank, world, init, out, cfg):
    import faulthandler

    import leancompile

    faulthandler.enable()  # a crash in a rank prints where it was (see the test's note)

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    case = cfg.get("case", "mlp")
    ulysses = case == "ulysses"
    build = {"ulysses": lambda: _ulysses_layer(world, cfg["seq"], cfg["dim"], cfg["heads"]),
             "attention": lambda: _attention_layer(world, cfg["seq"], cfg["dim"], cfg["heads"]),
             "mlp": lambda: mlp_layer(world, cfg["seq"], cfg["dim"], cfg["hidden"])}
    layer, params = build[case]()
    torch.manual_seed(1 + rank)
    x = torch.randn(cfg["seq"] // world, cfg["dim"], requires_grad=True)
    results, reference = {}, None
    schemes = {k: SCHEMES[k] for k in ("sequential", "flash")} if ulysses else SCHEMES
    if case == "attention":  # query-split attention against Flash-RS on the projection alone
        schemes = {**SCHEMES, "flash_projection": {"overlap": "flash",
                                                   "attention_split": False}}
    for name, options in schemes.items():
        torch._dynamo.reset()
        step = layer_step(layer, params, x, **options)
        values = step()  # compile
        times = []
        for _ in range(cfg["iters"]):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        seconds = torch.tensor([statistics.median(times)])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a layer is as slow as its slowest rank
        if reference is None:
            reference = values
        diff = torch.tensor([max((a - b).abs().max().item() for a, b in zip(values, reference))])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        report = leancompile.last_report()
        sites = sum(len(p.rewritten) for g in report.graphs for p in g.passes
                    if p.name == "flash_overlap")
        results[name] = {"total_s": seconds.item(), "max_abs_diff": diff.item(),
                         "rewritten_sites": sites}
    if rank == 0:
        base = results["sequential"]["total_s"]
        for entry in results.values():
            entry["ratio_to_sequential"] = entry["total_s"] / base
        with open(out, "w") as f:
            json.dump({"config": {**cfg, "nproc": world, "backend": "gloo", "device": "cpu",
                                  "compiler": "aot_eager"}, "schemes": results}, f)
    dist.barrier()  # tear the process group down together
    dist.destroy_process_group()


def run(nproc: int = 2, seq: int = 2048, dim: int = 512, hidden: int = 2048,
        iters: int = 5, *, case: str = "mlp", heads: int = 8) -> dict:
    if seq % nproc or hidden % nproc:
        raise ValueError(f"seq={seq} and hidden={hidden} must be divisible by nproc={nproc}")
    if case in ("ulysses", "attention") and (heads % nproc or dim % heads):
        raise ValueError(f"--case {case}: heads={heads} must be divisible by nproc={nproc} "
                         f"and dim={dim} by heads")
    cfg = {"seq": seq, "dim": dim, "hidden": hidden, "iters": iters, "case": case,
           "heads": heads}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(nproc, os.path.join(tmp, "init"), out, cfg), nprocs=nproc,
                 join=True)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile bench overlap", description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--heads", type=int, default=8, help="--case ulysses: attention heads")
    sim = p.add_argument_group("simulated (leancompile/sim): the block at full size on a "
                               "device profile, no GPU needed")
    sim.add_argument("--simulate", action="store_true",
                     help="simulate the schemes instead of running them on gloo")
    sim.add_argument("--device", default="h200", help="a built-in profile or a JSON file")
    sim.add_argument("--tp", type=int, default=4)
    sim.add_argument("--dp", type=int, default=None,
                     help="--case llama-2d: the FSDP axis of the dp x tp mesh")
    sim.add_argument("--shape", default="32,4096,4096", help="batch,sequence,model_dim")
    sim.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    sim.add_argument("--backward", action="store_true", help="forward and backward")
    sim.add_argument("--slices", default="2,4,8", help="chunks of the slicing baseline")
    sim.add_argument("--case", default="mlp",
                     choices=("mlp", "llama-tp", "llama-2d", "fsdp-mlp", "attention",
                              "ulysses"),
                     help="mlp: the FlashOverlap paper's TP+SP MLP; llama-tp: a Llama block "
                          "under TP+SP; llama-2d: the same block with SimpleFSDP over --dp "
                          "(each weight gathered where it is read; --shape one dp rank's "
                          "batch), exposed communication per mesh axis and each site's "
                          "choice; fsdp-mlp: an MLP with all-gathered weights (--tp is "
                          "then the data-parallel world, --shape one rank's batch); "
                          "attention: a TP+SP self-attention layer, query-split attention "
                          "against Flash-RS on the output projection alone (flash_projection; "
                          "measured or simulated); ulysses: a Ulysses sequence-parallel "
                          "attention layer (measured on gloo only, not simulated)")
    sim.add_argument("--validate", action="store_true",
                     help="calibrate cpu-gloo here, then simulated vs measured per scheme on "
                          "2 and 4 gloo ranks")
    ns = p.parse_args(argv)
    if ns.validate:
        return _validated(ns)
    if (ns.case == "llama-2d") != (ns.dp is not None):
        p.error("--dp goes with --case llama-2d (the FSDP axis of its mesh), and it needs one")
    if ns.simulate:
        if ns.case == "ulysses":
            p.error("--case ulysses is measured on gloo only; the simulator does not model "
                    "all-to-alls yet")
        return _simulated(ns)
    if ns.case not in ("mlp", "ulysses", "attention"):
        p.error(f"--case {ns.case} is simulated only (add --simulate)")
    report = run(ns.nproc, ns.seq, ns.dim, ns.hidden, ns.iters, case=ns.case, heads=ns.heads)
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{'Ulysses' if ns.case == 'ulysses' else 'TP+SP'} attention layer, "
              f"{ns.nproc} ranks (gloo, CPU), seq {ns.seq}, dim {ns.dim}, {ns.heads} heads"
              if ns.case in ("ulysses", "attention") else
              f"TP+SP MLP layer, {ns.nproc} ranks (gloo, CPU), seq {ns.seq}, dim {ns.dim}, "
              f"hidden {ns.hidden}", end="")
        print(f"; forward + backward, median of {ns.iters}")
        print(f"{'scheme':16s} {'seconds':>9s} {'ratio':>7s} {'sites':>6s} {'max |diff|':>11s}")
        for name, e in report["schemes"].items():
            print(f"{name:16s} {e['total_s']:9.4f} {e['ratio_to_sequential']:7.3f} "
                  f"{e['rewritten_sites']:6d} {e['max_abs_diff']:11.3e}")
    return 0


def _validated(ns) -> int:
    from .overlap_validate import validate

    report = validate((2, 4), seq=ns.seq, dim=ns.dim, hidden=ns.hidden,
                      rounds=max(ns.iters, 3))
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"TP+SP MLP layer, seq {ns.seq}, dim {ns.dim}, hidden {ns.hidden}, forward + "
          "backward, aot_eager, gloo on this CPU: simulated on the cpu-gloo profile calibrated "
          "in the same ranks vs measured (min of rounds, slowest rank)")
    for world, entry in report.items():
        prof = entry["profile"]
        print(f"{world} ranks: calibrated fp32 {prof['flops']['float32'] / 1e9:.1f} GFLOP/s, "
              f"memory {prof['memory_bandwidth'] / 1e9:.1f} GB/s, P2P "
              f"{prof['link_bandwidth'] / 1e9:.2f} GB/s + {prof['link_latency'] * 1e6:.0f} us, "
              f"all-gather {prof['collective_bandwidth'] / 1e9:.2f} GB/s, reduce-scatter "
              f"{prof['reduce_bandwidth'] / 1e9:.2f} GB/s, + "
              f"{(prof.get('collective_latency') or prof['link_latency']) * 1e6:.0f} us a ring "
              "step, transfer/compute "
              f"overlap {prof['comm_compute_overlap']:.2f}")
        print(f"  {'scheme':12s} {'simulated ms':>13s} {'measured ms':>12s} {'error':>7s}")
        for name, e in entry["schemes"].items():
            print(f"  {name:12s} {e['simulated_s'] * 1e3:13.2f} {e['measured_s'] * 1e3:12.2f} "
                  f"{e['error']:7.1%}")
    return 0


def _simulated(ns) -> int:
    from ..sim.schemes import simulate_schemes

    try:
        shape = tuple(int(v) for v in ns.shape.split(","))
        slices = tuple(int(v) for v in ns.slices.split(","))
    except ValueError:
        print(f"--shape {ns.shape!r} / --slices {ns.slices!r}: comma-separated integers",
              file=sys.stderr)
        return 2
    if len(shape) != 3:
        print(f"--shape {ns.shape!r}: three integers, batch,sequence,model_dim",
              file=sys.stderr)
        return 2
    try:
        report = simulate_schemes(device=ns.device, tp=ns.tp, shape=shape, dtype=ns.dtype,
                                  backward=ns.backward, slices=slices, case=ns.case, dp=ns.dp)
    except ValueError as err:  # sizes the case cannot split (the values and the rule)
        print(f"leancompile bench overlap: {err}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    cfg = report["config"]
    what = {"mlp": "TP+SP MLP block (hidden 4d)", "llama-tp": "Llama block under TP+SP",
            "fsdp-mlp": "FSDP-style MLP block (weights all-gathered)",
            "attention": "TP+SP self-attention layer (32 heads, no mask)",
            "llama-2d": "Llama block, SimpleFSDP x TP+SP"}[cfg["case"]]
    ranks = f"{cfg['tp']} ranks" if cfg["dp"] is None else \
        f"a {cfg['dp']} x {cfg['tp']} (dp x tp) mesh"
    print(f"{what}, simulated on {cfg['device']}: {ranks}, (b, s, d) = "
          f"{tuple(cfg['shape'])}, {cfg['dtype']}, {' + '.join(cfg['phases'])}")
    print(f"{'scheme':12s} {'total ms':>9s} {'compute':>9s} {'comm':>9s} {'exposed':>9s} "
          f"{'ratio':>6s}")
    for name, e in report["schemes"].items():
        if not e["available"]:
            print(f"{name:12s} {'n/a':>9s}  {e['reason']}")
            continue
        print(f"{name:12s} {e['total_s'] * 1e3:9.3f} {e['compute_s'] * 1e3:9.3f} "
              f"{e['comm_s'] * 1e3:9.3f} {e['exposed_comm_s'] * 1e3:9.3f} "
              f"{e['ratio_to_sequential']:6.3f}")
    if cfg["dp"] is not None:
        print("exposed per axis (ms):  " + "   ".join(
            f"{name} dp {e['exposed_by_axis']['dp'] * 1e3:.3f} tp "
            f"{e['exposed_by_axis']['tp'] * 1e3:.3f}"
            for name, e in report["schemes"].items() if name in ("sequential", "flash")))
        print("flash, per site:")
        for site in report["schemes"]["flash"]["sites"]:
            said = "rewritten" if site["rewritten"] else f"left: {site['reason']}"
            print(f"  {site['phase']:8s} {site['axis'] or '?':3s} {site['site']:18s} "
                  f"{site['node']}: {said}")
    seq = report["schemes"]["sequential"]["exposed_comm_s"]
    flash = report["schemes"]["flash"]["exposed_comm_s"]
    print(f"flash leaves {flash / seq:.2%} of sequential's exposed communication"
          if seq else "sequential exposes no communication")
    return 0


if __name__ == "__main__":
    sys.exit(main())
