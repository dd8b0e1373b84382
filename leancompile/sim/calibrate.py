"""``cpu-gloo``: a device profile of this machine, measured by micro-benchmarks inside the ranks
of a gloo process group (each rank with the threads it will run with).

Measured (ranks in lockstep, each sample long enough that ranks sharing cores share them and
timed until the slowest rank is done; the median of samples):

- matmul time at two sizes, fitted to ``t(F) = t0 + F / P`` (``flops["float32"] = P``,
  ``matmul_overhead = t0``, ``matmul_efficiency = 1``); given the workload's own matmul
  shapes (``workload(graphs)``), the large point is those matmuls (the mean of their FLOPs
  and of their times) instead of a square 768^3 one: a CPU's GEMM speed depends on the shape
  by 10% and more;
- memory bandwidth: the exact GELU as eager pointwise ops (``x * 0.5 * (1 + erf(x / √2))``,
  each allocating its output, as a graph's ops do) on an activation-sized tensor (the
  workload's largest pointwise output, else 8 MiB), bytes counted as the simulator counts them
  (inputs + outputs): what an activation's pointwise ops reach, allocation and ``erf``'s
  arithmetic included, not a streaming copy's peak (2-3x higher here);
- kernel overhead: an add of one-element tensors;
- the P2P exchange of ``runtime/p2p.py`` (a send to rank r+1 and a receive from r-1 at once) at
  two sizes: latency and bandwidth;
- an all-gather at two sizes: the bus bandwidth of ring collectives; a reduce-scatter at two
  sizes: that of reductions (gloo sums on the cores); the fixed time of one ring step, the mean
  of the two fits' (``collective_latency``: gloo's own ring step costs less than our P2P
  exchange's fixed time, half to nine tenths of it here, and a sliced schedule pays it once
  per slice);
- how much of an exchange runs beside a matmul about as long (the workload's largest message
  and its matmul nearest in time, when given): ``comm_compute_overlap`` =
  ``(t_matmul + t_exchange - t_both) / min(t_matmul, t_exchange)``, negative (down to -1) where
  the two side by side take longer than one after the other: ranks and gloo's threads
  oversubscribing the cores (here, 4 ranks on 2 cores: -0.2 to -0.6).
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.fx as fx

from .devices import DeviceProfile

__all__ = ["calibrate_cpu_gloo", "workload"]


def _median(fn, repeats: int) -> float:
    """Seconds per call of ``fn``, run by every rank at once: each sample repeats it for at
    least 20 ms (so that ranks sharing cores share them during the sample, as they do in a
    step) and lasts until the slowest rank is done; the median of ``repeats`` samples (the
    same number on every rank).

    The slowest rank, not the mean over ranks: ranks that finish early leave their cores to the
    others, so a mean of each rank's own time measured the ops faster than they run in a step,
    where every rank works until the end (and ``--validate`` times the slowest rank). With 4
    ranks on 2 cores the mean made the simulator under-predict the layer by 20-32%."""
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
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # until the slowest rank is done
        samples.append(elapsed.item() / calls)
    return sorted(samples)[len(samples) // 2]


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _fit(x1, t1, x2, t2) -> tuple[float, float]:
    """(intercept, slope) of the line through (x1, t1), (x2, t2); both kept >= 0."""
    slope = max((t2 - t1) / (x2 - x1), 1e-30)
    return max(t1 - slope * x1, 0.0), slope


def workload(graphs_or_report) -> dict:
    """What of a workload (graphs, a report, or a list of them: their union) the calibration
    should time: ``{"matmuls": [(m, k, n), ...],
    "activation": numel, "message": numel}``: the fp32 ``mm``/``addmm`` shapes of the graphs
    (each once), the largest fp32 output of their other compute ops (pointwise ops, ``cat``,
    ...) and their largest message of one hop in elements (a P2P exchange's send, a ring
    all-gather's or reduce-scatter's shard), for ``calibrate_cpu_gloo(workload=...)``, which
    times fp32 (the only dtype ``cpu-gloo`` has a rate for). Symbolic sizes count at their
    hints, as the simulator counts them."""
    from .graph_facts import FREE, MATMULS, concrete, graphs_of, group_size, op_name, tensors_of

    def numel(t) -> int:  # symbolic sizes at their hints, as the simulator takes them
        return math.prod(concrete(d) for d in t.shape)

    matmuls, activation, message = [], 0, 0
    for graph in graphs_of(graphs_or_report):
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            name = op_name(node)
            out = tensors_of(node.meta.get("val"))
            if name == "p2p_start" or name in ("all_gather_into_tensor",
                                               "reduce_scatter_tensor"):
                sent = tensors_of(node.args[0].meta.get("val")) \
                    if isinstance(node.args[0], fx.Node) else []
                hop = sum(numel(t) for t in sent)
                message = max(message, hop if name != "reduce_scatter_tensor" else
                              hop // max(group_size(node) or 1, 1))
            elif name in ("mm", "addmm"):
                a, b = (tensors_of(x.meta.get("val")) if isinstance(x, fx.Node) else []
                        for x in node.args[-2:])
                if a and b and a[0].dtype == torch.float32:
                    shape = tuple(concrete(d) for d in (*a[0].shape, b[0].shape[1]))
                    if shape not in matmuls:
                        matmuls.append(shape)
            elif name not in MATMULS and name not in FREE and out and \
                    out[0].dtype == torch.float32 and not name.startswith(("p2p", "all_",
                                                                           "reduce_", "wait")):
                activation = max(activation, numel(out[0]))
    return {"matmuls": matmuls, "activation": activation, "message": message}


def calibrate_cpu_gloo(*, repeats: int = 5, workload: dict | None = None) -> DeviceProfile:
    """The profile of this machine as the calling rank's process group sees it (collective:
    every rank calls it). ``workload`` (``workload(graphs)``, the same on every rank: the
    ranks' exchanges pair up): time its matmul shapes, activation size and message rather
    than generic ones."""
    from ..runtime.p2p import start_exchange, wait_exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(rank)
    shapes = list((workload or {}).get("matmuls") or [])

    # Matmuls: t(F) = t0 + F / P through a small square one and the large point (the
    # workload's shapes of at least 4x its FLOPs, the mean of their FLOPs and of their times;
    # else a 768^3 one).
    a, b = torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g)
    f_small, t_small_mm = 2 * 128 ** 3, _median(lambda: a @ b, repeats)
    big_mms = [s for s in shapes if 2 * math.prod(s) >= 4 * f_small]
    large_label = f"the workload's {big_mms}" if big_mms else "768^3"
    big_mms = big_mms or [(768, 768, 768)]
    f_large = t_large_mm = 0.0
    for m, k, n in big_mms:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        f_large += 2 * m * k * n
        t_large_mm += _median(lambda: a @ b, repeats)
    f_large, t_large_mm = f_large / len(big_mms), t_large_mm / len(big_mms)
    h_over_p, inv_p = _fit(f_small, t_small_mm, f_large, t_large_mm)  # t0, 1 / P
    # (a large point no slower than the small one: the rate of the large point, no overhead)
    peak = 1 / inv_p if inv_p > 1e-20 else f_large / t_large_mm

    # Pointwise ops: the exact GELU's, each allocating its output, on an activation's size.
    numel = int((workload or {}).get("activation") or 2 * 2**20)
    x = torch.randn(numel, generator=g)

    def gelu():
        h = x * 0.5
        e = torch.erf(x * 0.7071067811865476)
        return h * (e + 1)

    moved = (2 + 2 + 2 + 2 + 3) * numel * 4  # mul, mul, erf, add, mul: inputs + outputs
    bandwidth = moved / _median(gelu, repeats)
    one = torch.ones(1)
    overhead = _median(lambda: one.add(one), 50)

    def exchange(t):
        return wait_exchange(start_exchange(t, t.shape, (rank + 1) % world,
                                            (rank - 1) % world, group))

    small, large = torch.randn(256, generator=g), torch.randn(2**20, generator=g)
    t_small = _median(lambda: exchange(small), repeats)
    t_large = _median(lambda: exchange(large), repeats)
    latency, per_byte = _fit(small.numel() * 4, t_small, large.numel() * 4, t_large)

    def gather(t):
        out = t.new_empty(world * t.numel())
        dist.all_gather_into_tensor(out, t)

    g_small = _median(lambda: gather(small), repeats)
    g_large = _median(lambda: gather(large), repeats)
    gather_step, gather_per_byte = _fit(small.numel() * 4, g_small / (world - 1),
                                        large.numel() * 4, g_large / (world - 1))

    def reduce_scatter(t):
        out = t.new_empty(t.numel() // world)
        dist.reduce_scatter_tensor(out, t)

    wide_small = torch.randn(world * small.numel(), generator=g)
    wide_large = torch.randn(world * large.numel(), generator=g)
    r_small = _median(lambda: reduce_scatter(wide_small), repeats)
    r_large = _median(lambda: reduce_scatter(wide_large), repeats)
    reduce_step, reduce_per_byte = _fit(small.numel() * 4, r_small / (world - 1),
                                        large.numel() * 4, r_large / (world - 1))

    # How an exchange and a matmul about as long fare side by side: the workload's largest
    # message and its matmul nearest to it in time (else 4 MiB and a square one); the three
    # timed in turns, three times.
    message = torch.randn(int((workload or {}).get("message") or large.numel()), generator=g)
    t_message = _median(lambda: exchange(message), repeats)

    def predicted(mkn):
        return h_over_p + 2 * math.prod(mkn) / peak

    # a workload matmul within 2x of the message's time, else a square one (a much shorter
    # matmul would blow the exchange's jitter up in the ratio below)
    near = [s for s in shapes if 0.5 <= predicted(s) / t_message <= 2]
    m, k, n = min(near or [(s, s, s) for s in (256, 384, 512, 768, 1024)],
                  key=lambda mkn: abs(predicted(mkn) - t_message))
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)

    def ring():  # as FlashOverlap's ring issues them: world - 1 hops, a matmul beside each
        for _ in range(world - 1):
            pending = start_exchange(message, message.shape, (rank + 1) % world,
                                     (rank - 1) % world, group)
            a @ b
            wait_exchange(pending)

    estimates = []
    for _ in range(3):  # on oversubscribed cores one estimate moves by +-0.3: their median
        t_both = _median(ring, repeats) / (world - 1)
        t_alone = _median(lambda: exchange(message), repeats)
        t_matmul = _median(lambda: a @ b, repeats)
        estimates.append((t_matmul + t_alone - t_both) / min(t_matmul, t_alone))
    overlap = sorted(estimates)[1]
    threads = torch.get_num_threads()
    cpus = os.cpu_count() or 1
    return DeviceProfile(
        name="cpu-gloo", flops={"float32": peak}, memory_bandwidth=bandwidth,
        link_bandwidth=1 / per_byte, link_latency=latency,
        collective_bandwidth=1 / gather_per_byte, reduce_bandwidth=1 / reduce_per_byte,
        collective_latency=(gather_step + reduce_step) / 2,
        memory_bytes=_memory_bytes(),
        kernel_overhead=overhead, matmul_efficiency=1.0, matmul_overhead=h_over_p,
        comm_compute_overlap=min(max(overlap, -1.0), 1.0), symmetric_memory=False,
        sources={"flops": f"measured: fp32 matmuls of 128^3 and {large_label} with "
                          f"{threads} thread(s) per rank, {world} ranks on {cpus} CPUs",
                 "memory_bandwidth": f"measured: the exact GELU as eager pointwise ops on "
                                     f"{numel} fp32 elements",
                 "link_bandwidth": "measured: leancompile P2P exchanges of 1 KiB and 4 MiB "
                                   "over gloo",
                 "collective_bandwidth": "measured: gloo all_gather_into_tensor of 1 KiB "
                                         "and 4 MiB shards",
                 "reduce_bandwidth": "measured: gloo reduce_scatter_tensor to 1 KiB and "
                                     "4 MiB parts",
                 "collective_latency": "measured: the fixed time per ring step of the "
                                       "all-gathers and reduce-scatters above (their mean)",
                 "comm_compute_overlap": f"measured: a {message.numel() * 4} B exchange "
                                         f"beside a {m}x{k}x{n} matmul, apart and together"},
        notes=f"calibrated in {world} gloo ranks on this machine")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**34
