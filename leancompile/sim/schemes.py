"""The overlap schemes side by side on a simulated device (``leancompile bench overlap
--simulate``): one block traced at full size (``--case``: ``mlp``, the FlashOverlap paper's
TP+SP MLP, ``fullscale.tp_mlp``; ``llama-tp``, a Llama block under TP+SP; ``llama-2d``, the
same block with FSDP over a second mesh axis, ``fullscale.llama_2d_block``; ``fsdp-mlp``, an
MLP whose weights are all-gathered; ``attention``, a TP+SP self-attention layer), rewritten by
each scheme's options, simulated (``simulate.simulate``). On the 2-D mesh each scheme also
reports its exposed communication per mesh axis and what the pass did at each site (rewritten,
or skipped with the reason).

Schemes: ``sequential`` (no pass), ``slice_<k>`` (the data-slicing baseline, k chunks),
``flash`` (FlashOverlap, ring reduce-scatter), ``direct`` (FlashOverlap, direct reduce-scatter),
``flash_projection`` (``--case attention`` only: ``flash`` with ``attention_split=False``, the
attention run whole before Flash-RS on the output projection), ``async_tp`` (PyTorch's async-TP: the local shard's matmul first while peers' shards are copied
in one by one, partials written straight into their owners' buffers; in this model that is the
flash all-gather with the direct reduce-scatter, with the transfers one-sided: it needs
symmetric memory, so on a device profile without it the scheme is reported unavailable with the
reason, not timed).
"""

from __future__ import annotations

import torch

from .devices import device_profile
from .fullscale import (fake_group, fake_mesh, fsdp_mlp, llama_2d_block, llama_tp_block, rewrite,
                        tp_attention, tp_mlp)
from .graph_facts import group_name
from .simulate import Timeline, exposed_by_site, simulate

