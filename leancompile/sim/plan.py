"""``leancompile plan grpo``: predicted step time and memory of the LeanGRPO schedules for a real
diffusion transformer at full size, on GPUs this machine does not have.

The model's graphs come from the model itself: the diffusers transformer is built on the meta
device (no weights), traced with leancompile's tracing backend (``fullscale.trace_graphs``) in
three shapes, with one block of each kind and with one more block of each kind, and its
per-call time, saved bytes and working memory are extrapolated to the real block counts (blocks
of one kind are identical, so their cost is linear in their count). Each graph runs on the
device model (``simulate.py``). Then, per rank, for ``steps`` denoising steps of which ``K =
round(fraction * steps)`` are trained, ``samples_per_rank`` samples per call, parameters and
gradients sharded over ``gpus`` ranks (FSDP: a forward call gathers the parameters, a backward
reduce-scatters the gradients, each overlapping its compute layer by layer, so a call takes
the longer of the two):

==========  =================================================  ====================================
schedule    time                                               memory beyond weights and optimizer
==========  =================================================  ====================================
recompute   S inference calls + K (forward + backward)         one training call's activations
retain      (S-K) inference + K forward + K backward           K calls' saved activations
reweight    (S-K) inference + K (forward + backward), the      one full gradient per sample in
            backwards without reduction, one at the end        flight + one call's activations
==========  =================================================  ====================================

Activation checkpointing per block is on by default (``--no-checkpointing``): every block
keeps only its input, and every backward runs its block's forward again (Retain then keeps the
block inputs of each trained call, and saves the update's separate forward, not that one).
``--lora RANK``: the base weights are frozen, the trainable parameters are LoRA adapters of
rank RANK on the attention projections (their count from the model's own linear layers), and the
backward computes input gradients only (the adapters' own matmuls, rank << width, are left out).
Memory: weights in bf16 sharded, AdamW moments in fp32 sharded, gradients in bf16 sharded;
Reweight's per-sample buffers in bf16, full size (unreduced, rank-local); 10% of the device kept
free for the allocator and workspaces. Not modelled: the text encoders and VAE, the reward
model, activation checkpointing.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

from .devices import device_profile
from .fullscale import trace_graphs
from .graph_facts import FREE, op_name, tensor_bytes, tensors_of
from .simulate import simulate

__all__ = ["MODELS", "PAPER_SPEEDUPS", "GRPOPlanConfig", "ModelCosts", "model_costs",
           "plan_grpo"]

# The LeanGRPO paper's measured end-to-end speed-ups over recompute (8x RTX A6000).
PAPER_SPEEDUPS = {
    ("flux-dev", False): {"retain": "1.18-1.29x", "reweight": "1.44-1.81x"},
    ("flux-dev", True): {"retain": "1.27-1.42x", "reweight": "1.26-1.43x"},
}


def _flux(counts):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=counts[0], num_single_layers=counts[1],
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])


def _flux_inputs(cfg, batch, dtype):
    tokens = (cfg.resolution // 16) ** 2
    kw = dict(device="meta", dtype=dtype)
    ids = dict(img_ids=torch.empty(tokens, 3, device="meta"),
               txt_ids=torch.empty(512, 3, device="meta"))
    args = (torch.empty(batch, tokens, 64, **kw), torch.empty(batch, 512, 4096, **kw),
            torch.empty(batch, 768, **kw), torch.empty(batch, **kw), torch.empty(batch, **kw))

    def call(model, hs, enc, pooled, t, guidance):
        return model(hidden_states=hs, encoder_hidden_states=enc, pooled_projections=pooled,
                     timestep=t, guidance=guidance, return_dict=False, **ids)[0]
    return args, call, tokens


def _sd3(counts):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, num_layers=counts[0],
        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
        caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(min(counts[0], 13))),
        qk_norm="rms_norm")


def _sd3_inputs(cfg, batch, dtype):
    side = cfg.resolution // 8
    kw = dict(device="meta", dtype=dtype)
    args = (torch.empty(batch, 16, side, side, **kw), torch.empty(batch, 333, 4096, **kw),
            torch.empty(batch, 2048, **kw), torch.empty(batch, **kw))

    def call(model, x, enc, pooled, t):
        return model(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled,
                     timestep=t, return_dict=False)[0]
    return args, call, (side // 2) ** 2


def _wan(counts):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=counts[0],
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)


def _wan_inputs(cfg, batch, dtype):
    side = cfg.resolution // 8
    frames = (cfg.frames - 1) // 4 + 1
    kw = dict(device="meta", dtype=dtype)
    args = (torch.empty(batch, 16, frames, side, side, **kw),
            torch.empty(batch, 512, 4096, **kw), torch.empty(batch, **kw))

    def call(model, x, enc, t):
        return model(hidden_states=x, encoder_hidden_states=enc, timestep=t,
                     return_dict=False)[0]
    return args, call, frames * (side // 2) ** 2


MODELS = {
    # name: (builder(block counts), inputs(cfg, batch, dtype), real block counts, LoRA targets,
    #        (text tokens that travel through the blocks, model width))
    "flux-dev": (_flux, _flux_inputs, (19, 38), ("to_q", "to_k", "to_v", "to_out.0"),
                 (512, 3072)),
    "sd3.5-m": (_sd3, _sd3_inputs, (24,), ("to_q", "to_k", "to_v", "to_out.0"), (333, 1536)),
    "wan-1.3b": (_wan, _wan_inputs, (30,), ("to_q", "to_k", "to_v", "to_out.0"), (0, 1536)),
}


@dataclass(frozen=True, kw_only=True)
class GRPOPlanConfig:
    model: str = "flux-dev"
    resolution: int = 720
    """Image side in pixels (square)."""
    frames: int = 33
    """Video frames (``wan-1.3b``)."""
    steps: int = 16
    fraction: float = 0.6
    """Share of the denoising steps trained (FlowGRPO's ``timestep_fraction``)."""
    samples_per_rank: int = 2
    gpus: int = 8
    device: str = "a6000"
    lora: int | None = None
    """LoRA rank (None: full fine-tuning)."""
    checkpointing: bool = True
    """Activation checkpointing per transformer block (what FlowGRPO and DanceGRPO train FLUX
    and Wan with): a block keeps its input, its backward runs its forward again."""

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}; use one of {sorted(MODELS)}")
        if self.resolution % 16:
            raise ValueError(f"resolution={self.resolution} must be a multiple of 16")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction={self.fraction} must be in (0, 1]")
        for name in ("steps", "samples_per_rank", "gpus", "frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.lora is not None and self.lora < 1:
            raise ValueError(f"lora={self.lora} must be a rank >= 1 (or None)")

    @property
    def trained_steps(self) -> int:
        return max(1, round(self.fraction * self.steps))


@dataclass(frozen=True)
class ModelCosts:
    """One call of the model on ``samples_per_rank`` samples, on one device."""

    params: int
    trainable: int
    tokens: int
    inference_s: float
    forward_s: float
    backward_s: float
    saved_bytes: int
    """What the training forward keeps for the backward (activations, not weights)."""
    call_peak_bytes: int
    """Peak live memory of one training forward beyond the weights (its saved activations
    included)."""


def _saved_bytes(forward) -> int:
    """Bytes of the forward graph's saved outputs that are new tensors (not the inputs or
    views of them)."""
    base = {}
    for node in forward.graph.nodes:
        if node.op == "call_function" and op_name(node) in FREE and node.all_input_nodes:
            base[node] = base.get(node.all_input_nodes[0], node.all_input_nodes[0])
    output = next(n for n in forward.graph.nodes if n.op == "output")
    saved = [o for o in output.args[0][1:] if hasattr(o, "op")]
    seen, total = set(), 0
    for node in saved:
        root = base.get(node, node)
        if root.op == "placeholder" or root in seen:
            continue
        seen.add(root)
        total += sum(map(tensor_bytes, tensors_of(node.meta.get("val"))))
    return total


def _trace(cfg, counts, batch, profile):
    """(inference s, forward s, backward s, saved bytes, call peak bytes, tokens) for one
    model with ``counts`` blocks."""
    build, inputs = MODELS[cfg.model][:2]
    dtype = torch.bfloat16
    with torch.device("meta"):
        model = build(counts).to(dtype)
    model.requires_grad_(cfg.lora is None)
    args, call, tokens = inputs(cfg, batch, dtype)
    if cfg.lora is not None:
        args = (args[0].requires_grad_(),) + args[1:]

    def fn(*a):
        return call(model, *a)

    inference = trace_graphs(fn, *args, inference=True)["forward"]
    train = trace_graphs(fn, *args)
    t_inf = simulate(inference, profile).total_s
    t_fw = simulate(train["forward"], profile)
    t_bw = simulate(train["backward"], profile)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # The training forward's peak (its saved activations included); the backward frees them
    # as it goes and, under FSDP, reduce-scatters each layer's gradients as they appear.
    return (t_inf, t_fw.total_s, t_bw.total_s, _saved_bytes(train["forward"]),
            max(t_fw.peak_memory_bytes - weights, 0), tokens)


def _count(cfg) -> tuple[int, int]:
    """(parameters, trainable parameters) of the full-size model."""
    build, _, counts, targets, _ = MODELS[cfg.model]
    with torch.device("meta"):
        model = build(counts)
    params = sum(p.numel() for p in model.parameters())
    if cfg.lora is None:
        return params, params
    lora = sum(cfg.lora * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name.endswith(t) for t in targets))
    return params, lora


