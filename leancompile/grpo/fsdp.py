"""Compiler-native fully sharded data parallel for the GRPO trainer (``parallel="fsdp"``).

Every trainable parameter of the policy is split along dim 0 over the process group, the way
``DTensor``'s ``Shard(0)`` splits it (``torch.chunk``: ``ceil(n / R)`` rows per rank, the last
ranks shorter or empty). Each rank keeps only its part, padded to ``ceil(n / R)`` rows so that
every rank's part has one shape: the policy's parameter *is* that padded part (same name), and
the optimizer only ever sees parts. ``dtensors()`` gives the parts as ``DTensor`` views
(``Shard(0)`` on a 1-D mesh of the group) for ``torch.distributed.checkpoint``.

The gathers are inside the traced step. ``GatheredPolicy.velocity`` all-gathers every part
with the autograd-aware functional collective and runs the policy on the full tensors
(``torch.func.functional_call``), so Dynamo and AOTAutograd put the gathers in the step's
forward graph and their gradients, reduce-scatters, in its backward graph, where the
compiler's passes see them::

    forward graph (per parameter):                 backward graph (per parameter):
        g = all_gather_into_tensor(part, R, group)     d = reduce_scatter_tensor(pad(dw), sum)
        w = wait_tensor(g)[:n]                         d_part = wait_tensor(d)
        y = x @ w.T ...                                return d_part

Retain keeps the saved tensors of every trained step until the update; the partitioner would
save the gathered weights in them (a full model per kept step). Its graphs are captured with
``StepConfig(reshard_after_forward=True)`` instead (``GRPOConfig.reshard_after_forward``,
``passes/regather_params.py``): the forward saves the part and the backward gathers again::

    retain's backward graph (per parameter the backward reads):
        g = all_gather_into_tensor(part, R, group)
        w = wait_tensor(g)[:n]
        dx = dy @ w ...; d = reduce_scatter_tensor(pad(dw), sum) ...

``torch.distributed.fsdp.fully_shard`` keeps its gathers in eager hooks around the module
instead, out of reach of any graph pass: a model already wrapped in it can be trained with
``parallel="ddp"`` semantics only if it is not also sharded (see the docs).

Because the collectives are in every call of the step, every rank must make the same calls in
the same order: the trainer pads each rank's calls to the union of all ranks' calls with a
stand-in row whose loss is times zero (``leancompile/grpo/fsdp_padding.py``) and compares the planned
calls across the ranks before each rollout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .policy_step import Velocity

__all__ = ["ParameterSharding", "GatheredPolicy", "sharding_of", "full_shapes",
           "shard_trainable"]


def _owner(module: nn.Module, name: str):
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


class ParameterSharding:
    """The trainable parameters of ``policy``, replaced in place by this rank's padded
    ``Shard(0)`` parts (module docstring). Collective-free: every rank must hold the same
    values before (the trainer broadcasts from rank 0 first)."""

    def __init__(self, policy: nn.Module, group, *, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.shapes: dict[str, torch.Size] = {}
        """Full shape of every sharded parameter."""
        self.rows: dict[str, int] = {}
        """Rows of each rank's (padded) part."""
        trainable = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        flat = [n for n, p in trainable if p.dim() == 0]
        if flat:  # checked before anything is replaced: a refused policy stays whole
            raise ValueError(
                f"parallel='fsdp' shards parameters along dim 0, but {flat} are 0-dim "
                "tensors; make them shape [1] or freeze them (requires_grad=False)")
        # Tied parameters (one tensor under several names): every name gets the same part,
        # so they stay tied (functional_call then gathers it once for all of them).
        aliases: dict[int, list[str]] = {}
        for name, p in policy.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self.aliases: dict[str, list[str]] = {}
        """Other names of each tied sharded parameter."""
        for name, p in trainable:
            rows = math.ceil(p.shape[0] / world_size)
            full = p.detach()
            if rows * world_size != p.shape[0]:
                full = torch.cat([full, full.new_zeros(rows * world_size - p.shape[0],
                                                       *p.shape[1:])])
            part = nn.Parameter(full[rank * rows:(rank + 1) * rows].clone(),
                                requires_grad=True)
            for alias in aliases[id(p)]:
                module, leaf = _owner(policy, alias)
                setattr(module, leaf, part)
            if len(aliases[id(p)]) > 1:
                self.aliases[name] = [a for a in aliases[id(p)] if a != name]
            self.shapes[name] = p.shape
            self.rows[name] = rows

    def gather(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """The full parameter from this rank's part (traceable; backward: reduce-scatter)."""
        import torch.distributed._functional_collectives as funcol

        full = funcol.all_gather_tensor_autograd(part, 0, self.group)
        n = self.shapes[name][0]
        return full if full.shape[0] == n else full[:n]

    def full_parameters(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        """Every sharded parameter gathered (eager, no grad): for saving a full model."""
        out = {}
        params = dict(policy.named_parameters())
        with torch.no_grad():
            for name in self.shapes:
                part = params[name].detach().contiguous()
                parts = [torch.empty_like(part) for _ in range(self.world_size)]
                dist.all_gather(parts, part, group=self.group)
                out[name] = torch.cat(parts)[:self.shapes[name][0]].clone()
        return out

    def dtensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's parts as ``DTensor`` ``Shard(0)`` views (``torch.chunk`` layout, the
        padding cut off), for ``torch.distributed.checkpoint``."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        params = dict(policy.named_parameters())
        device = next(iter(params.values())).device.type
        mesh = DeviceMesh.from_group(self.group, device)
        out = {}
        for name, shape in self.shapes.items():
            rows = self.rows[name]
            valid = max(0, min(rows, shape[0] - self.rank * rows))
            local = params[name].detach()[:valid]  # shares the part's memory (loads land in it)
            out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                           shape=shape, stride=torch.empty(shape,
                                                                           device="meta").stride())
        return out


