"""Point-to-point (P2P) ops that can live in FX graphs: the steps of the FlashOverlap schedules.

Three ops, registered with ``torch.library.custom_op`` under ``leancompile::`` when
``leancompile`` is imported (so a graph that Inductor serves from its cache finds them), and
keyed by the process-group *name* (``group.group_name``, as functional collectives are)::

    handle = leancompile::p2p_start(send, recv_shape, peer_send, peer_recv, tag, group_name)
    y = ...compute that does not need the received data...
    recv = leancompile::p2p_wait(handle, recv_shape, dtype, device, after=[y])

    x2 = leancompile::p2p_probe(x, peer_send, peer_recv, reason, group_name)

``p2p_start`` posts "send ``send`` to ``peer_send``" and "receive a ``recv_shape`` tensor of
``send``'s dtype from ``peer_recv``" together (``dist.batch_isend_irecv``) and returns at once with
a handle (a 0-dim int64 CPU tensor naming the posted work in a table of this module).
``p2p_wait`` waits for both and returns the received tensor. Peers are ranks *within the group*; -1 means "no send" or "no receive" (a receive
of nothing returns an empty tensor). Send and receive of one op carry the same ``tag``: give every
message of a schedule its own tag so that matching never depends on the order the ops run in.

Messages own their buffers. ``p2p_start`` copies ``send`` into a message buffer of its own and
holds it until the wait: whatever a compiler does with the tensor it passed (Inductor frees or
reuses a buffer after its last reader in the graph, and it may materialise one value twice), the
bytes in flight cannot change. The received buffer is allocated by ``p2p_start`` and handed to
the graph only by ``p2p_wait``. The cost is one copy of each sent slice per hop: the same bytes as
the transfer, at memory bandwidth instead of link bandwidth (on CPU with gloo, noise; on an H200,
about a tenth of the hop's time, spent on the compute stream). The alternative, a lowering that
tells Inductor the send buffer is read until the wait (what Inductor does for its own
collectives), would save the copy but depends on Inductor internals; the copy holds for any
compiler and for eager calls.

Every message carries a header (``HEADER_BYTES`` in front of the data: a magic number, the kind,
the tag, the dtype and the shape). A receive checks it and raises ``P2PMismatchError`` naming
both ranks' views when the peer sent something else: a slice of another shape or dtype (the
ranks passed different shapes to what should be one collective; gloo itself silently truncates
or pads such a message), or a probe. ``p2p_probe`` is what a rank runs in front of a collective
that the FlashOverlap pass left in place for a reason that may differ between ranks (a size not
divisible by the chunk count, a rewrite that raised): it exchanges a header-only message on the
schedule's first hop (send to ``peer_send``, receive from ``peer_recv``, tag 0), so that a rank
that rewrote the site and a rank that did not both stop at once with an error instead of waiting
on each other until the process-group timeout. It returns a copy of ``x``, which the collective
then reads, so that no scheduler can run the collective first. A peer's message larger than the
posted receive makes gloo abort the process (``gloo::EnforceNotMet``); a smaller one, or a probe,
raises the clear error. On CPU the header is read on the host after the wait; on an accelerator
the check runs on the device (``torch._assert_async``) so that the wait stays asynchronous.

Why split-phase through our own ops and not torch's ``_c10d_functional.{isend, irecv,
batch_p2p_ops}`` + ``wait_tensor``: those have the same shape (post, then ``wait_tensor`` on the
result), a Meta kernel and an Inductor lowering, and ``irecv`` writes into the buffer it is given
and returns it. But in torch 2.13 every ``isend`` registers its Work twice in c10d's work registry
(under the sent tensor and under the empty placeholder it returns), and ``wait_tensor`` pops only
the entry it is called on. With gloo, which does not coalesce, one registry entry per send is
never removed (a leak that keeps the sent tensor alive until exit, and the "unwaited collective
calls" warning at exit), and waiting the second entry hangs: a gloo send Work cannot be waited
twice. Checked on this machine: five ``batch_p2p_ops`` exchanges leave five entries. Our ops hold
the ``Work`` objects from ``batch_isend_irecv`` in a table of their own and wait each once.

How the graph keeps them:

* Dead-code elimination: the ops are registered with ``torch.fx.node.has_side_effect``. In torch
  2.13 both ``Graph.eliminate_dead_code`` and Inductor's ``FallbackKernel.has_side_effects`` ask
  ``torch._library.utils.is_impure``, which consults that set, so a send-only step whose output
  nobody reads is kept. No effect tokens: they would thread a token through the graph
  (``with_effects`` wrappers) and hide the ops from the matchers.
* Order: ``p2p_wait`` depends on its handle, and on ``after``, the outputs of the compute meant
  to run while the transfer is in flight; it does not read them. Without ``after`` nothing ties
  that compute to the wait, and Inductor (torch 2.13, CPU) moved a ring reduce-scatter step's
  matmul behind the wait, serialising the step; it did so with ``reorder_for_peak_memory``
  (the default) and kept the graph order without it. ``after`` also keeps those tensors alive
  until the wait, which costs nothing here (the schedules read them after the wait anyway).

Autograd: none of the ops has a derivative formula. The FlashOverlap rewrite inserts them in
post-grad forward and backward graphs, after AOTAutograd has already split the joint graph, so no
gradient is ever taken through them. Called eagerly on tensors that require grad, they run, and
a ``backward`` through them raises torch's "Trying to backward through leancompile.<op> but no
autograd formula was registered".
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "HEADER_BYTES",
    "P2P_PROBE",
    "P2P_START",
    "P2P_WAIT",
    "PROBE_REASONS",
    "P2PMismatchError",
    "PendingExchange",
    "group_rank_and_size",
    "exchanges_started",
    "pending_exchanges",
    "probe",
    "start_exchange",
    "wait_exchange",
]

HEADER_BYTES = 128
"""Bytes of header in front of every message's data (16 int64; keeps the data 128-byte
aligned)."""

_MAGIC = 0x4C65616E50325031  # "LeanP2P1"
_DATA, _PROBE = 1, 2
_MAX_DIMS = 9
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)

PROBE_REASONS = {1: "a size not divisible by world size x chunks (this rank's shapes)",
                 2: "its rewrite raised an error on that rank"}
"""Why a rank probes instead of running a schedule (the ``reason`` of ``p2p_probe``)."""


class P2PMismatchError(RuntimeError):
    """A peer sent a message this rank did not expect: the ranks are running different
    schedules (different shapes, or a site rewritten on one rank and not on another)."""


@dataclass
class _Posted:
    works: list
    message: Tensor       # header + data, held until the send has completed
    received: Tensor      # header + data of the receive (empty header when not receiving)
    expect: tuple         # (dtype, shape) of the data to receive
    peer_recv: int
    tag: int
    group_name: str


_table: dict[int, _Posted] = {}
_table_lock = threading.Lock()
_started = 0  # exchanges posted so far; the last one's number is its handle


def exchanges_started() -> int:
    """Exchanges ``p2p_start`` has posted in this process so far (a running total: the
    difference around a call is how many P2P steps it ran)."""
    with _table_lock:
        return _started


def pending_exchanges() -> int:
    """Exchanges posted by ``p2p_start`` in this process and not yet waited (0 after a schedule
    ran to completion)."""
    with _table_lock:
        return len(_table)


def _resolve_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call "
                           "dist.init_process_group(...) before running P2P ops")
    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"unknown process group name {group_name!r}; pass "
                         f"group.group_name of a live process group") from e


@torch._dynamo.assume_constant_result
def group_rank_and_size(group_name: str) -> tuple[int, int]:
    """(this process's rank in the group, group size) for a process-group name. Compiled code
    treats the answer as a constant: schedules bake the rank into the graph."""
    group = _resolve_group(group_name)
    return group.rank(), group.size()


# ---------------------------------------------------------------------------------------------
# Messages: header + data


def _header(kind: int, tag: int, dtype: torch.dtype, shape, reason: int = 0) -> list[int]:
    shape = [int(s) for s in shape]
    code = _DTYPES.index(dtype) if dtype in _DTYPES else 255
    dims = (shape + [0] * _MAX_DIMS)[:_MAX_DIMS]
    return [_MAGIC, kind, tag, code, len(shape), math.prod(shape), reason] + dims


def _message(kind: int, tag: int, data: Tensor | None, like: Tensor, reason: int = 0) -> Tensor:
    """A new buffer holding the header and a copy of ``data`` (None: header only, a probe)."""
    nbytes = 0 if data is None else data.numel() * data.element_size()
    msg = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8, device=like.device)
    shape = () if data is None else data.shape
    header = torch.tensor(_header(kind, tag, like.dtype, shape, reason), dtype=torch.int64)
    msg[:HEADER_BYTES].copy_(header.view(torch.uint8), non_blocking=True)
    if nbytes:
        msg[HEADER_BYTES:].view(data.dtype).view(data.shape).copy_(data)
    return msg


def _data(msg: Tensor, dtype: torch.dtype, shape) -> Tensor:
    return msg[HEADER_BYTES:].view(dtype).view(tuple(shape))


def _describe_header(h: list[int]) -> str:
    if h[0] != _MAGIC:
        return "a message without a leancompile header (a shorter message, or another sender)"
    if h[1] == _PROBE:
        why = PROBE_REASONS.get(h[6], "an unknown reason")
        return (f"a probe: that rank left this collective in place ({why}) while this rank "
                "runs the decomposed schedule")
    dtype = _DTYPES[h[3]] if h[3] < len(_DTYPES) else "an unknown dtype"
    shape = tuple(h[7:7 + min(h[4], _MAX_DIMS)])
    return f"a {shape} {dtype} slice with tag {h[2]}"


def _check(posted: _Posted, *, probing: bool = False) -> None:
    """Raise ``P2PMismatchError`` when the received header is not what this rank expects."""
    if posted.peer_recv < 0:
        return
    dtype, shape = posted.expect
    if probing:
        want = None
    else:
        want = _header(_DATA, posted.tag, dtype, shape)
    got_t = posted.received[:HEADER_BYTES].view(torch.int64)
    if got_t.device.type != "cpu":
        # Keep the wait asynchronous: check on the device (a failed check aborts the kernel
        # stream with this message).
        if want is not None:
            expected = torch.tensor(want, dtype=torch.int64).to(got_t.device, non_blocking=True)
            torch._assert_async((got_t == expected).all(),
                                f"leancompile P2P: message from rank {posted.peer_recv} (tag "
                                f"{posted.tag}) is not the expected {tuple(shape)} {dtype} "
                                "slice: the ranks run different schedules")
        return
    got = got_t.tolist()
    me = _group_rank(posted.group_name)
    if probing:
        if got[0] == _MAGIC and got[1] == _PROBE:
            return
        raise P2PMismatchError(
            f"leancompile P2P: rank {me} of group {posted.group_name!r} left a collective in "
            f"place and probed its neighbours, but rank {posted.peer_recv} sent "
            f"{_describe_header(got)}: that rank rewrote the site into a FlashOverlap "
            "schedule and this one did not. The ranks' shapes differ (every rank must pass "
            "equal shard sizes to a collective), or the ranks compiled the site differently")
    if got == want:
        return
    raise P2PMismatchError(
        f"leancompile P2P: rank {me} of group {posted.group_name!r} expected a "
        f"{tuple(shape)} {dtype} slice with tag {posted.tag} from rank {posted.peer_recv} and "
        f"received {_describe_header(got)}. The ranks run different schedules: their shapes "
        "differ (every rank must pass equal shard sizes to a collective), or they compiled "
        "this site differently (a rewrite on one rank only); compare their explain() reports")


def _group_rank(group_name: str) -> int:
    try:
        return _resolve_group(group_name).rank()
    except Exception:  # noqa: BLE001 - only for an error message
        return -1


def _post(kind: int, data: Tensor | None, like: Tensor, recv_shape: Sequence[int],
          peer_send: int, peer_recv: int, tag: int, group_name: str, reason: int = 0,
          recv_bytes: int | None = None) -> _Posted:
    group = _resolve_group(group_name)
    message = _message(kind, tag, data, like, reason)
    shape = tuple(int(s) for s in recv_shape) if peer_recv >= 0 else (0,)
    if recv_bytes is None:
        recv_bytes = math.prod(shape) * like.element_size()
    received = torch.empty(HEADER_BYTES + (recv_bytes if peer_recv >= 0 else 0),
                           dtype=torch.uint8, device=like.device)
    ops = []
    if peer_send >= 0:
        ops.append(dist.P2POp(dist.isend, message, group=group, group_peer=peer_send, tag=tag))
    if peer_recv >= 0:
        ops.append(dist.P2POp(dist.irecv, received, group=group, group_peer=peer_recv,
                              tag=tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    return _Posted(works=[w for w in works if w is not None], message=message,
                   received=received, expect=(like.dtype, shape), peer_recv=peer_recv,
                   tag=tag, group_name=group_name)


def _complete(posted: _Posted) -> Tensor:
    for work in posted.works:
        work.wait()
    _check(posted)
    dtype, shape = posted.expect
    return _data(posted.received, dtype, shape)


# ---------------------------------------------------------------------------------------------
# The ops


@torch.library.custom_op(
    "leancompile::p2p_start", mutates_args=(),
    schema="(Tensor send, SymInt[] recv_shape, int peer_send, int peer_recv, int tag, "
           "str group_name) -> Tensor")
def _p2p_start(send, recv_shape, peer_send, peer_recv, tag, group_name):
    global _started
    data = send if peer_send >= 0 else None
    posted = _post(_DATA, data, send, recv_shape, peer_send, peer_recv, tag, group_name)
    with _table_lock:
        _started += 1
        handle = _started
        _table[handle] = posted
    return torch.tensor(handle, dtype=torch.int64)


@_p2p_start.register_fake
def _(send, recv_shape, peer_send, peer_recv, tag, group_name):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(
    "leancompile::p2p_wait", mutates_args=(),
    schema="(Tensor handle, SymInt[] recv_shape, ScalarType dtype, Device device, "
           "Tensor[] after) -> Tensor")
def _p2p_wait(handle, recv_shape, dtype, device, after):
    with _table_lock:
        posted = _table.pop(int(handle.item()), None)
    if posted is None:
        raise RuntimeError(f"p2p_wait: no pending exchange with handle {int(handle.item())} "
                           "(waited twice, or started in another process)")
    return _complete(posted)


@_p2p_wait.register_fake
def _(handle, recv_shape, dtype, device, after):
    return torch.empty(recv_shape, dtype=dtype, device=device)


@torch.library.custom_op(
    "leancompile::p2p_probe", mutates_args=(),
    schema="(Tensor x, int peer_send, int peer_recv, int reason, str group_name) -> Tensor")
def _p2p_probe(x, peer_send, peer_recv, reason, group_name):
    # The receive is sized for the largest first message a peer running the schedule could
    # send (a slice of a tensor of x's size), so that it lands here and is reported.
    posted = _post(_PROBE, None, x, (), peer_send, peer_recv, 0, group_name, reason,
                   recv_bytes=x.numel() * x.element_size())
    for work in posted.works:
        work.wait()
    _check(posted, probing=True)
    return x.clone()


@_p2p_probe.register_fake
def _(x, peer_send, peer_recv, reason, group_name):
    return torch.empty_like(x)


P2P_START = torch.ops.leancompile.p2p_start.default
P2P_WAIT = torch.ops.leancompile.p2p_wait.default
P2P_PROBE = torch.ops.leancompile.p2p_probe.default

for _op in (P2P_START, P2P_WAIT, P2P_PROBE):
    torch.fx.node.has_side_effect(_op)
    torch.fx.node.has_side_effect(_op._overloadpacket)


class PendingExchange(NamedTuple):
    """What ``start_exchange`` returns and ``wait_exchange`` takes."""

    handle: Tensor
    send: Tensor
    recv_shape: tuple[int, ...]


def _check_peers(peer_send: int, peer_recv: int, recv_shape) -> None:
    for name, peer in (("peer_send", peer_send), ("peer_recv", peer_recv)):
        if not isinstance(peer, int) or peer < -1:
            raise ValueError(f"{name}={peer!r}: expected a rank in the group, or -1 for none")
    if peer_recv >= 0 and recv_shape is None:
        raise ValueError("recv_shape is required when receiving (peer_recv >= 0)")


def start_exchange(send: Tensor, recv_shape: Sequence[int] | None, peer_send: int,
                   peer_recv: int, group_name: str, *, tag: int = 0) -> PendingExchange:
    """Post "send ``send`` to ``peer_send``" and "receive ``recv_shape`` from ``peer_recv``"
    (group ranks, -1 for none) and return without waiting. The received tensor has ``send``'s
    dtype and device. ``send`` is copied when the exchange is posted: it may be changed or freed
    right after."""
    _check_peers(peer_send, peer_recv, recv_shape)
    shape = tuple(recv_shape) if peer_recv >= 0 else (0,)
    handle = torch.ops.leancompile.p2p_start(send, shape, peer_send, peer_recv, tag, group_name)
    return PendingExchange(handle, send, shape)


def wait_exchange(pending: PendingExchange, after: Sequence[Tensor] = ()) -> Tensor:
    """Wait for an exchange posted by ``start_exchange``; returns the received tensor (empty
    when nothing was received). ``after``: the compute meant to overlap the transfer; the wait
    takes it as (unread) inputs so that no scheduler moves that compute behind the wait.
    Raises ``P2PMismatchError`` when the peer sent something else than the expected slice."""
    return torch.ops.leancompile.p2p_wait(pending.handle, pending.recv_shape,
                                          pending.send.dtype, pending.send.device, list(after))


def probe(x: Tensor, peer_send: int, peer_recv: int, group_name: str, *,
          reason: int = 1) -> Tensor:
    """Exchange a header-only probe on a schedule's first hop (tag 0) and return a copy of
    ``x``; raises ``P2PMismatchError`` when the peer runs a schedule there instead (see the
    module docstring). ``reason``: a key of ``PROBE_REASONS``."""
    _check_peers(peer_send, peer_recv, ())
    if reason not in PROBE_REASONS:
        raise ValueError(f"reason={reason!r}: use one of {sorted(PROBE_REASONS)}")
    return torch.ops.leancompile.p2p_probe(x, peer_send, peer_recv, reason, group_name)
