"""The trainer's data-parallel runtime: one object per ``GRPOTrainer`` that knows the process
group, the shared layout's worker sub-communicators, and the few collectives GRPO needs.

``DataParallel(None)`` is a single process: every method is local and nothing is counted.
``DataParallel("ddp", group)`` replicates the parameters (broadcast from the group's rank 0 at
set-up, as ``DistributedDataParallel`` does) and sums the gradients of the ranks' rows with one
flat all-reduce per update (``sync_gradients``; Reweight with ``GRPOConfig.grad_sync="group"``:
one per round of prompt groups): the per-sample gradient buffers of Reweight and the kept
activations of Retain stay rank-local, and a gradient is only reduced once its samples'
advantages are in it. Every collective the trainer issues goes through here, so their number and
bytes are counted: ``sync_collectives`` / ``sync_bytes`` (gradient reductions) and
``other_collectives`` / ``other_bytes`` (rewards, checks, metrics).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .layout import worker_groups

__all__ = ["PARALLEL", "AllRanks", "DataParallel", "PeerFailureError", "RankMismatchError",
           "comm_device", "device_types"]

PARALLEL = (None, "ddp", "fsdp")
# What the c10d backends say when a peer is gone or a collective timed out.
_PEER_FAILURES = ("Connection reset", "onnection closed", "Timed out", "timed out",
                  "ncclRemoteError", "communicator was aborted")


def device_types(group) -> set[str]:
    """The device types ``group``'s backends take tensors of: ``{"cpu"}`` under gloo,
    ``{"cuda"}`` under NCCL, both for ``"cpu:gloo,cuda:nccl"`` (what ``init_process_group()``
    without a backend makes)."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):
        config = str(dist.get_backend(group))
    types = set()
    for part in config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        types.add(device or ("cuda" if backend == "nccl" else "cpu"))
    return types


def comm_device(group) -> torch.device:
    """Where the trainer's own tensors (counts, checks, scores) go for ``group``'s
    collectives: the host where a backend takes host tensors, else the group's CUDA device
    (bound with ``init_process_group(device_id=...)``, or the current one)."""
    if "cpu" in device_types(group):
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


class RankMismatchError(RuntimeError):
    """The ranks of a data-parallel trainer were given different configurations or inputs."""


class PeerFailureError(RuntimeError):
    """A collective of the data-parallel trainer did not complete: a peer died or hangs."""


