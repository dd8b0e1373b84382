"""What the LeanGRPO benchmarks time the same way: one step's forward without grad (``F0``),
with grad (``F``) and its backward (``B``), and the ideal ratio they give.

With ``T`` denoising steps of which ``S`` are trained, recompute runs ``T*F0 + S*(F + B)`` and
a schedule that reuses the rollout's forward ``(T - S)*F0 + S*(F + B)``; their quotient is the
most a schedule can gain (``ideal_ratio``)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..lean import synchronize

__all__ = ["median_seconds", "step_times", "ideal_ratio", "add_malloc_flag", "apply_malloc_flag",
           "join_torchrun"]


def median_seconds(fn: Callable[[], object], repeats: int = 5,
                   device: torch.device | None = None) -> float:
    """The median of ``repeats`` timed calls of ``fn``, after one untimed call (each call's
    time includes the work it queued on ``device``; None: the current CUDA device)."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(call: Callable[[], object], loss: Callable[[object], torch.Tensor],
               params, repeats: int = 5, device: torch.device | None = None) -> dict:
    """``F0``, ``F`` and ``B`` (medians) of ``call()``, the backward of ``loss(call())``, on
    ``device``; ``params``' gradients are cleared afterwards."""
    with torch.no_grad():
        f0 = median_seconds(call, repeats, device)
    f = median_seconds(call, repeats, device)

    def backward():
        out = call()
        synchronize(device)
        start = time.perf_counter()
        loss(out).backward()
        synchronize(device)
        return time.perf_counter() - start

    backward()
    b = statistics.median(backward() for _ in range(repeats))
    for p in params:
        p.grad = None
    return {"forward_nograd_s": f0, "forward_s": f, "backward_s": b}


def ideal_ratio(times: dict, steps: int, trained: int) -> float:
    """Recompute's model time over a reusing schedule's, for ``trained`` of ``steps``."""
    f0, fb = times["forward_nograd_s"], times["forward_s"] + times["backward_s"]
    return (steps * f0 + trained * fb) / ((steps - trained) * f0 + trained * fb)


MALLOC_HELP = ("keep: glibc keeps freed memory for reuse (leancompile.runtime.allocator."
               "keep_freed_memory; without it Retain's held activations come back as page faults "
               "every iteration on CPU); default: glibc's own policy")


def add_malloc_flag(parser) -> None:
    """``--malloc keep|default`` on a benchmark's command line."""
    parser.add_argument("--malloc", default="keep", choices=("keep", "default"), help=MALLOC_HELP)


def apply_malloc_flag(choice: str) -> str:
    """Apply ``--malloc``; returns what the run used: ``keep``, ``default``, or
    ``default (not glibc)`` where ``keep`` cannot be applied."""
    if choice != "keep":
        return "default"
    from ..runtime.allocator import keep_freed_memory

    return "keep" if keep_freed_memory() else "default (not glibc)"


def join_torchrun(json_output: bool, device: str = "cpu") -> tuple[bool, Callable[..., None]]:
    """Under torchrun (``WORLD_SIZE`` > 1, no process group yet): join the launched ranks,
    with gloo for a bench on the host and NCCL on ``cuda`` (each rank on the GPU of its
    ``LOCAL_RANK``, made the current device). Returns whether this call created the process
    group (destroy it when done) and the bench's log: silent on ranks other than 0, on stderr
    when the report goes to stdout as JSON."""
    import os
    import sys

    import torch.distributed as dist

    joined = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
        joined = True
    if dist.is_initialized() and dist.get_rank() != 0:
        return joined, lambda *a: None
    return joined, (lambda *a: print(*a, file=sys.stderr)) if json_output else print
