"""The trainer's compiled policy step, and the schedule it runs: the three plans built from
the step's own graphs and ``auto``'s choice among them.

``compile_policy_step`` makes the ``LeanStep`` of ``PolicyStep`` (one per condition keys,
partitioner budget and ``regather``). ``plan_schedules`` captures its graphs for one batch,
costs them (bytes kept per call, FLOPs, simulated seconds on a device model) and builds the
plans of ``passes/lean_grpo.py``; ``auto`` picks one, trying smaller partitioner budgets for
Retain when it does not fit. With several ranks ``agree_schedule`` makes every rank run the
same schedule and graphs (their collectives follow them): the most frugal choice and the
smallest partitioner budget any rank needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..capture import RANDOM_FIXES, RandomOpInGraphError
from ..lean import LeanStep, StepConfig
from ..options import CompileOptions
from ..passes.lean_grpo import (SchedulePlan, StepCosts, build_schedule_plans,
                                choose_schedule, graph_flops, reweight_rows_per_backward)
from .fsdp import GatheredPolicy, full_shapes
from .policy_step import PolicyStep

__all__ = ["ScheduleChoice", "compile_policy_step", "regathers", "step_graph", "step_costs",
           "grad_bytes", "plan_schedules", "agree_schedule"]


@dataclass(frozen=True, kw_only=True)
class ScheduleChoice:
    """The schedule one rollout runs, and why."""

    schedule: str
    reason: str
    plans: dict[str, SchedulePlan]
    partitioner_budget: float | None = None
    """Retain's partitioner activation budget (None: the partitioner's default)."""


def compile_policy_step(policy: nn.Module, config, keys, *, sharding=None,
                        partitioner_budget: float | None = None,
                        regather: bool = False) -> LeanStep:
    """The policy step compiled with LeanGRPO schedules (``config``: the ``GRPOConfig``;
    ``sharding``: ``parallel="fsdp"``'s ``ParameterSharding``; ``regather``: the parameters
    gathered again in the backward, ``regathers``)."""
    cfg = config
    step_policy = policy if sharding is None else GatheredPolicy(policy, sharding)
    module = PolicyStep(step_policy, sde=cfg.sde, eta=cfg.eta, condition_keys=keys,
                        with_kl=cfg.beta > 0)
    # Reweight's update calls before a sample's last hand autograd no zeros (.grad is
    # read after the last), unless a DistributedDataParallel inside the policy needs a
    # gradient for every parameter in every backward.
    from torch.nn.parallel import DistributedDataParallel

    ddp = isinstance(policy, torch.nn.Module) and any(
        isinstance(m, DistributedDataParallel) for m in policy.modules())
    return LeanStep(
        module, options=CompileOptions(
            compiler=cfg.compiler, schedule="auto", overlap=cfg.overlap,
            bucket_cap_mb=cfg.bucket_cap_mb if sharding is not None else None,
            gather_at_use=sharding is not None),
        config=StepConfig(schedule="retain", partitioner_budget=partitioner_budget,
                          reshard_after_forward=regather, sample_output=0,
                          sample_arg="prev_sample",
                          zero_grads=ddp, defer_reductions=sharding is not None,
                          fallback="recompute" if sharding is None else "raise"))


def regathers(config, sharding, schedule: str) -> bool:
    """Whether ``schedule``'s step graphs gather the parameters again in the backward
    (``GRPOConfig.reshard_after_forward``: Retain under ``fsdp``)."""
    return sharding is not None and config.reshard_after_forward and schedule == "retain"


def step_graph(lean: LeanStep, example):
    """The one graph ``lean`` compiles to for ``example`` (``(args, kwargs)``)."""
    args, kwargs = example
    graphs = lean.plan(*args, **kwargs)
    if len(graphs) != 1:
        raise RuntimeError(f"the policy step compiled to {len(graphs)} graphs (a graph "
                           "break); the trainer plans from one")
    return graphs[0]


def step_costs(graph, num_rows: int, *, device: str | None, cache: dict) -> StepCosts:
    """The graphs' per-call costs for ``num_rows`` rows (``device``: ``GRPOConfig.device``).
    FLOPs are counted once per graph and batch size (``cache``): counting runs the graphs on
    fake tensors, which costs more than a small model's step."""
    key = (id(graph), num_rows)
    if key not in cache:
        symbol = graph.batch_symbol
        seconds = {}
        if device is not None:
            from ..sim import simulate

            # (sizes at the traced example's batch: the whole batch, as the FLOPs here)
            seconds = {f"{name}_s": simulate(gm, device).total_s
                       for name, gm in (("forward", graph.forward),
                                        ("backward", graph.backward),
                                        ("inference", graph.inference))
                       if gm is not None}
        cache[key] = (graph, StepCosts(
            saved_bytes=graph.kept_bytes(num_rows),
            forward_flops=graph_flops(graph.forward, symbol, num_rows),
            backward_flops=graph_flops(graph.backward, symbol, num_rows),
            inference_flops=graph_flops(graph.inference, symbol, num_rows), **seconds))
    return cache[key][1]


def grad_bytes(policy: nn.Module) -> int:
    """Bytes of one full gradient of the trainable parameters (under ``fsdp`` too:
    Reweight's per-sample buffers hold unreduced full-size gradients)."""
    shapes = full_shapes(policy)
    return sum(shapes[n].numel() * p.element_size()
               for n, p in policy.named_parameters() if p.requires_grad)


