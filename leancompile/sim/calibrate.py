"""``cpu-gloo``: a device profile of this machine, measured by micro-benchmarks inside the ranks
of a gloo process group (each rank with the threads it will run with).

Measured (ranks in lockstep, each sample long enough that ranks sharing cores share them; the
median of samples; every number the mean over the ranks):

- matmul time at two sizes, fitted to ``t(F) = t0 + F / P`` (``flops["float32"] = P``,
  ``matmul_overhead = t0``, ``matmul_efficiency = 1``);
- memory bandwidth: an add of two 8 MiB tensors (three tensors moved; an activation's size);
- kernel overhead: an add of one-element tensors;
- the P2P exchange of ``runtime/p2p.py`` (a send to rank r+1 and a receive from r-1 at once) at
  two sizes: latency and bandwidth;
- an all-gather at two sizes: the bus bandwidth of ring collectives; a reduce-scatter at two
  sizes: that of reductions (gloo sums on the cores);
- how much of an exchange runs beside a matmul about as long: ``comm_compute_overlap`` =
  ``(t_matmul + t_exchange - t_both) / min(t_matmul, t_exchange)``.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from .devices import DeviceProfile

__all__ = ["calibrate_cpu_gloo"]


def _median(fn, repeats: int) -> float:
    """Seconds per call of ``fn``, run by every rank at once: each sample repeats it for at
    least 20 ms (so that ranks sharing cores share them during the sample, as they do in a
    step); the median of ``repeats`` samples."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    calls = int(_mean(calls))  # the same number on every rank (exchanges must pair up)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return sorted(samples)[len(samples) // 2]


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _fit(x1, t1, x2, t2) -> tuple[float, float]:
    """(intercept, slope) of the line through (x1, t1), (x2, t2); both kept >= 0."""
    slope = max((t2 - t1) / (x2 - x1), 1e-30)
    return max(t1 - slope * x1, 0.0), slope


def calibrate_cpu_gloo(*, repeats: int = 5) -> DeviceProfile:
    """The profile of this machine as the calling rank's process group sees it (collective:
    every rank calls it)."""
    from ..runtime.p2p import start_exchange, wait_exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(rank)

    # Matmuls: 1 / rate = 1 / P + (H / P) / F
    rates = []
    for n in (128, 768):
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        flops = 2 * n ** 3
        rates.append((flops, flops / _mean(_median(lambda: a @ b, repeats))))
    (f1, r1), (f2, r2) = rates
    inv_p, h_over_p = _fit(1 / f2, 1 / r2, 1 / f1, 1 / r1)  # 1 / P, t0
    peak = 1 / inv_p if inv_p > 0 else r2

    big = [torch.randn(2 * 2**20, generator=g) for _ in range(2)]  # an activation's size
    bandwidth = 3 * big[0].numel() * 4 / _mean(_median(lambda: big[0].add(big[1]), repeats))
    one = torch.ones(1)
    overhead = _mean(_median(lambda: one.add(one), 50))

    def exchange(t):
        return wait_exchange(start_exchange(t, t.shape, (rank + 1) % world,
                                            (rank - 1) % world, group))

    small, large = torch.randn(256, generator=g), torch.randn(2**20, generator=g)
    t_small = _mean(_median(lambda: exchange(small), repeats))
    t_large = _mean(_median(lambda: exchange(large), repeats))
    latency, per_byte = _fit(small.numel() * 4, t_small, large.numel() * 4, t_large)

    def gather(t):
        out = t.new_empty(world * t.numel())
        dist.all_gather_into_tensor(out, t)

    g_small = _mean(_median(lambda: gather(small), repeats))
    g_large = _mean(_median(lambda: gather(large), repeats))
    _, gather_per_byte = _fit(small.numel() * 4, g_small / (world - 1),
                              large.numel() * 4, g_large / (world - 1))

    def reduce_scatter(t):
        out = t.new_empty(t.numel() // world)
        dist.reduce_scatter_tensor(out, t)

    wide_small = torch.randn(world * small.numel(), generator=g)
    wide_large = torch.randn(world * large.numel(), generator=g)
    r_small = _mean(_median(lambda: reduce_scatter(wide_small), repeats))
    r_large = _mean(_median(lambda: reduce_scatter(wide_large), repeats))
    _, reduce_per_byte = _fit(small.numel() * 4, r_small / (world - 1),
                              large.numel() * 4, r_large / (world - 1))

    # A matmul about as long as the exchange, so that the overlap is well measured; the
    # three timed in turns, several times.
    n = min((256, 384, 512, 768, 1024), key=lambda m: abs(2 * m ** 3 / peak - t_large))
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    t_mm = _mean(_median(lambda: a @ b, 2 * repeats))

    def both():
        pending = start_exchange(large, large.shape, (rank + 1) % world, (rank - 1) % world,
                                 group)
        a @ b
        wait_exchange(pending)

    t_both = _mean(_median(both, 2 * repeats))
    t_large = _mean(_median(lambda: exchange(large), 2 * repeats))
    overlap = (t_mm + t_large - t_both) / min(t_mm, t_large)
    threads = torch.get_num_threads()
    cpus = os.cpu_count() or 1
    return DeviceProfile(
        name="cpu-gloo", flops={"float32": peak}, memory_bandwidth=bandwidth,
        link_bandwidth=1 / per_byte, link_latency=latency,
        collective_bandwidth=1 / gather_per_byte, reduce_bandwidth=1 / reduce_per_byte,
        memory_bytes=_memory_bytes(),
        kernel_overhead=overhead, matmul_efficiency=1.0, matmul_overhead=h_over_p,
        comm_compute_overlap=min(max(overlap, 0.0), 1.0), symmetric_memory=False,
        sources={"flops": f"measured: fp32 matmuls of 128^3 and 768^3 with {threads} "
                          f"thread(s) per rank, {world} ranks on {cpus} CPUs",
                 "memory_bandwidth": "measured: add of two 8 MiB tensors",
                 "link_bandwidth": "measured: leancompile P2P exchanges of 1 KiB and 4 MiB "
                                   "over gloo",
                 "collective_bandwidth": "measured: gloo all_gather_into_tensor of 1 KiB "
                                         "and 4 MiB shards",
                 "reduce_bandwidth": "measured: gloo reduce_scatter_tensor to 1 KiB and "
                                     "4 MiB parts",
                 "comm_compute_overlap": f"measured: a 4 MiB exchange beside a {n}^3 matmul"},
        notes=f"calibrated in {world} gloo ranks on this machine")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**34