def model_costs(cfg: GRPOPlanConfig) -> ModelCosts:
    """Per-call costs at full size, extrapolated from one-block and two-block traces."""
    profile = device_profile(cfg.device)
    counts, (text, width) = MODELS[cfg.model][2], MODELS[cfg.model][4]
    ones = (1,) * len(counts)
    base = _trace(cfg, ones, cfg.samples_per_rank, profile)
    total = list(base)
    per_block = []
    for i, n in enumerate(counts):
        more = tuple(2 if j == i else 1 for j in range(len(counts)))
        extra = _trace(cfg, more, cfg.samples_per_rank, profile)
        per_block.append([e - b for e, b in zip(extra, base)])
        for k in range(5):
            total[k] += (n - 1) * per_block[-1][k]
    params, trainable = _count(cfg)
    inference_s, forward_s, backward_s, saved, peak = total[:5]
    if cfg.checkpointing:
        # Each block keeps only its input; the backward runs each block's forward again and
        # holds one block's activations at a time.
        block_io = cfg.samples_per_rank * (base[5] + text) * width * 2
        largest = max(b[3] for b in per_block)
        saved = sum(counts) * block_io + (base[3] - sum(b[3] for b in per_block))
        peak = saved + largest
        backward_s += forward_s
    return ModelCosts(params=params, trainable=trainable, tokens=base[5],
                      inference_s=inference_s, forward_s=forward_s, backward_s=backward_s,
                      saved_bytes=int(saved), call_peak_bytes=int(peak))