def plan_schedules(keys, example, mask, schedule: str, *, config, policy: nn.Module,
                   lean_step, cost_cache: dict, budget_bytes: int, regather: bool,
                   in_flight: int | None = None, held_grads: int = 0) -> ScheduleChoice:
    """Plan the three schedules from the step's graphs, pick one (auto, with smaller
    partitioner budgets for retain when it does not fit). ``mask``: ``[rows, steps]`` the
    trained calls planned; ``lean_step(keys, partitioner_budget, regather)``: the compiled
    step; ``budget_bytes``: the memory budget (every rank's smallest); ``regather``: Retain's
    graphs gather the parameters again in the backward."""
    cfg = config
    rows_per_step = [n for n in mask.sum(0).tolist() if n]
    num_rows, num_steps = mask.shape
    samples_in_flight = num_rows if cfg.global_std else (
        cfg.group_size if in_flight is None else in_flight)
    gradient = grad_bytes(policy)

    def plans_for(partitioner_budget, regather=False):
        graph = step_graph(lean_step(keys, partitioner_budget, regather), example)
        costs = step_costs(graph, num_rows, device=cfg.device, cache=cost_cache)
        call_bytes = max(graph.kept_bytes(n) for n in rows_per_step)
        buffers = (samples_in_flight + (cfg.beta > 0) + held_grads) * gradient
        rows = reweight_rows_per_backward(
            rows=max(rows_per_step), grad_bytes=gradient,
            row_saved_bytes=graph.kept_bytes(1),
            room_bytes=budget_bytes - buffers - call_bytes)
        return build_schedule_plans(
            costs=costs, selected_calls=len(rows_per_step), total_calls=num_steps,
            retain_bytes=sum(graph.kept_bytes(n) for n in rows_per_step),
            reweight_call_bytes=call_bytes,
            samples_in_flight=samples_in_flight, grad_bytes=gradient,
            with_kl=cfg.beta > 0, memory_budget_bytes=budget_bytes,
            partitioner_budget=partitioner_budget, reweight_rows=rows,
            held_grads=held_grads), graph

    # Retain's graphs may differ from the others' (the parameters gathered again in the
    # backward): its plan comes from its own, and an explicit retain captures only those.
    plans, graph = plans_for(None, regather and schedule == "retain")
    if regather and schedule == "auto":
        plans["retain"] = plans_for(None, True)[0]["retain"]
    if graph.random_ops and schedule != "recompute":
        dropouts = [f"{name} ({type(m).__name__}, p={m.p})"
                    for name, m in policy.named_modules()
                    if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training
                    and m.p > 0]
        where = f"; dropout in training mode at {', '.join(dropouts)}" if dropouts else ""
        raise RandomOpInGraphError(
            f"schedule={schedule!r}: the captured step draws random numbers "
            f"({', '.join(graph.random_ops)}{where}): running it again would not reproduce "
            "the rollout's forward, so its graph cannot be reused. " + RANDOM_FIXES)
    if schedule != "auto":
        return ScheduleChoice(schedule=schedule, reason=f"schedule={schedule!r} requested",
                              plans=plans)
    name, reason = choose_schedule(plans)
    if name == "retain" or plans["retain"].fits:  # (a faster plan chosen on a device)
        return ScheduleChoice(schedule=name, reason=reason, plans=plans)
    for partitioner_budget in cfg.partitioner_budgets:
        smaller, _ = plans_for(partitioner_budget, regather)
        if smaller["retain"].fits:
            plans["retain"] = smaller["retain"]
            return ScheduleChoice(
                schedule="retain", plans=plans, partitioner_budget=partitioner_budget,
                reason=(f"retain with the partitioner's activation budget "
                        f"{partitioner_budget}: keeps {smaller['retain'].peak_bytes} bytes, "
                        f"within {budget_bytes}"))
    return ScheduleChoice(
        schedule=name, plans=plans,
        reason=reason + f" (also at partitioner budgets {cfg.partitioner_budgets})")


def agree_schedule(ranks, choice: ScheduleChoice) -> ScheduleChoice:
    """Every rank's choice made one (``ranks``: the trainer's ``AllRanks``, distributed)."""
    schedule, reason = choice.schedule, choice.reason
    partitioner_budget = choice.partitioner_budget
    # The ranks must run the same schedule (their collectives follow it): the most
    # frugal of their choices.
    order = ("retain", "reweight", "recompute")
    agreed = order[int(ranks.all_max(order.index(schedule)))]
    if agreed != schedule:
        reason = (f"{agreed}: another rank's rows do not fit {schedule} (this rank: "
                  f"{reason})")
        schedule, partitioner_budget = agreed, None
    # And the same graphs: Retain's partitioner budget changes what the backward
    # recomputes (under fsdp, which gathers it runs), so the smallest budget any
    # rank needs (None, the partitioner's default, counts as the largest).
    value = ranks.all_min(2.0 if partitioner_budget is None else partitioner_budget)
    agreed_budget = None if value >= 2.0 else value
    if schedule == "retain" and agreed_budget != partitioner_budget:
        reason += (f"; partitioner budget {agreed_budget}, which another rank's rows "
                   "need")
        partitioner_budget = agreed_budget
    return ScheduleChoice(schedule=schedule, reason=reason, plans=choice.plans,
                          partitioner_budget=partitioner_budget)
