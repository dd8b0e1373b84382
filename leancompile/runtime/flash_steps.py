"""The step tables of the FlashOverlap schedules: for one rank of a group, which slice each step
computes and which messages it waits for, sends and receives (``flash_ag_steps``,
``flash_rs_steps``).

Pure data, testable without ranks and printable for ``explain`` (``ScheduleTrace.format``);
``flash_schedules.py`` runs them, so what a test or ``explain`` reads is what runs. A
``P2PStep`` is one step of such a point-to-point schedule. Reference: docs/flashoverlap.md,
section 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["P2PStep", "RS_VARIANTS", "ScheduleTrace", "Transfer", "check_positive",
           "flash_ag_steps", "flash_rs_steps"]

RS_VARIANTS = ("ring", "direct")


@dataclass(frozen=True)
class Transfer:
    """One message: ``slice`` = (owning rank, chunk) of the data it carries, ``peer`` = the
    group rank it goes to (send) or comes from (receive), ``tag`` = unique per message of a
    schedule and the same on both ends."""

    slice: tuple[int, int]
    peer: int
    tag: int


@dataclass(frozen=True)
class P2PStep:
    """One step of one rank's point-to-point schedule.

    ``compute``: the (owner, chunk) slice whose matmul runs in this step. ``wait``: receives
    completed in this step. ``send``/``recv``: the exchange posted in this step (one
    ``p2p_start``). Order inside a step: all-gather: wait, post, compute (the waited slice is the
    compute's input, the posted send forwards it); ring reduce-scatter: compute, wait, add the
    received partial sum, post the new sum; direct: compute, post its partial to the owner; its
    last steps: compute the own slice, wait, sum.
    """

    index: int
    compute: tuple[int, int]
    wait: tuple[Transfer, ...] = ()
    send: Transfer | None = None
    recv: Transfer | None = None

    def describe(self) -> str:
        parts = [f"step {self.index}: compute slice {_name(self.compute)}"]
        if self.wait:
            parts.append("wait " + ", ".join(f"{_name(t.slice)} from {t.peer}"
                                             for t in self.wait))
        if self.send is not None:
            parts.append(f"send {_name(self.send.slice)} to {self.send.peer}")
        if self.recv is not None:
            parts.append(f"recv {_name(self.recv.slice)} from {self.recv.peer}")
        return "; ".join(parts)



def _name(s: tuple[int, int]) -> str:
    return f"{s[0]}.{s[1]}"


@dataclass(frozen=True)
class ScheduleTrace:
    """The steps one rank runs: ``kind`` is "flash_ag", "flash_rs" (ring) or "direct_rs"."""

    kind: str
    rank: int
    world_size: int
    chunks_per_rank: int
    steps: tuple[P2PStep, ...]

    def sends(self) -> list[Transfer]:
        return [s.send for s in self.steps if s.send is not None]

    def recvs(self) -> list[Transfer]:
        return [s.recv for s in self.steps if s.recv is not None]

    def format(self) -> str:
        head = (f"{self.kind} rank {self.rank}/{self.world_size}, "
                f"chunks_per_rank={self.chunks_per_rank}, {len(self.steps)} steps")
        return "\n".join([head] + ["  " + s.describe() for s in self.steps])


def _check_rank_world(rank: int, world: int, m: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world} ranks")
    check_positive("chunks_per_rank", m)


def check_positive(name: str, value) -> None:
    """``ValueError`` unless ``value`` is an int >= 1 (``name``: the option, for the message)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an int >= 1")


def flash_ag_steps(rank: int, world: int, m: int = 1) -> ScheduleTrace:
    """Flash-AG on ``rank`` of ``world``: step i*m + c computes chunk c of slice (rank-i) % world.
    Round 0 is the rank's own data (no wait); each slice is forwarded to rank+1 while its matmul
    runs and waited for one round (m steps) later; the last round sends nothing."""
    _check_rank_world(rank, world, m)
    n, r = world, rank
    steps = []
    for i in range(n):
        for c in range(m):
            owner = (r - i) % n
            wait = (Transfer((owner, c), (r - 1) % n, (i - 1) * m + c),) if i > 0 else ()
            send = recv = None
            if i < n - 1:
                send = Transfer((owner, c), (r + 1) % n, i * m + c)
                recv = Transfer(((r - i - 1) % n, c), (r - 1) % n, i * m + c)
            steps.append(P2PStep(i * m + c, (owner, c), wait, send, recv))
    return ScheduleTrace("flash_ag", r, n, m, tuple(steps))


def flash_rs_steps(rank: int, world: int, m: int = 1, variant: str = "ring") -> ScheduleTrace:
    """Flash-RS on ``rank`` of ``world``. Ring: step i*m + c computes the partial of chunk c of
    slice (rank-1-i) % world, adds the sum received from rank-1 (i > 0) and posts the result to
    rank+1 (i < world-1); the last round is the rank's own slice. Direct: step (k-1)*m + c
    computes the partial of slice (rank+k) % world and sends it to that rank, receiving rank-k's
    partial of the own slice; the last m steps compute the own slice and sum."""
    _check_rank_world(rank, world, m)
    if variant not in RS_VARIANTS:
        raise ValueError(f"unknown reduce-scatter variant {variant!r}; use one of {RS_VARIANTS}")
    n, r = world, rank
    steps = []
    if variant == "ring":
        for i in range(n):
            for c in range(m):
                owner = (r - 1 - i) % n
                wait = (Transfer((owner, c), (r - 1) % n, (i - 1) * m + c),) if i > 0 else ()
                send = recv = None
                if i < n - 1:
                    send = Transfer((owner, c), (r + 1) % n, i * m + c)
                    recv = Transfer(((r - 2 - i) % n, c), (r - 1) % n, i * m + c)
                steps.append(P2PStep(i * m + c, (owner, c), wait, send, recv))
        return ScheduleTrace("flash_rs", r, n, m, tuple(steps))
    recvs: dict[int, list[Transfer]] = {c: [] for c in range(m)}
    for k in range(1, n):
        for c in range(m):
            tag = (k - 1) * m + c
            send = Transfer(((r + k) % n, c), (r + k) % n, tag)
            recv = Transfer((r, c), (r - k) % n, tag)
            recvs[c].append(recv)
            steps.append(P2PStep(tag, ((r + k) % n, c), (), send, recv))
    for c in range(m):
        steps.append(P2PStep((n - 1) * m + c, (r, c), tuple(recvs[c])))
    return ScheduleTrace("direct_rs", r, n, m, tuple(steps))

