"""Run rewritten graphs on a model of a device: a compute stream and a communication stream.

``simulate(graphs, device="h200")`` walks each graph's nodes in program order (the order the
runtime issues them) and gives every node a start and an end:

- compute kernels (``mm``, ``gelu``, ``cat``, ...) run one after another on the compute
  stream, each when its inputs are ready: roofline time, the larger of FLOPs over the dtype's
  peak (matmuls at ``matmul_efficiency`` of it, plus a fixed ``matmul_overhead``) and bytes
  moved over the memory bandwidth, plus a launch overhead (``DeviceProfile``);
- views and reshapes cost nothing;
- collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
  ``all_to_all_single``) and the P2P exchanges of FlashOverlap (``leancompile.p2p_start``) run
  one after another on the communication stream once their input is ready: ring collectives
  ``(N - 1)`` hops of the alpha-beta link model, an exchange one hop (a send to one peer and a
  receive from another at once, both directions of the link);
- a wait (``wait_tensor``, ``leancompile.p2p_wait``) holds the compute stream until its
  transfer has ended: the time the compute stream spends there is exposed communication.

Ranks are symmetric (FlashOverlap's schedules are: every rank runs the same steps on other
slices), so one rank's graph stands for all: the message a rank waits for was sent by its peer
at the same step it sent its own. Not modelled: communication kernels taking compute units
from the matmuls (NCCL uses some SMs), contention between concurrent transfers on one link
beyond running them one after another, and caches.

Before/after (TP=4 all-gather + matmul, one rank; C = compute of one slice, M = one hop)::

    sequential:  comm |==AG (3 hops)==|
                 comp                 |=mm (4 slices)=|          exposed: 3 M
    flash:       comm |=hop=|=hop=|=hop=|
                 comp |=C=|  |=C=|  |=C=| |=C=|                  exposed: max(0, M - C) x 3
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .devices import DeviceProfile, device_profile
from .graph_facts import (FREE, MATMULS, concrete, graphs_of, group_size, op_name,
                          tensor_bytes, tensors_of)

__all__ = ["Span", "Timeline", "exposure", "exposed_by_site", "node_cost", "simulate"]

aten = torch.ops.aten

_COLLECTIVES = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                "all_to_all_single", "broadcast", "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor_coalesced", "all_reduce_coalesced"}
_WAITS = {"wait_tensor", "p2p_wait"}


@dataclass(frozen=True)
class Span:
    """One node on one stream."""

    node: str
    op: str
    stream: str
    """``"compute"``, ``"comm"`` or ``"wait"`` (the compute stream held for a transfer)."""
    start: float
    end: float
    flops: float = 0.0
    bytes: int = 0
    graph: int = 0


@dataclass
class Timeline:
    """What ``simulate`` predicts for one rank: seconds and bytes."""

    device: str
    total_s: float = 0.0
    compute_s: float = 0.0
    """Busy time of the compute stream."""
    comm_s: float = 0.0
    """Busy time of the communication stream."""
    exposed_comm_s: float = 0.0
    """Time the compute stream waited for communication (``total - compute`` when nothing else
    holds it)."""
    peak_memory_bytes: int = 0
    """The largest sum of live tensors (the graphs' inputs included) at any node."""
    spans: list[Span] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.device}: total {self.total_s * 1e3:.3f} ms, compute "
                f"{self.compute_s * 1e3:.3f} ms, comm {self.comm_s * 1e3:.3f} ms, exposed "
                f"comm {self.exposed_comm_s * 1e3:.3f} ms, peak memory "
                f"{self.peak_memory_bytes / 2**20:.1f} MiB")

    def to_chrome_trace(self) -> dict:
        """Chrome trace / Perfetto JSON: one thread per stream, one event per span."""
        tids = {"compute": 1, "comm": 2, "wait": 1}
        events = [{"name": s.op, "cat": s.stream, "ph": "X", "pid": 0, "tid": tids[s.stream],
                   "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                   "args": {"node": s.node, "flops": s.flops, "bytes": s.bytes,
                            "graph": s.graph}} for s in self.spans]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t,
                    "args": {"name": n}} for n, t in (("compute", 1), ("comm", 2))]
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"device": self.device, "simulated": True}}


