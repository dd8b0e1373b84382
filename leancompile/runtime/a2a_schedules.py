"""All-to-all schedules on one rank: the Ulysses re-layouts decomposed into P2P exchanges.

An ``all_to_all_single`` with equal splits cuts its input into N pieces along dim 0 and sends
piece j to rank j; piece j of its output came from rank j. For rank r of N,
``flash_all_to_all_compute`` posts the N-1 exchanges of that collective together (step i sends
piece r+i to r+i and receives the piece of r-i), runs a computation on each received piece, own
piece first, then each piece as it arrives (the transfers of the others overlap it), and sends
what each piece's computation produced back to the rank the piece came from as soon as it is
computed (a second all-to-all, of those results). Ulysses attention split by query: the pieces
are query slices, the computation is attention of one query slice over all keys, the result
goes back to the rank that owns those tokens. Only the last return hop is exposed.

Like ``flash_schedules``, this is plain eager code over tensors and the P2P ops of
``p2p.py`` with Python control flow over ints only, so the graph rewrite traces them into the
graph. Numerics: the exchanges move bytes and the computations run on the same rows, so the
results equal the collective's (the per-slice computation may differ from the whole one in the
last bits where a kernel blocks fewer rows differently; ``docs/flashoverlap.md``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .p2p import group_rank_and_size, start_exchange, wait_exchange

__all__ = ["flash_all_to_all_compute", "a2a_steps", "computed_order"]


def a2a_steps(rank: int, world: int) -> list[tuple[int, int]]:
    """``[(send_to, receive_from)]`` of rank ``rank``'s exchanges, step 1..N-1: the pairwise
    schedule, in which every rank sends to one peer and receives from another per step."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    return [((rank + i) % world, (rank - i) % world) for i in range(1, world)]


def _pieces(x: Tensor, n: int, fn: str) -> list[Tensor]:
    if x.dim() == 0 or x.size(0) % n:
        raise ValueError(f"{fn}: dim 0 of the input ({tuple(x.shape)}) must split into {n} "
                         "equal pieces, one per rank")
    length = x.size(0) // n
    return [x.narrow(0, j * length, length) for j in range(n)]


def flash_all_to_all_compute(x: Tensor, compute: Callable[[Tensor, int], tuple], *,
                             group_name: str, tag: int = 0) -> tuple[list, list, list]:
    """Exchange ``x``'s pieces as ``all_to_all_single`` does, run ``compute(piece, j)`` on each
    received piece (j: the rank it came from; own first, then in arrival order:
    ``computed_order``), and send the last output of each ``compute`` back to the rank its
    piece came from, as a second ``all_to_all_single`` of those outputs would.

    Returns ``(received, outputs, back)``, each indexed by rank: ``received[j]`` the piece from
    rank j, ``outputs[j]`` what ``compute`` returned for it, ``back[j]`` the piece rank j sent
    back."""
    rank, n = group_rank_and_size(group_name)
    pieces = _pieces(x, n, "flash_all_to_all_compute")
    steps = a2a_steps(rank, n)
    shape = tuple(pieces[0].shape)
    # Tags: step i of the exchange i-1, of the return N-1+i-1 (per site, as the other
    # schedules: messages of one pair and tag arrive in order). Step 1's hop and tag 0 are
    # where a rank that left the site in place sends its probe (p2p.probe).
    posted = [start_exchange(pieces[dst], shape, dst, src, group_name, tag=tag + i - 1)
              for i, (dst, src) in enumerate(steps, start=1)]
    received = {rank: pieces[rank]}
    outputs = {rank: tuple(compute(pieces[rank], rank))}
    done = [t for t in outputs[rank] if isinstance(t, Tensor)]
    returned = []
    for i, ((dst, src), exchange) in enumerate(zip(steps, posted), start=1):
        received[src] = wait_exchange(exchange, after=done)
        outputs[src] = tuple(compute(received[src], src))
        done = [t for t in outputs[src] if isinstance(t, Tensor)]
        send = outputs[src][-1]
        # Back to src (who sent this piece); from dst comes the piece it computed for us.
        returned.append((dst, start_exchange(send, tuple(send.shape), src, dst, group_name,
                                             tag=tag + n - 1 + i - 1)))
    back = {rank: outputs[rank][-1]}
    for peer, exchange in returned:
        back[peer] = wait_exchange(exchange, after=done)
        done = []
    return ([received[j] for j in range(n)], [outputs[j] for j in range(n)],
            [back[j] for j in range(n)])


def computed_order(rank: int, world: int) -> list[int]:
    """The order ``flash_all_to_all_compute`` computes the pieces in: own, then r-1, r-2, ..."""
    return [rank] + [src for _, src in a2a_steps(rank, world)]
