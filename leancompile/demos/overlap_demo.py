"""The overlap demo: a tensor+sequence-parallel transformer block on 2 ranks (torchrun, gloo,
CPU), trained a few steps compiled without and with ``overlap="flash"``; prints the sites the
pass rewrote in the forward and backward graphs and that the losses agree.

``leancompile demo overlap`` launches ``torchrun --nproc_per_node 2`` on this module.
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

    def __init__(self, dim: int = 64, head_dim: int = 16, hidden: int = 128):
        super().__init__()
        self.head_dim = head_dim
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.attn_norm(x)
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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


def _worker(steps: int = 3) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import leancompile

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1 + rank)
    x = torch.randn(2, 32 // world, 64)          # this rank's sequence shard
    target = torch.randn(2, 32 // world, 64)
    runs, reports = {}, {}
    for name, options in (("without pass", {}), ("overlap=flash", {"overlap": "flash"})):
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same initial weights for both runs
        block = parallelize_block(Block(), mesh)
        backend = leancompile.backend(compiler="aot_eager", **options)
        runs[name] = _train(block, x, target, backend, steps)
        reports[name] = leancompile.last_report()
    ok = all(abs(a - b) <= 1e-5 * max(1.0, abs(b))
             for a, b in zip(runs["overlap=flash"], runs["without pass"]))
    if rank == 0:
        print(f"TP+SP transformer block on {world} ranks (gloo, CPU)")
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


def main(*, nproc: int = 2) -> int:
    """Launch torchrun on this module (on CPU, gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_port=29531", "-m",
           "leancompile.demos.overlap_demo"]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(_worker())