def _arg_value(arg):
    """A node argument's fake value; any other argument (a constant) as it is."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


# Ops torch has no FLOP formula for, counted with the formula of an op with the same leading
# arguments (CPU flash attention: query, key, value; its backward: grad_out, query, key, value).
_FLOPS_LIKE = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward":
        "_scaled_dot_product_flash_attention_backward",
}


def _flops(node: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    like = _FLOPS_LIKE.get(op_name(node))
    if formula is None and like is not None:
        formula = flop_registry.get(getattr(aten, like))
    if formula is None:
        return 0.0
    args = fx.node.map_arg(node.args, _arg_value)
    kwargs = fx.node.map_arg(node.kwargs, _arg_value)
    try:
        return float(concrete(formula(*args, out_val=node.meta.get("val"), **kwargs)))
    except Exception:  # noqa: BLE001 - a formula that cannot read these shapes counts 0
        return 0.0


def node_cost(node: fx.Node, device: DeviceProfile, *, world_size: int | None = None
              ) -> tuple[str, float, float, int]:
    """(stream, seconds, FLOPs, bytes) of one node: ``"free"`` (no time), ``"compute"``,
    ``"comm"`` or ``"wait"`` (module docstring)."""
    name = op_name(node)
    if node.op != "call_function" or name in FREE or name == "getitem" or \
            name.startswith("sym_") or node.target in (operator.mul, operator.add,
                                                       operator.floordiv, operator.sub):
        return "free", 0.0, 0.0, 0
    if name in _WAITS:
        return "wait", 0.0, 0.0, 0
    out = tensors_of(node.meta.get("val"))
    ins = [t for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))]
    if name == "p2p_start":
        send = tensors_of(_arg_value(node.args[0]))
        nbytes = sum(map(tensor_bytes, send))
        return "comm", device.link_latency + nbytes / device.link_bandwidth, 0.0, nbytes
    if name == "p2p_probe":
        return "comm", device.link_latency, 0.0, 0
    if name in _COLLECTIVES:
        n = group_size(node) or world_size or 1
        in_bytes = sum(map(tensor_bytes, ins))
        bw, alpha = device.bus_bandwidth, device.ring_step_latency
        if name.startswith("all_gather"):
            t = (n - 1) * (alpha + in_bytes / bw)
        elif name == "all_to_all_single":
            t = (n - 1) * (alpha + in_bytes / n / bw)
        elif name.startswith("reduce_scatter"):
            t = (n - 1) * (alpha + in_bytes / n / device.reduction_bandwidth)
        elif name.startswith("all_reduce"):
            t = 2 * (n - 1) * (alpha + in_bytes / n / device.reduction_bandwidth)
        else:  # broadcast: pipelined along the ring
            t = (n - 1) * alpha + in_bytes / bw
        return "comm", t, 0.0, in_bytes
    flops = _flops(node)
    nbytes = sum(map(tensor_bytes, ins)) + sum(map(tensor_bytes, out))
    dtype = out[0].dtype if out else torch.float32
    peak = device.peak_flops(dtype)
    if name in MATMULS and flops > 0:
        compute = device.matmul_overhead + flops / (peak * device.matmul_efficiency)
    else:
        compute = flops / peak
    seconds = max(compute, nbytes / device.memory_bandwidth)
    return "compute", seconds + device.kernel_overhead, flops, nbytes


def _pure(node: fx.Node) -> bool:
    """No side effect: a node nothing reads can be dropped (collectives and P2P ops stay)."""
    name = op_name(node)
    if name in _COLLECTIVES or name in _WAITS or name.startswith("p2p_") or \
            name.endswith("_") or name in ("copy_", "resize_"):
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or not schema.is_mutable


def simulate(graphs_or_report, device="h200", *, world_size: int | None = None) -> Timeline:
    """Predict one rank's step time, exposed communication and peak memory for ``graphs``
    (run one after another, e.g. forward then backward) on ``device`` (a ``DeviceProfile``,
    a built-in name or a JSON file). Nodes need ``meta["val"]`` (what AOTAutograd and the
    passes leave on post-grad graphs). ``world_size``: the group size of collectives whose
    node does not say it."""
    profile = device_profile(device)
    timeline = Timeline(device=profile.name)
    clock = 0.0
    for index, graph in enumerate(graphs_of(graphs_or_report)):
        clock = _run(graph, index, profile, timeline, clock, world_size)
    timeline.total_s = clock
    timeline.compute_s = sum(s.end - s.start for s in timeline.spans if s.stream == "compute")
    timeline.comm_s = sum(s.end - s.start for s in timeline.spans if s.stream == "comm")
    timeline.exposed_comm_s = sum(s.end - s.start for s in timeline.spans if s.stream == "wait")
    return timeline


def _run(graph: fx.Graph, index: int, profile: DeviceProfile, timeline: Timeline,
         clock: float, world_size) -> float:
    ready: dict[fx.Node, float] = {}
    done: dict[fx.Node, float] = {}  # transfers: when their data has arrived
    compute_free = comm_free = clock
    nodes = list(graph.nodes)
    # Memory: a node's output lives from the node until its last reader (views share their
    # base's memory: they allocate nothing and keep the base alive through their readers).
    base: dict[fx.Node, fx.Node] = {}
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[base.get(arg, arg)] = i
        stream = "free" if node.op != "call_function" else node_cost(
            node, profile, world_size=world_size)[0]
        # (a wait returns its collective's buffer)
        if node.op == "call_function" and stream in ("free", "wait") and \
                node.all_input_nodes and op_name(node) not in ("empty", "empty_strided",
                                                               "empty_like"):
            base[node] = base.get(node.all_input_nodes[0], node.all_input_nodes[0])
    # comm_compute_overlap < 0: each transfer in flight -> [its seconds, the compute seconds
    # issued beside it]; the interference is paid at its wait.
    beside: dict[fx.Node, list[float]] = {}
    live = 0
    sizes: dict[fx.Node, int] = {}
    frees: dict[int, list[fx.Node]] = {}
    for node, i in last_use.items():
        frees.setdefault(i, []).append(node)
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        deps = [ready.get(a, clock) for a in node.all_input_nodes]
        start_ready = max(deps, default=clock)
        if node.op == "placeholder":
            ready[node] = clock
        elif node.op == "call_function" and not node.users and _pure(node):
            ready[node] = start_ready  # dead code: the compilers drop it
        elif node.op == "call_function":
            stream, seconds, flops, nbytes = node_cost(node, profile, world_size=world_size)
            label = op_name(node)
            if stream == "free":
                ready[node] = start_ready
            elif stream == "compute":
                start = max(compute_free, start_ready)
                compute_free = start + seconds
                ready[node] = compute_free
                timeline.spans.append(Span(node.name, label, "compute", start, compute_free,
                                           flops, nbytes, index))
                for entry in beside.values():
                    entry[1] += seconds
            elif stream == "comm":
                start = max(comm_free, start_ready)
                comm_free = start + seconds
                ready[node] = done[node] = comm_free
                timeline.spans.append(Span(node.name, label, "comm", start, comm_free, 0.0,
                                           nbytes, index))
                shared = (1 - max(profile.comm_compute_overlap, 0.0)) * seconds
                if shared > 0:  # the transfer's share of the cores the compute runs on
                    held = max(compute_free, start)
                    timeline.spans.append(Span(node.name, f"{label} (on the compute cores)",
                                               "wait", held, held + shared, 0.0, 0, index))
                    compute_free = held + shared
                if profile.comm_compute_overlap < 0:
                    beside[node] = [seconds, 0.0]
            else:  # a wait: the compute stream holds until the transfer has arrived
                src = node.all_input_nodes[0] if node.all_input_nodes else None
                entry = beside.pop(base.get(src, src), None)  # (through a getitem)
                penalty = -profile.comm_compute_overlap * min(entry) if entry else 0.0
                if penalty > 0:  # the transfer and the compute beside it slowed each other
                    timeline.spans.append(Span(node.name, f"{label} (interference)", "wait",
                                               compute_free, compute_free + penalty, 0.0, 0,
                                               index))
                    compute_free += penalty
                arrived = max((done.get(a, ready.get(a, clock))
                               for a in node.all_input_nodes[:1]), default=clock)
                if arrived > compute_free:
                    timeline.spans.append(Span(node.name, label, "wait", compute_free,
                                               arrived, 0.0, 0, index))
                    compute_free = arrived
                ready[node] = max(compute_free, arrived)
        else:
            ready[node] = start_ready
        if node not in base and node.op in ("placeholder", "call_function"):
            sizes[node] = sum(map(tensor_bytes, tensors_of(node.meta.get("val"))))
            live += sizes[node]
        timeline.peak_memory_bytes = max(timeline.peak_memory_bytes, live)
        for dead in frees.get(i, []):
            if dead.op != "placeholder":
                live -= sizes.pop(dead, 0)
    return max(compute_free, comm_free)


def exposed_by_site(timeline: Timeline, graph: fx.Graph) -> dict[str, float]:
    """Exposed seconds of ``timeline`` (one graph simulated alone) per collective: a wait on a
    collective counts for that collective's node; the P2P steps FlashOverlap put in its place
    carry the site they came from (``SITE_META`` of ``passes/flash/splice.py``)."""
    from ..passes.flash.splice import SITE_META

    nodes = {n.name: n for n in graph.nodes}
    out: dict[str, float] = {}
    for span in timeline.spans:
        if span.stream != "wait":
            continue
        node = nodes.get(span.node)
        if node is None:
            continue
        site = node.meta.get(SITE_META)
        if site is None and op_name(node) == "wait_tensor" and node.all_input_nodes:
            source = node.all_input_nodes[0]
            site = source.meta.get(SITE_META, source.name)
        if site is None and op_name(node) == "p2p_wait" and node.all_input_nodes:
            site = node.all_input_nodes[0].meta.get(SITE_META)
        site = site or node.name
        out[site] = out.get(site, 0.0) + span.end - span.start
    return out


def exposure(report, device="h200", *, world_size: int | None = None) -> list[dict]:
    """Per graph of a ``Report`` and per collective: the exposed communication predicted on
    ``device`` before our passes and after them (``{"graph", "site", "before_s", "after_s"}``;
    one ``"site": "(total)"`` row per graph with the graph's totals)."""
    profile = device_profile(device)
    rows = []
    for record in report.graphs:
        before, after = record.before_snapshot.graph, record.after_snapshot.graph
        if before is None or after is None:
            raise ValueError("this report holds code only (loaded from disk?); explain the "
                             "function again to simulate its graphs")
        t_before = Timeline(device=profile.name)
        t_before.total_s = _run(before, 0, profile, t_before, 0.0, world_size)
        t_after = Timeline(device=profile.name)
        t_after.total_s = _run(after, 0, profile, t_after, 0.0, world_size)
        b, a = exposed_by_site(t_before, before), exposed_by_site(t_after, after)
        for site in sorted(set(b) | set(a)):
            rows.append({"graph": record.name, "site": site, "before_s": b.get(site, 0.0),
                         "after_s": a.get(site, 0.0)})
        rows.append({"graph": record.name, "site": "(total)",
                     "before_s": sum(b.values()), "after_s": sum(a.values()),
                     "total_before_s": t_before.total_s, "total_after_s": t_after.total_s})
    return rows