__all__ = ["simulate_schemes"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _schemes(slices, case: str = "mlp") -> dict[str, dict]:
    out = {"sequential": {}}
    out.update({f"slice_{k}": {"overlap": "slice", "chunks": k} for k in slices})
    out["async_tp"] = {"overlap": "flash", "variant": "direct"}
    out["flash"] = {"overlap": "flash"}
    out["direct"] = {"overlap": "flash", "variant": "direct"}
    if case == "attention":  # Flash-RS next to the output projection alone
        out["flash_projection"] = {"overlap": "flash", "attention_split": False}
    return out


CASES = {
    "mlp": tp_mlp,            # the FlashOverlap paper's TP+SP MLP block
    "llama-tp": llama_tp_block,  # a Llama block under TP+SP (attention + SwiGLU)
    "fsdp-mlp": fsdp_mlp,     # an MLP block whose weights are all-gathered (FSDP-style)
    "attention": tp_attention,  # TP+SP self-attention (DiT-style, no mask): query split
    "llama-2d": llama_2d_block,  # the Llama block, FSDP over dp x TP+SP over tp
}


def _by_axis(timeline: Timeline, rewritten, traced, axes: dict[str, str]) -> dict[str, float]:
    """Exposed seconds per mesh axis (``axes``: group name -> axis): each wait counted for the
    collective it waits on, a P2P step for the site it replaced (named in the traced graph)."""
    out = {axis: 0.0 for axis in axes.values()}
    for i, (gm, before) in enumerate(zip(rewritten, traced)):
        spans = Timeline(device=timeline.device,
                         spans=[s for s in timeline.spans if s.graph == i])
        nodes = {n.name: n for n in before.graph.nodes}
        for site, seconds in exposed_by_site(spans, gm.graph).items():
            node = nodes.get(site)
            axis = axes.get(group_name(node)) if node is not None else None
            out[axis or "other"] = out.get(axis or "other", 0.0) + seconds
    return out


def simulate_schemes(*, device="h200", tp: int = 4, shape=(32, 4096, 4096), dtype="bf16",
                     backward: bool = False, slices=(2, 4, 8), case: str = "mlp",
                     dp: int | None = None) -> dict:
    """``{"config": ..., "schemes": {name: {"total_s", "compute_s", "comm_s",
    "exposed_comm_s", "peak_memory_bytes", "rewritten", "available", "reason"}}}``;
    ``case="llama-2d"`` takes ``dp`` (the FSDP axis; ``tp`` the TP+SP one, ``shape`` one
    data-parallel rank's batch) and adds per scheme ``"exposed_by_axis"`` (``{"dp", "tp"}``
    seconds) and ``"sites"`` (per phase and site: its axis, rewritten or the reason not)."""
    profile = device_profile(device)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; use one of {sorted(_DTYPES)}")
    if case not in CASES:
        raise ValueError(f"case={case!r}; use one of {sorted(CASES)}")
    if tp < 2:
        raise ValueError(f"tp={tp} must be >= 2 (one rank has nothing to communicate)")
    if (case == "llama-2d") != (dp is not None):
        raise ValueError(f"dp={dp}: the data-parallel size goes with case='llama-2d' (and it "
                         "needs one)")
    phases = ("forward", "backward") if backward else ("forward",)
    results = {}
    mesh = fake_group(tp) if dp is None else fake_mesh(dp, tp)
    with mesh as groups:
        axes = {}
        if dp is None:
            graphs = CASES[case](tp, tuple(shape), dtype=_DTYPES[dtype], backward=backward)
        else:
            dp_group, tp_group = groups
            axes = {dp_group.group_name: "dp", tp_group.group_name: "tp"}
            graphs = llama_2d_block(dp, tp, tuple(shape), dtype=_DTYPES[dtype],
                                    backward=backward, dp_group=dp_group, tp_group=tp_group)
        for name, options in _schemes(slices, case).items():
            if name == "async_tp" and not profile.symmetric_memory:
                results[name] = {
                    "total_s": None, "compute_s": None, "comm_s": None, "exposed_comm_s": None,
                    "available": False,
                    "reason": f"{profile.name} has no symmetric memory (peer-mapped NVLink "
                              "within one host), which PyTorch's async-TP needs"}
                continue
            rewritten, rewrites, sites = [], 0, []
            for phase in phases:
                gm, record = rewrite(graphs[phase], phase, **options)
                rewritten.append(gm)
                done = [r for r in record.passes if r.name == "flash_overlap"]
                rewrites += sum(len(r.rewritten) for r in done)
                nodes = {n.name: n for n in graphs[phase].graph.nodes}
                sites += [{"phase": phase, "site": site.kind, "node": site.node,
                           "axis": axes.get(group_name(nodes[site.node])) if site.node in nodes
                           else None, "rewritten": ok, "reason": site.reason}
                          for r in done for ok, found in ((True, r.rewritten),
                                                          (False, r.skipped))
                          for site in found]
            timeline = simulate(rewritten, profile, world_size=tp)
            results[name] = {"total_s": timeline.total_s, "compute_s": timeline.compute_s,
                             "comm_s": timeline.comm_s,
                             "exposed_comm_s": timeline.exposed_comm_s,
                             "peak_memory_bytes": timeline.peak_memory_bytes,
                             "rewritten": rewrites, "available": True, "reason": ""}
            if axes:
                results[name]["exposed_by_axis"] = _by_axis(
                    timeline, rewritten, [graphs[p] for p in phases], axes)
                results[name]["sites"] = sites
    sequential = results["sequential"]["total_s"]
    for entry in results.values():
        entry["ratio_to_sequential"] = None if entry["total_s"] is None else \
            entry["total_s"] / sequential
    return {"config": {"device": profile.name, "case": case, "tp": tp, "dp": dp,
                       "shape": list(shape),
                       "dtype": dtype,
                       "phases": list(phases), "simulated": True},
            "schemes": results}
