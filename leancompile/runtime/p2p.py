"""Point-to-point (P2P) ops that can live in FX graphs: the steps of the FlashOverlap schedules.

Three ops, registered with ``torch.library.custom_op`` under ``leancompile::`` and keyed by the
process-group *name* (``group.group_name``, as functional collectives are)::

    handle = leancompile::p2p_start(send, recv_shape, peer_send, peer_recv, tag, group_name)
    y = ...compute that does not need the received data...
    recv = leancompile::p2p_wait(handle, send, recv_shape, after=[y])

    recv = leancompile::ring_exchange(send, recv_shape, peer_send, peer_recv, tag, group_name)

``p2p_start`` posts "send ``send`` to ``peer_send``" and "receive a ``recv_shape`` tensor of
``send``'s dtype from ``peer_recv``" together (``dist.batch_isend_irecv``) and returns at once with
a handle (a 0-dim int64 CPU tensor naming the posted work in a table of this module).
``p2p_wait`` waits for both and returns the received tensor. ``ring_exchange`` is the two in one
blocking node. Peers are ranks *within the group*; -1 means "no send" or "no receive" (a receive
of nothing returns an empty tensor). Send and receive of one op carry the same ``tag``: give every
message of a schedule its own tag so that matching never depends on the order the ops run in.

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

* Dead-code elimination: the three ops are registered with ``torch.fx.node.has_side_effect``.
  In torch 2.13 both ``Graph.eliminate_dead_code`` and Inductor's ``FallbackKernel.
  has_side_effects`` ask ``torch._library.utils.is_impure``, which consults that set, so a
  send-only step whose output nobody reads is kept. No effect tokens: they would thread a token
  through the graph (``with_effects`` wrappers) and hide the ops from the matchers.
* Lifetimes: ``p2p_wait`` takes ``send`` as an argument although it only needs its dtype and
  device, so that in a compiled graph the sent tensor stays alive (Inductor does not reuse its
  memory) until the send has completed. The received buffer is allocated by ``p2p_start`` and
  returned by ``p2p_wait``; no output aliases an input, as ``custom_op`` requires.
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

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "P2P_START",
    "P2P_WAIT",
    "RING_EXCHANGE",
    "PendingExchange",
    "group_rank_and_size",
    "pending_exchanges",
    "ring_exchange",
    "start_exchange",
    "wait_exchange",
]


@dataclass
class _Posted:
    works: list
    recv: Tensor
    send: Tensor  # held until the send has completed


_table: dict[int, _Posted] = {}
_table_lock = threading.Lock()
_ids = itertools.count(1)


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


def _post(send: Tensor, recv_shape: Sequence[int], peer_send: int, peer_recv: int, tag: int,
          group_name: str) -> _Posted:
    group = _resolve_group(group_name)
    send = send.contiguous()
    recv = send.new_empty(list(recv_shape) if peer_recv >= 0 else [0])
    ops = []
    if peer_send >= 0:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=peer_send, tag=tag))
    if peer_recv >= 0:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=peer_recv, tag=tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    return _Posted(works=[w for w in works if w is not None], recv=recv, send=send)


def _complete(posted: _Posted) -> Tensor:
    for work in posted.works:
        work.wait()
    return posted.recv


@torch.library.custom_op(
    "leancompile::p2p_start", mutates_args=(),
    schema="(Tensor send, SymInt[] recv_shape, int peer_send, int peer_recv, int tag, "
           "str group_name) -> Tensor")
def _p2p_start(send, recv_shape, peer_send, peer_recv, tag, group_name):
    posted = _post(send, recv_shape, peer_send, peer_recv, tag, group_name)
    with _table_lock:
        handle = next(_ids)
        _table[handle] = posted
    return torch.tensor(handle, dtype=torch.int64)


@_p2p_start.register_fake
def _(send, recv_shape, peer_send, peer_recv, tag, group_name):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(
    "leancompile::p2p_wait", mutates_args=(),
    schema="(Tensor handle, Tensor send, SymInt[] recv_shape, Tensor[] after) -> Tensor")
def _p2p_wait(handle, send, recv_shape, after):
    with _table_lock:
        posted = _table.pop(int(handle.item()), None)
    if posted is None:
        raise RuntimeError(f"p2p_wait: no pending exchange with handle {int(handle.item())} "
                           "(waited twice, or started in another process)")
    return _complete(posted)


@_p2p_wait.register_fake
def _(handle, send, recv_shape, after):
    return send.new_empty(recv_shape)


@torch.library.custom_op(
    "leancompile::ring_exchange", mutates_args=(),
    schema="(Tensor send, SymInt[] recv_shape, int peer_send, int peer_recv, int tag, "
           "str group_name) -> Tensor")
def _ring_exchange(send, recv_shape, peer_send, peer_recv, tag, group_name):
    return _complete(_post(send, recv_shape, peer_send, peer_recv, tag, group_name))


@_ring_exchange.register_fake
def _(send, recv_shape, peer_send, peer_recv, tag, group_name):
    return send.new_empty(recv_shape)


P2P_START = torch.ops.leancompile.p2p_start.default
P2P_WAIT = torch.ops.leancompile.p2p_wait.default
RING_EXCHANGE = torch.ops.leancompile.ring_exchange.default

for _op in (P2P_START, P2P_WAIT, RING_EXCHANGE):
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
    dtype and device."""
    _check_peers(peer_send, peer_recv, recv_shape)
    shape = tuple(recv_shape) if peer_recv >= 0 else (0,)
    handle = torch.ops.leancompile.p2p_start(send, shape, peer_send, peer_recv, tag, group_name)
    return PendingExchange(handle, send, shape)


def wait_exchange(pending: PendingExchange, after: Sequence[Tensor] = ()) -> Tensor:
    """Wait for an exchange posted by ``start_exchange``; returns the received tensor (empty
    when nothing was received). ``after``: the compute meant to overlap the transfer; the wait
    takes it as (unread) inputs so that no scheduler moves that compute behind the wait."""
    return torch.ops.leancompile.p2p_wait(pending.handle, pending.send, pending.recv_shape,
                                          list(after))


def ring_exchange(send: Tensor, recv_shape: Sequence[int] | None, peer_send: int,
                  peer_recv: int, group_name: str, *, tag: int = 0) -> Tensor:
    """Send ``send`` to ``peer_send`` and receive a ``recv_shape`` tensor from ``peer_recv``,
    posted together, and return the received tensor (blocking: one graph node)."""
    _check_peers(peer_send, peer_recv, recv_shape)
    shape = tuple(recv_shape) if peer_recv >= 0 else (0,)
    return torch.ops.leancompile.ring_exchange(send, shape, peer_send, peer_recv, tag,
                                               group_name)