def plan_grpo(cfg: GRPOPlanConfig, costs: ModelCosts | None = None, *,
              comm_overlap: float | None = None) -> dict:
    """``{"config", "costs", "schedules": {name: {"step_s", "memory_bytes", "fits",
    "speedup", "paper"}}, "auto"}`` (module docstring). ``comm_overlap``: the fraction of a
    call's parameter gathers and gradient reductions that runs beside its compute (default:
    the device profile's ``comm_compute_overlap``)."""
    profile = device_profile(cfg.device)
    costs = model_costs(cfg) if costs is None else costs
    g, S, K, n = cfg.gpus, cfg.steps, cfg.trained_steps, cfg.samples_per_rank
    weight_bytes = costs.params * 2
    grad_bytes = costs.trainable * 2
    share = (g - 1) / g

    def collective(nbytes):
        return share * nbytes / profile.bus_bandwidth if g > 1 else 0.0

    gather = collective(weight_bytes)                        # every call's parameters
    reduce = collective(grad_bytes)                          # every reducing backward
    overlap = profile.comm_compute_overlap if comm_overlap is None else comm_overlap

    def call(compute, comm):
        # FSDP prefetches the next layer's gather / reduces the last one's gradients beside
        # the compute; the part of a transfer that cannot overlap adds to the compute (and,
        # where the two slow each other down, overlap < 0, the interference too).
        return max(compute + (1 - max(overlap, 0.0)) * comm
                   + max(-overlap, 0.0) * min(comm, compute), comm)

    inference = call(costs.inference_s, gather)
    forward = call(costs.forward_s, gather)
    backward = call(costs.backward_s, reduce)
    resident = weight_bytes / g + costs.trainable * 8 / g + grad_bytes / g
    schedules = {
        "recompute": (S * inference + K * (forward + backward),
                      resident + costs.call_peak_bytes),
        "retain": ((S - K) * inference + K * forward + K * backward,
                   resident + K * costs.saved_bytes + costs.call_peak_bytes),
        "reweight": ((S - K) * inference + K * (forward + call(costs.backward_s, 0.0)) + reduce,
                     resident + n * grad_bytes + costs.call_peak_bytes),
    }
    room = 0.9 * profile.memory_bytes
    base = schedules["recompute"][0]
    paper = PAPER_SPEEDUPS.get((cfg.model, cfg.lora is not None), {})
    out = {name: {"step_s": t, "memory_bytes": int(m), "fits": m <= room,
                  "speedup": base / t, "paper": paper.get(name)}
           for name, (t, m) in schedules.items()}
    fitting = [name for name in ("reweight", "retain", "recompute") if out[name]["fits"]]
    auto = min(fitting, key=lambda name: out[name]["step_s"]) if fitting else None
    return {"config": dataclasses.asdict(cfg), "device": profile.name,
            "costs": dataclasses.asdict(costs), "trained_steps": K,
            "comm_overlap": overlap, "memory_room_bytes": int(room), "schedules": out,
            "auto": auto}


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="leancompile plan grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev", choices=sorted(MODELS))
    p.add_argument("--resolution", type=int, default=720)
    p.add_argument("--frames", type=int, default=33, help="video frames (wan-1.3b)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--fraction", type=float, default=0.6)
    p.add_argument("--samples-per-rank", type=int, default=2)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--device", default="a6000", help="a built-in profile or a JSON file")
    p.add_argument("--lora", type=int, default=None, metavar="RANK")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--comm-overlap", type=float, default=None,
                   help="fraction of FSDP's gathers/reductions hidden behind compute "
                        "(default: the profile's)")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    try:
        cfg = GRPOPlanConfig(model=ns.model, resolution=ns.resolution, frames=ns.frames,
                             steps=ns.steps, fraction=ns.fraction,
                             samples_per_rank=ns.samples_per_rank, gpus=ns.gpus,
                             device=ns.device, lora=ns.lora,
                             checkpointing=not ns.no_checkpointing)
        device_profile(cfg.device)
    except ValueError as e:
        print(f"leancompile plan grpo: {e}", file=sys.stderr)
        return 2
    report = plan_grpo(cfg, comm_overlap=ns.comm_overlap)
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    c = report["costs"]
    mode = f"LoRA rank {cfg.lora}" if cfg.lora else "full fine-tuning"
    print(f"{cfg.model} {mode}, {cfg.resolution}px ({c['tokens']} tokens), {cfg.steps} steps, "
          f"{report['trained_steps']} trained, {cfg.samples_per_rank} samples per rank, "
          f"{cfg.gpus} x {report['device']} (FSDP), activation checkpointing "
          f"{'on' if cfg.checkpointing else 'off'}")
    print(f"per call: inference {c['inference_s']:.3f} s, forward {c['forward_s']:.3f} s, "
          f"backward {c['backward_s']:.3f} s, saved {c['saved_bytes'] / 2**30:.2f} GiB; "
          f"{c['params'] / 1e9:.2f} B parameters, {c['trainable'] / 1e6:.1f} M trainable")
    print(f"{'schedule':10s} {'step s':>8s} {'speed-up':>9s} {'memory GiB':>11s} "
          f"{'fits':>5s}  paper")
    for name, e in report["schedules"].items():
        print(f"{name:10s} {e['step_s']:8.2f} {e['speedup']:8.2f}x "
              f"{e['memory_bytes'] / 2**30:11.1f} {'yes' if e['fits'] else 'no':>5s}  "
              f"{e['paper'] or ''}")
    room = report["memory_room_bytes"] / 2**30
    print(f"(room: {room:.1f} GiB, 90% of the device); auto: {report['auto'] or 'nothing fits'}")
    return 0
