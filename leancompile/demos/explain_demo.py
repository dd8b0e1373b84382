"""The explain demo: a small pre-norm transformer block, traced, explained and compiled.

1. ``explain`` shows the forward and backward graphs before and after every pass (no compute)
   and writes the report with an HTML side-by-side diff.
2. The block is compiled with ``backend=leancompile.backend()`` (Inductor) and one training
   step is checked against plain eager autograd: loss and every parameter gradient.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import leancompile

__all__ = ["Block", "example_args", "main"]


class Block(nn.Module):
    """Pre-norm attention + MLP block (Llama-like shapes, LayerNorm for brevity)."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def example_args(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 64, generator=generator),)


def main(*, out: str = "leancompile-out") -> int:
    torch.manual_seed(0)
    block = Block()
    (x,) = example_args()

    print("== 1. explain: graphs before/after each pass (traced, nothing computed)")
    start = time.perf_counter()
    report = leancompile.explain(block, x)
    print(report)
    page = report.save(Path(out) / "explain")
    print(f"explain took {time.perf_counter() - start:.1f} s; wrote {page}\n")

    print("== 2. one training step, compiled (leancompile backend, Inductor) vs eager")
    reference = {}
    loss_eager = block(x).square().mean()
    loss_eager.backward()
    reference = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    start = time.perf_counter()
    compiled = torch.compile(block, backend=leancompile.backend())
    loss = compiled(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - start
    worst = max(((p.grad - reference[n]).abs().max().item(), n)
                for n, p in block.named_parameters())
    print(f"compile + first step: {seconds:.1f} s")
    print(f"loss eager {loss_eager.item():.6f}  compiled {loss.item():.6f}  "
          f"|diff| {abs(loss_eager.item() - loss.item()):.2e}")
    print(f"largest gradient |diff| over {len(reference)} parameters: {worst[0]:.2e} ({worst[1]})")
    ok = abs(loss_eager.item() - loss.item()) <= 1e-5 and worst[0] <= 1e-5
    print("compiled step matches eager (float32, atol 1e-5):", "yes" if ok else "NO")
    return 0 if ok else 1