class GatheredPolicy(nn.Module):
    """``policy`` as the step sees it under ``parallel="fsdp"``: ``velocity`` gathers the
    sharded parameters inside the traced call and runs the policy on them."""

    def __init__(self, policy: nn.Module, sharding: ParameterSharding):
        super().__init__()
        self.policy = policy
        self.sharding = sharding
        self._call = [Velocity(policy)]  # not a submodule: the parameters are the policy's

    @property
    def sigmas(self):
        return self.policy.sigmas

    def velocity(self, latents, step_index, conditions):
        full = {f"policy.{name}": self.sharding.gather(name, p)
                for name, p in self.policy.named_parameters() if name in self.sharding.shapes}
        return torch.func.functional_call(self._call[0], full, (latents, step_index,
                                                                conditions), strict=False)


def sharding_of(policy: nn.Module) -> ParameterSharding | None:
    """The ``ParameterSharding`` a ``parallel="fsdp"`` trainer made of ``policy``'s trainable
    parameters (None: they are whole)."""
    return getattr(policy, "_leancompile_sharding", None)


def full_shapes(policy: nn.Module) -> dict[str, torch.Size]:
    """Every parameter's full shape (a sharded one's before it was split)."""
    held = sharding_of(policy)
    return {n: held.shapes[n] if held is not None and n in held.shapes else p.shape
            for n, p in policy.named_parameters()}


def shard_trainable(policy: nn.Module, optimizer, parallel) -> ParameterSharding:
    """``parallel="fsdp"``: replace the trainable parameters of ``policy`` by this rank's
    shards over ``parallel``'s group (a ``DataParallel``), and point a fresh optimizer at them
    (it must not have taken a step yet: its state would be for the full parameters). A policy
    an earlier trainer sharded keeps its shards."""
    before = dict(policy.named_parameters())
    if optimizer is not None and len(optimizer.state):
        raise ValueError(
            "parallel='fsdp' shards the policy's parameters when the trainer is built, but "
            "the optimizer already holds state for the full parameters; build the trainer "
            "with a fresh optimizer (or load a checkpoint after building it)")
    held = sharding_of(policy)
    if held is not None:  # a second trainer on a policy an earlier one sharded
        if (held.group, held.world_size) != (parallel.group, parallel.world_size):
            raise ValueError("the policy is already sharded over another process group; "
                             "build the trainer with that group (process_group=...)")
        return held
    sharding = ParameterSharding(policy, parallel.group, rank=parallel.rank,
                                 world_size=parallel.world_size)
    policy._leancompile_sharding = sharding
    after = dict(policy.named_parameters())
    swap = {id(before[n]): after[n] for n in sharding.shapes}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
    return sharding