class DataParallel:
    def __init__(self, parallel: str | None, group=None, *, group_size: int = 1,
                 timeout_s: float | None = 600.0, label: str = "data-parallel trainer"):
        self.label = label
        """What the group is, in errors."""
        if parallel not in PARALLEL:
            raise ValueError(f"parallel={parallel!r}; use one of {PARALLEL}")
        self.parallel = parallel
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 (or None: the process "
                             "group's own timeout)")
        self.timeout_s = timeout_s
        self.sync_collectives = self.sync_bytes = 0
        self.other_collectives = self.other_bytes = 0
        if parallel is None:
            self.group, self.rank, self.world_size, self._sub = None, 0, 1, {}
            self.device, self._types = torch.device("cpu"), {"cpu"}
            return
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"parallel={parallel!r} needs torch.distributed: call "
                "dist.init_process_group(...) first (torchrun sets the environment; "
                "backend 'gloo' on CPU, 'nccl' on GPU)")
        self.group = dist.group.WORLD if group is None else group
        self.device = comm_device(self.group)
        """Where the trainer's own tensors (counts, checks, scores) go for a collective: the
        host, unless the group's backends take only CUDA tensors (NCCL alone)."""
        self._types = device_types(self.group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._globals = dist.get_process_group_ranks(self.group)
        # The shared layout's worker groups. Over the whole world they are created in the same
        # order on every rank (new_group is collective over the default group). Over a part of
        # it (the data-parallel group of a mesh whose other groups run the same code on other
        # ranks), each rank creates only its own, synchronizing with their members alone.
        self._sub = {}
        whole = self.world_size == dist.get_world_size()
        for ranks in worker_groups(group_size, self.world_size):
            if len(ranks) == self.world_size:
                self._sub[ranks] = self.group
            elif len(ranks) > 1 and whole:
                self._sub[ranks] = dist.new_group([self._globals[r] for r in ranks])
            elif len(ranks) > 1 and self.rank in ranks:
                self._sub[ranks] = dist.new_group([self._globals[r] for r in ranks],
                                                  use_local_synchronization=True)

    @property
    def distributed(self) -> bool:
        return self.parallel is not None and self.world_size > 1

    def _group_for(self, ranks: Sequence[int] | None):
        if ranks is None or len(ranks) == self.world_size:
            return self.group
        ranks = tuple(ranks)
        if ranks not in self._sub:
            raise ValueError(f"no sub-communicator for ranks {ranks}")
        return self._sub[ranks]

    def _wait(self, work, what: str) -> None:
        """Wait for a collective; a peer that died or hangs becomes an error naming what this
        rank was waiting for, within ``timeout_s``."""
        try:
            if self.timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - re-raised with what the user can do
            raise PeerFailureError(
                f"rank {self.rank} of {self.world_size}: {what} did not complete "
                f"(timeout_s={self.timeout_s}): a peer rank died, hangs or is running "
                f"something else ({type(e).__name__}: {str(e)[:300]}). The process group is "
                "no longer usable: exit this process (torchrun restarts or ends the job) and "
                "resume from the last checkpoint (GRPOTrainer.load)") from e

    @contextlib.contextmanager
    def graph_collectives(self):
        """Around code whose compiled graphs hold collectives (``parallel="fsdp"``): a
        collective that failed there because a peer died or hung (the backend's own error,
        raised within the process group's timeout) becomes ``PeerFailureError`` with what to
        do."""
        try:
            yield
        except PeerFailureError:
            raise
        except RuntimeError as e:
            text = str(e)
            if not self.distributed or not (
                    isinstance(e, getattr(dist, "DistNetworkError", ())) or any(
                        s in text for s in _PEER_FAILURES)):
                raise
            raise PeerFailureError(
                f"rank {self.rank} of {self.world_size}: a collective inside the step's "
                f"compiled graphs (parameter gathers / gradient reductions) failed: a peer "
                f"rank died, hangs or is running something else ({type(e).__name__}: "
                f"{text[:300]}). These collectives "
                "wait for the process group's timeout (init_process_group(timeout=...)), not "
                "timeout_s. The process group is no longer usable: exit this process and "
                "resume from the last checkpoint (GRPOTrainer.load)") from e

    def barrier(self) -> None:
        if self.distributed:
            self._wait(dist.barrier(group=self.group, async_op=True), "a barrier")
            self.other_collectives += 1

    def _all_reduce(self, tensor, op=None, ranks=None, *, sync=False, what="an all-reduce"):
        if not self.distributed or (ranks is not None and len(ranks) <= 1):
            return tensor
        # (a tensor on a device the backends take stays there: gradients on the GPU to NCCL)
        moved = tensor if tensor.device.type in self._types else tensor.to(self.device)
        work = dist.all_reduce(moved, op=dist.ReduceOp.SUM if op is None else op,
                               group=self._group_for(ranks), async_op=True)
        self._wait(work, what)
        if moved is not tensor:
            tensor.copy_(moved)
        nbytes = tensor.numel() * tensor.element_size()
        if sync:
            self.sync_collectives += 1
            self.sync_bytes += nbytes
        else:
            self.other_collectives += 1
            self.other_bytes += nbytes
        return tensor

    # -- set-up checks ------------------------------------------------------------------------
    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Parameters and buffers of ``module`` from the group's rank 0 (as DDP's
        construction does)."""
        if not self.distributed:
            return
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                self._wait(dist.broadcast(t.data, group_src=0, group=self.group,
                                          async_op=True), "the parameter broadcast")

    def check_same(self, what: str, value: str, *, fix: str | None = None) -> None:
        """Raise ``RankMismatchError`` naming the ranks when ``value`` differs across ranks."""
        if not self.distributed:
            return
        digest = int.from_bytes(hashlib.sha256(value.encode()).digest()[:7], "little")
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        self._all_reduce(t, dist.ReduceOp.MAX)
        if t[0].item() == digest and -t[1].item() == digest:
            return
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self.group)
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(everyone):
            groups.setdefault(v, []).append(self._globals[r])
        detail = "; ".join(f"ranks {ranks}: {v[:300]}" for v, ranks in groups.items())
        raise RankMismatchError(
            f"{what} differs across the {self.world_size} ranks of the {self.label} "
            f"({detail}; global ranks). " + (
                fix or "Every rank must build the trainer with the same config and pass the "
                "same global batch of conditions and the same generator seed"))

    # -- collectives of a step ---------------------------------------------------------------
    def gather_rows(self, values: torch.Tensor, owned: torch.Tensor,
                    ranks: Sequence[int] | None = None) -> torch.Tensor:
        """``values [N, ...]`` with the rows ``owned [N]`` (bool) filled by this rank: returns
        every rank's rows (a sum over ``ranks``, others contributing zeros)."""
        if not self.distributed:
            return values
        mask = owned.reshape((-1,) + (1,) * (values.ndim - 1))
        out = torch.where(mask.to(values.device), values,
                          torch.zeros((), dtype=values.dtype, device=values.device))
        return self._all_reduce(out.contiguous(), ranks=ranks,
                                what="gathering rewards / log-probs")

    def broadcast_int(self, value: int) -> int:
        """The group's rank 0's ``value`` (a non-negative integer below 2**62) on every
        rank."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._wait(dist.broadcast(t, group_src=0, group=self.group, async_op=True),
                   "a broadcast from rank 0")
        self.other_collectives += 1
        self.other_bytes += 8
        return int(t.item())

    def all_max(self, value: float) -> float:
        if not self.distributed:
            return value
        return self._all_reduce(torch.tensor([value], dtype=torch.float64),
                                dist.ReduceOp.MAX).item()

    def all_min(self, value: float) -> float:
        if not self.distributed:
            return value
        return self._all_reduce(torch.tensor([value], dtype=torch.float64),
                                dist.ReduceOp.MIN).item()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        return self._all_reduce(torch.tensor(list(values), dtype=torch.float64)).tolist()

    def reduce_scatter_grads(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``parallel="fsdp"``: ``full`` maps names to rank-local gradients of whole (padded,
        ``[R * c, ...]``) parameters; returns each rank's ``[c, ...]`` part of their sum over
        the ranks, with one reduce-scatter of one flat buffer per dtype and device (counted as
        gradient syncs)."""
        if not full:
            return {}
        out: dict[str, torch.Tensor] = {}
        buckets: dict = {}
        for name, g in full.items():
            buckets.setdefault((g.dtype, g.device), []).append(name)
        world = self.world_size
        for names in buckets.values():
            chunks = {n: full[n].reshape(world, -1) for n in names}
            flat = torch.cat([torch.cat([chunks[n][r] for n in names]) for r in range(world)])
            part = flat.new_empty(flat.numel() // world)
            # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor deprecated)
            reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            self._wait(reduce_scatter(part, flat, group=self.group, async_op=True),
                       "the gradient reduce-scatter")
            self.sync_collectives += 1
            self.sync_bytes += flat.numel() * flat.element_size()
            offset = 0
            for n in names:
                shape = (full[n].shape[0] // world,) + tuple(full[n].shape[1:])
                size = chunks[n].shape[1]
                out[n] = part[offset:offset + size].view(shape)
                offset += size
        return out

    def sync_gradients(self, grads: dict[str, torch.Tensor]) -> tuple[int, int]:
        """Sum ``grads`` over the ranks in place: one all-reduce of one flat buffer per dtype
        and device. Returns (collectives, bytes) issued."""
        if not self.distributed or not grads or self.parallel == "fsdp":
            return 0, 0  # fsdp: the step's backward graphs reduce-scatter (counted there)
        count, nbytes = self.sync_collectives, self.sync_bytes
        buckets: dict = {}
        for name, g in grads.items():
            buckets.setdefault((g.dtype, g.device), []).append(name)
        for names in buckets.values():
            flat = torch.cat([grads[n].reshape(-1) for n in names])
            self._all_reduce(flat, sync=True, what="the gradient all-reduce")
            offset = 0
            for n in names:
                g = grads[n]
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        return self.sync_collectives - count, self.sync_bytes - nbytes


class AllRanks:
    """Every rank of a trainer whose ranks form a mesh: data parallelism over ``groups[0]``
    and, with a sequence-parallel policy, the sequence-parallel group ``groups[1]`` (its
    ranks run the same rows). An agreement over the whole mesh is one over each group in
    turn: after a max over the ``dp`` groups, the ranks of an ``sp`` group hold the maxima of
    their rows of the mesh, and a max over the ``sp`` group gives every rank the mesh's (min
    likewise; a sum of gradients likewise). ``None`` groups and one-rank groups are
    skipped."""

    def __init__(self, *groups: DataParallel | None):
        self.groups = [g for g in groups if g is not None and g.distributed]

    @property
    def distributed(self) -> bool:
        return bool(self.groups)

    def check_same(self, what: str, value: str, *, fix: str | None = None) -> None:
        """``RankMismatchError`` on every rank of the mesh when ``value`` differs anywhere (a
        rank of a group without the difference learns it too, instead of waiting in its next
        collective for peers that raised)."""
        if len(self.groups) == 1:
            return self.groups[0].check_same(what, value, fix=fix)
        self.check_each([(g, what, value) for g in self.groups], fix=fix)

    def check_each(self, checks, *, fix: str | None = None) -> None:
        """``checks``: (group, what, value) triples, each checked within its group; then
        ``RankMismatchError`` on every rank of the mesh when any of them differs (this rank's
        own error, or one saying that another rank's names the problem)."""
        error = None
        for group, what, value in checks:
            try:
                group.check_same(what, value, fix=fix)
            except RankMismatchError as e:
                error = error or e
        if self.all_max(float(error is not None)) > 0:
            raise error if error is not None else RankMismatchError(
                "another rank of the (dp, sp) mesh found a mismatch (its error names it); every "
                "rank stops here")

    def all_max(self, value: float) -> float:
        for g in self.groups:
            value = g.all_max(value)
        return value

    def all_min(self, value: float) -> float:
        for g in self.groups:
            value = g.all_min(value)
        return value

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """The mesh's first rank's parameters and buffers on every rank (rank 0 of each
        group in turn)."""
        for g in self.groups:
            g.broadcast_module(module)

    def sync_gradients(self, grads: dict[str, torch.Tensor]) -> tuple[int, int]:
        """``grads`` summed over the mesh in place (one flat all-reduce per group and dtype);
        (collectives, bytes) issued."""
        count = nbytes = 0
        for g in self.groups:
            c, b = g.sync_gradients(grads)
            count, nbytes = count + c, nbytes + b
        return count, nbytes
