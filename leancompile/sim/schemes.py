"""The overlap schemes side by side on a simulated device (``leancompile bench overlap
--simulate``): one block traced at full size (``--case``: ``mlp``, the FlashOverlap paper's
TP+SP MLP, ``fullscale.tp_mlp``; ``llama-tp``, a Llama block under TP+SP; ``fsdp-mlp``, an MLP
whose weights are all-gathered; ``attention``, a TP+SP self-attention layer), rewritten by each scheme's options, simulated
(``simulate.simulate``).

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
from .fullscale import fake_group, fsdp_mlp, llama_tp_block, rewrite, tp_attention, tp_mlp
from .simulate import simulate

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
}


def simulate_schemes(*, device="h200", tp: int = 4, shape=(32, 4096, 4096), dtype="bf16",
                     backward: bool = False, slices=(2, 4, 8), case: str = "mlp") -> dict:
    """``{"config": ..., "schemes": {name: {"total_s", "compute_s", "comm_s",
    "exposed_comm_s", "peak_memory_bytes", "rewritten", "available", "reason"}}}``."""
    profile = device_profile(device)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; use one of {sorted(_DTYPES)}")
    if case not in CASES:
        raise ValueError(f"case={case!r}; use one of {sorted(CASES)}")
    if tp < 2:
        raise ValueError(f"tp={tp} must be >= 2 (one rank has nothing to communicate)")
    phases = ("forward", "backward") if backward else ("forward",)
    results = {}
    with fake_group(tp):
        graphs = CASES[case](tp, tuple(shape), dtype=_DTYPES[dtype], backward=backward)
        for name, options in _schemes(slices, case).items():
            if name == "async_tp" and not profile.symmetric_memory:
                results[name] = {
                    "total_s": None, "compute_s": None, "comm_s": None, "exposed_comm_s": None,
                    "available": False,
                    "reason": f"{profile.name} has no symmetric memory (peer-mapped NVLink "
                              "within one host), which PyTorch's async-TP needs"}
                continue
            rewritten, rewrites = [], 0
            for phase in phases:
                gm, record = rewrite(graphs[phase], phase, **options)
                rewritten.append(gm)
                rewrites += sum(len(r.rewritten) for r in record.passes
                                if r.name == "flash_overlap")
            timeline = simulate(rewritten, profile, world_size=tp)
            results[name] = {"total_s": timeline.total_s, "compute_s": timeline.compute_s,
                             "comm_s": timeline.comm_s,
                             "exposed_comm_s": timeline.exposed_comm_s,
                             "peak_memory_bytes": timeline.peak_memory_bytes,
                             "rewritten": rewrites, "available": True, "reason": ""}
    sequential = results["sequential"]["total_s"]
    for entry in results.values():
        entry["ratio_to_sequential"] = None if entry["total_s"] is None else \
            entry["total_s"] / sequential
    return {"config": {"device": profile.name, "case": case, "tp": tp, "shape": list(shape),
                       "dtype": dtype,
                       "phases": list(phases), "simulated": True},
            "schemes": results}
