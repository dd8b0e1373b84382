"""bf16 and FlashOverlap's query-split attention, measured: the 2-block Llama of
``tests/test_flash_overlap.py`` (TP+SP, causal attention) on 2 gloo ranks, bf16 weights or
fp32 weights under bf16 autocast, compiled without the pass, with ``overlap="flash"`` and
``attention_split`` on and off, under aot_eager and Inductor. Prints per rank the largest
difference (over the output and every gradient, relative to each tensor's scale) of flash
against the plain compile, and of each against eager.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bf16_attention_split.py [weights|autocast]

Figures and what they mean: docs/flashoverlap.md, section 3."""

import contextlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import leancompile  # noqa: E402
from ranks import spawn  # noqa: E402


def _worker(rank, world, init, out, mode):
    from test_flash_overlap import _compare, _report, dtensor_llama
    from test_flash_overlap import _run as run_once

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False  # (the pass must run: no cache hits)
    torch._functorch.config.enable_autograd_cache = False
    dtype = torch.bfloat16 if mode == "weights" else torch.float32

    def run(*args, **kwargs):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else \
            contextlib.nullcontext()
        with ctx:
            return run_once(*args, **kwargs)

    records = {}
    for compiler in ("aot_eager", "inductor"):
        fn, _ = dtensor_llama(world)
        fn.to(dtype)
        params = list(fn.parameters())
        torch.manual_seed(100 + rank)
        x = torch.randn(2, 8 // world, 32, dtype=dtype, requires_grad=True)
        eager = run(fn, params, x, None)
        plain = run(fn, params, x, leancompile.backend(compiler=compiler))
        for split in (True, False):
            flash = run(fn, params, x, leancompile.backend(
                compiler=compiler, overlap="flash", attention_split=split))
            split_sites = sum("attention" in kind for g in _report().values()
                              for kind in g["rewritten"])
            records[f"{compiler} attention_split={split}"] = {
                "flash_vs_plain": max(_compare(flash, plain)),
                "flash_vs_eager": max(_compare(flash, eager)),
                "plain_vs_eager": max(_compare(plain, eager)), "split_sites": split_sites}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    dist.destroy_process_group()


def main(mode: str = "weights") -> None:
    tmp = tempfile.mkdtemp()
    spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp, mode), nprocs=2)
    print(f"bf16 ({mode}), 2-block Llama TP+SP, 2 ranks; max difference over the output and "
          "every gradient, relative to each tensor's scale")
    for rank in range(2):
        with open(os.path.join(tmp, f"rank{rank}.json")) as f:
            for name, r in json.load(f).items():
                print(f"rank {rank} {name:<34} flash vs plain {r['flash_vs_plain']:.1e}   "
                      f"flash vs eager {r['flash_vs_eager']:.1e}   plain vs eager "
                      f"{r['plain_vs_eager']:.1e}   split sites {r['split_sites']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
