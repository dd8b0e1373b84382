"""The overlap demo: a tensor+sequence-parallel transformer block on 2 ranks (torchrun, gloo,
CPU), trained a few steps compiled without and with ``overlap="flash"``; prints the sites the
pass rewrote in the forward and backward graphs and that the losses agree.

``leancompile demo overlap`` launches ``torchrun --nproc_per_node 2`` on this module;
``leancompile demo overlap --sp`` runs the same comparison on a Ulysses sequence-parallel
diffusers FLUX transformer (``parallelize_ulysses``), whose attentions the pass splits by query.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["main", "Block", "parallelize_block"]


class Block(nn.Module):
    """Pre-norm attention + MLP (a Llama-style block with LayerNorm and GELU for brevity)."""

    def __init__(self, dim: int = 64, head_dim: int = 16, hidden: int = 128,
                 causal: bool = True):
        super().__init__()
        self.head_dim, self.causal = head_dim, causal
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.attn_norm(x)
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


def parallelize_block(block: Block, mesh) -> Block:
    """Megatron TP + sequence parallel: norms on sequence shards, Q/K/V and up column-parallel
    (all-gather of the sequence before), o and down row-parallel (reduce-scatter after)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    col, row = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
    return parallelize_module(block, mesh, {
        "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
        "q": col, "k": col, "v": col, "o": row, "up": col, "down": row})


def _train(block, x, target, backend, steps):
    compiled = torch.compile(block, backend=backend)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        y = compiled(x)
        loss_local = (y - target).square().mean()
        loss = loss_local.detach().clone()
        torch.distributed.all_reduce(loss)
        loss_local.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() / torch.distributed.get_world_size())
    return losses


def _sp_flux():
    """A small random-init FLUX transformer (4 heads), made Ulysses sequence parallel."""
    from diffusers import FluxTransformer2DModel

    from ..integrations.diffusers import parallelize_ulysses

    torch.manual_seed(0)  # the same initial weights on every rank and for both runs
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64,
        axes_dims_rope=[4, 6, 6], guidance_embeds=True)
    parallelize_ulysses(model)
    return model


class _SequenceParallelStep(nn.Module):
    """FLUX's velocity on 8x8 packed latents (64 tokens) and 16 text tokens; every rank passes
    the whole batch and computes 1/N of the tokens."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        g = torch.Generator().manual_seed(1)
        side = 8
        ids = torch.zeros(side * side, 3)
        ids[:, 1] = torch.arange(side).repeat_interleave(side)
        ids[:, 2] = torch.arange(side).repeat(side)
        self.inputs = dict(encoder_hidden_states=torch.randn(1, 16, 64, generator=g),
                           pooled_projections=torch.randn(1, 64, generator=g),
                           timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                           img_ids=ids, txt_ids=torch.zeros(16, 3))

    def forward(self, x):
        return self.model(hidden_states=x, **self.inputs, return_dict=False)[0]


def _train_sp(step, x, target, backend, steps):
    compiled = torch.compile(step, backend=backend)
    optimizer = torch.optim.SGD(step.parameters(), lr=0.05)
    sp = step.model._leancompile_sequence_parallel
    losses = []
    for _ in range(steps):
        loss = (compiled(x) - target).square().mean()  # the same on every rank
        loss.backward()
        sp.sync_grads()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(steps: int = 3, sp: bool = False) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import leancompile

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1 + rank)
    x = torch.randn(2, 32 // world, 64)          # this rank's sequence shard
    target = torch.randn(2, 32 // world, 64)
    if sp:  # every rank the whole batch; the model splits the tokens
        g = torch.Generator().manual_seed(2)
        x, target = torch.randn(1, 64, 16, generator=g), torch.randn(1, 64, 16, generator=g)
    runs, reports = {}, {}
    for name, options in (("without pass", {}), ("overlap=flash", {"overlap": "flash"})):
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same initial weights for both runs
        backend = leancompile.backend(compiler="aot_eager", **options)
        if sp:
            runs[name] = _train_sp(_SequenceParallelStep(_sp_flux()), x, target, backend,
                                   steps)
        else:
            block = parallelize_block(Block(), mesh)
            runs[name] = _train(block, x, target, backend, steps)
        reports[name] = leancompile.last_report()
    ok = all(abs(a - b) <= 1e-5 * max(1.0, abs(b))
             for a, b in zip(runs["overlap=flash"], runs["without pass"]))
    if rank == 0:
        print(f"Ulysses sequence-parallel FLUX (1+1 blocks, 4 heads, 64 image + 16 text "
              f"tokens) on {world} ranks (gloo, CPU)" if sp else
              f"TP+SP transformer block on {world} ranks (gloo, CPU)")
        report = reports["overlap=flash"]
        for record in report.graphs:
            (result,) = [p for p in record.passes if p.name == "flash_overlap"]
            print(f"  {record.name}: {len(result.rewritten)} rewritten "
                  f"({', '.join(s.kind + ' at ' + s.node for s in result.rewritten)})")
            for site in result.skipped:
                print(f"    skipped {site}")
        print(f"{'step':>4s} {'loss without pass':>18s} {'loss overlap=flash':>19s}")
        for i, (a, b) in enumerate(zip(runs["without pass"], runs["overlap=flash"])):
            print(f"{i:4d} {a:18.6f} {b:19.6f}")
        print("losses agree (rel 1e-5):", "yes" if ok else "NO")
    dist.destroy_process_group()
    return 0 if ok else 1


def main(*, nproc: int = 2, sp: bool = False) -> int:
    """Launch torchrun on this module (on CPU, gloo); ``sp``: the sequence-parallel FLUX."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_port=29531", "-m",
           "leancompile.demos.overlap_demo"] + (["--sp"] if sp else [])
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(_worker(sp="--sp" in sys.argv[1:]))
