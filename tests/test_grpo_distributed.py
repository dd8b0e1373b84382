"""Data-parallel GRPO on gloo: every layout x schedule gives the single-process gradients; one
gradient reduction per update; ranks that disagree stop with a clear error. Plus the layouts
and per-sample seeds as pure functions."""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from grpo_reference import agreement, expected_syncs
from leancompile.grpo.layout import (LAYOUTS, assign, draw_samples, row_owner, sample_seed,
                                     worker_groups)
from leancompile.grpo.timesteps import TimestepSelection
from models import ToyFlowPolicy, tiny_flux_policy
from ranks import spawn


def mean_latent_reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


# -- layouts and seeds (no processes) ----------------------------------------------------------

@pytest.mark.parametrize("prompts,group_size,world", [(2, 3, 2), (3, 2, 4), (1, 4, 4),
                                                      (5, 2, 3), (2, 3, 4), (1, 2, 5)])
def test_every_row_is_generated_by_exactly_one_rank(prompts, group_size, world):
    batch = prompts * group_size
    for layout in LAYOUTS:
        seen = []
        for rank in range(world):
            units = assign(layout, num_prompts=prompts, group_size=group_size, world_size=world,
                           rank=rank, seed=7)
            for unit in units:
                assert rank in unit.ranks or not unit.rows
                for row in unit.rows:
                    assert row // group_size in unit.prompts
                seen += unit.rows
        assert sorted(seen) == list(range(batch)), layout
        owner = row_owner(layout, num_prompts=prompts, group_size=group_size, world_size=world,
                          seed=7)
        for rank in range(world):
            rows = [r for u in assign(layout, num_prompts=prompts, group_size=group_size,
                                      world_size=world, rank=rank, seed=7) for r in u.rows]
            assert sorted(rows) == (owner == rank).nonzero().flatten().tolist()


def test_layout_shapes():
    # shared, M >= R: generation m of each prompt on rank m % R, one unit per prompt.
    units = assign("shared", num_prompts=2, group_size=4, world_size=2, rank=1)
    assert [u.rows for u in units] == [(1, 3), (5, 7)]
    assert all(u.ranks == (0, 1) for u in units)
    # shared, M < R: R // M worker groups, prompts round-robin over them.
    assert worker_groups(2, 4) == [(0, 1), (2, 3)]
    units = assign("shared", num_prompts=3, group_size=2, world_size=4, rank=2)
    assert [(u.prompts, u.rows, u.ranks) for u in units] == [((1,), (2,), (2, 3))]
    # conventional: whole groups per rank.
    units = assign("conventional", num_prompts=4, group_size=3, world_size=2, rank=1)
    assert [u.rows for u in units] == [(6, 7, 8), (9, 10, 11)]
    assert all(u.ranks == (1,) for u in units)
    # scattered: a permutation drawn from the seed, one unit over every rank.
    a = row_owner("scattered", num_prompts=4, group_size=3, world_size=2, seed=1)
    b = row_owner("scattered", num_prompts=4, group_size=3, world_size=2, seed=2)
    assert not torch.equal(a, b) and (a == 0).sum() == 6
    with pytest.raises(ValueError, match="layout='ring'"):
        assign("ring", num_prompts=1, group_size=2, world_size=2, rank=0)


def test_sample_seeds_are_distinct_and_stable():
    seeds = {sample_seed(3, p, m) for p in range(-1, 20) for m in range(-1, 20)}
    assert len(seeds) == 21 * 21
    assert sample_seed(3, 1, 2) == sample_seed(3, 1, 2) != sample_seed(4, 1, 2)
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("strategy", ["first", "dance_grpo", "window"])
def test_a_sample_draws_the_same_wherever_it_runs(strategy):
    policy = ToyFlowPolicy()
    selection = TimestepSelection(strategy=strategy, fraction=None if strategy == "window"
                                  else 0.75, window_size=2 if strategy == "window" else None)
    kw = dict(selection=selection, num_prompts=2, group_size=3, num_steps=4, seed=11)
    full = draw_samples(policy, **kw)
    part = draw_samples(policy, rows=[4, 1], **kw)
    assert torch.equal(full.selected, part.selected)
    for b in (1, 4):
        assert torch.equal(full.latents0[b], part.latents0[b])
        assert torch.equal(full.noise[:, b], part.noise[:, b])
    assert part.latents0[0].abs().sum() == 0
    same = draw_samples(policy, init_same_noise=True, **kw)
    assert torch.equal(same.latents0[0], same.latents0[2])
    assert not torch.equal(same.latents0[0], same.latents0[3])


# -- processes -----------------------------------------------------------------------------------

def _ddp_worker(rank, world, init, out, kind):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from leancompile.grpo.parallel import RankMismatchError
    from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer

    if kind == "flux":
        policy = tiny_flux_policy()
        conditions = policy.example_conditions(2, generator=torch.Generator().manual_seed(1),
                                               sequence_length=8)
        config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=3)
        # Every layout x schedule runs on the toy policy (4 ranks); the real model's graphs
        # here: one case per schedule, each layout once.
        cases = [("shared", "retain", {}), ("shared", "reweight", {}),
                 ("conventional", "recompute", {}), ("scattered", "retain", {})]
    else:
        policy = ToyFlowPolicy()
        conditions = policy.example_conditions(3, generator=torch.Generator().manual_seed(1))
        config = GRPOConfig(sde="dance_grpo", eta=0.3, group_size=2, timestep_fraction=0.75)
        cases = [(layout, s, {}) for layout in ("shared", "conventional", "scattered")
                 for s in ("recompute", "retain", "reweight")]
        cases += [("shared", "retain", {"beta": 0.1}), ("shared", "reweight", {"beta": 0.1}),
                  ("shared", "reweight", {"global_std": True})]
        # Reweight reducing once per round of prompt groups instead of once per update.
        cases += [(layout, "reweight", {"grad_sync": "group"})
                  for layout in ("shared", "conventional", "scattered")]
    results = []
    single_trainers = {}
    num_prompts = next(iter(conditions.values())).shape[0]
    for layout, schedule, extra in cases:
        cfg = dataclasses.replace(config, layout=layout, **extra)
        # grad_sync does not change the single-process trainer (nothing to reduce)
        key = tuple(sorted((k, v) for k, v in extra.items() if k != "grad_sync"))
        if key not in single_trainers:
            single_trainers[key] = GRPOTrainer(policy, mean_latent_reward, None,
                                               dataclasses.replace(config, **dict(key)))
        single = single_trainers[key]
        trainer = GRPOTrainer(policy, mean_latent_reward, None, cfg, parallel="ddp")
        trainer._steps = single._steps  # same compiled step (compiling is the slow part)
        ref = single.compute_gradients(conditions, torch.Generator().manual_seed(5),
                                       schedule=schedule)
        predicted = trainer.explain(conditions, torch.Generator().manual_seed(5),
                                    schedule=schedule).gradient_sync[schedule]
        got = trainer.compute_gradients(conditions, torch.Generator().manual_seed(5),
                                        schedule=schedule)
        cos, rel = agreement(got.grads, ref.grads)
        results.append({
            "case": f"{layout}/{schedule}/{extra}", "rel": rel, "schedule": got.schedule,
            "syncs": got.sync_collectives, "sync_bytes": got.sync_bytes,
            "predicted_syncs": list(predicted),
            "grad_bytes": sum(g.numel() * g.element_size() for g in got.grads.values()),
            "expected_syncs": expected_syncs(cfg, schedule, num_prompts, world,
                                             parallel="ddp"),
            "rewards": float((got.rollout.rewards - ref.rollout.rewards).abs().max()),
            "log_probs": float((got.rollout.log_probs - ref.rollout.log_probs).abs().max()),
            "kl": abs(got.kl - ref.kl),
            "rows": got.rollout.rows.tolist(),
            "latents": float(torch.cat([torch.zeros(1), (got.rollout.latents[got.rollout.rows]
                              - ref.rollout.latents[got.rollout.rows]).abs().flatten()]).max())})
    # Ranks that pass different seeds stop together with an error naming the ranks.
    trainer = GRPOTrainer(policy, mean_latent_reward, None, config, parallel="ddp")
    trainer._steps = next(iter(single_trainers.values()))._steps
    try:
        trainer.compute_gradients(conditions, torch.Generator().manual_seed(rank))
        mismatch = "no error"
    except RankMismatchError as e:
        mismatch = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"results": results, "mismatch": mismatch}, f)
    dist.destroy_process_group()


def _run(tmp_path, world, kind):
    spawn(_ddp_worker, args=(world, str(tmp_path / "init"), str(tmp_path), kind),
          nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check(ranks, *, retain_tol, reweight_tol):
    rows = []
    for r, report in enumerate(ranks):
        for entry in report["results"]:
            name = entry["case"]
            schedule = name.split("/")[1]
            assert entry["schedule"] == schedule, entry
            tol = reweight_tol if schedule == "reweight" else retain_tol
            assert entry["rel"] <= tol, (r, entry)
            assert entry["rewards"] <= 1e-6 and entry["log_probs"] <= 1e-5, (r, entry)
            assert entry["kl"] <= 1e-6, (r, entry)
            # Same draws per sample; a model call on fewer rows may round differently.
            assert entry["latents"] <= 1e-5, (r, entry)
            # One gradient all-reduce of every trainable gradient per update, whatever the
            # schedule and the number of steps trained (grad_sync="group": per round of
            # prompt groups).
            assert entry["syncs"] == entry["expected_syncs"], entry
            assert entry["sync_bytes"] == entry["syncs"] * entry["grad_bytes"], entry
            assert entry["predicted_syncs"] == [entry["syncs"], entry["sync_bytes"]], entry
            rows.append((name, r, entry["rows"]))
        assert "differs across the" in report["mismatch"], report["mismatch"]
        assert "same generator seed" in report["mismatch"]
    # Every case's rows are split over the ranks without overlap.
    by_case = {}
    for name, _, owned in rows:
        by_case.setdefault(name, []).extend(owned)
    for name, owned in by_case.items():
        assert len(owned) == len(set(owned)), (name, owned)


def test_ddp_four_ranks_every_layout_and_schedule_equals_one_process(tmp_path):
    ranks = _run(tmp_path, 4, "toy")
    _check(ranks, retain_tol=1e-6, reweight_tol=1e-5)


def test_ddp_two_ranks_tiny_flux_equals_one_process(tmp_path):
    ranks = _run(tmp_path, 2, "flux")
    _check(ranks, retain_tol=1e-6, reweight_tol=1e-5)


def test_parallel_arguments_are_checked():
    from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer

    policy = ToyFlowPolicy()
    with pytest.raises(ValueError, match="parallel='dp'"):
        GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(), parallel="dp")
    if not dist.is_initialized():
        for parallel in ("ddp", "fsdp"):
            with pytest.raises(RuntimeError, match="init_process_group"):
                GRPOTrainer(policy, mean_latent_reward, None, GRPOConfig(), parallel=parallel)
    with pytest.raises(ValueError, match="layout='ring'"):
        GRPOConfig(layout="ring")
    with pytest.raises(ValueError, match="grad_sync='step'.*'group', 'update'"):
        GRPOConfig(grad_sync="step")


# -- the wrapper inside a user's own DDP loop ------------------------------------------------------

class _Velocity:
    """The loop's function: the policy's velocity, whose transformer call is the wrapped DDP
    module; the phases are that wrapper's."""

    def __init__(self, policy, step):
        self.policy, self.step = policy, step

    def __call__(self, *args, **kwargs):
        return self.policy.velocity(*args, **kwargs)

    def rollout(self, **kwargs):
        return self.step.rollout(**kwargs)

    def update(self):
        return self.step.update()


def _user_ddp_worker(rank, world, init, out):
    """FlowGRPO's accelerate shape: the transformer wrapped in DDP, each rank sampling its own
    prompts (seeded by rank), DDP's bucketed all-reduce in every backward; LeanGRPO wraps the
    DDP module (``lean_compile(DDP(transformer), schedule=...)``) and marks the two phases."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import leancompile
    from leancompile.demos.user_loops import LoopConfig, flow_grpo_loop
    from leancompile.integrations.diffusers import FluxPolicy

    config = LoopConfig(sde="flow_grpo", eta=0.9, iterations=1)
    report = {}
    for name in ("plain", "retain"):
        torch._dynamo.reset()
        base = tiny_flux_policy(steps=4)
        ddp = DDP(base.transformer.requires_grad_(True))
        calls = [0]

        def counting(state, bucket, calls=calls):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting)
        extra = {} if name == "plain" else {"schedule": name}
        step = leancompile.lean_compile(ddp, backend="aot_eager", **extra)
        policy = FluxPolicy(step, num_inference_steps=4, height=8, width=8, vae_scale_factor=1,
                            guidance_scale=3.5)
        fn = _Velocity(policy, step) if extra else policy.velocity
        result = flow_grpo_loop(policy, fn, config, seed=100 + rank)
        flat = [torch.cat([g.flatten() for _, g in sorted(grads.items())])
                for grads in result.grads]
        params = torch.cat([p.flatten() for _, p in sorted(result.params.items())])
        # Every rank must end with the same parameters: DDP averaged the gradients.
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        report[name] = {"grads": [g.tolist() for g in flat], "params": params.tolist(),
                        "ranks_differ": max((g - params).abs().max().item() for g in gathered),
                        "allreduces": calls[0],
                        "forwards_run": getattr(getattr(step, "stats", None), "forwards_run",
                                                None),
                        "summary": str(step.stats.summary()) if extra else ""}
    with open(os.path.join(out, f"ddp{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def test_wrapper_inside_a_users_ddp_loop_gives_the_plain_loops_gradients(tmp_path):
    spawn(_user_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
          join=True)
    for rank in range(2):
        report = json.loads((tmp_path / f"ddp{rank}.json").read_text())
        plain, lean = report["plain"], report["retain"]
        assert plain["ranks_differ"] == 0 and lean["ranks_differ"] == 0, (rank, report)
        # DDP reduced as often with the wrapper as without it (once per backward).
        assert lean["allreduces"] == plain["allreduces"] > 0
        assert lean["forwards_run"] == 0, lean["summary"]  # the update reused the rollout's
        for got, ref in zip(lean["grads"], plain["grads"]):
            got, ref = torch.tensor(got), torch.tensor(ref)
            assert ((got - ref).norm() / ref.norm()).item() <= 1e-6
        got, ref = torch.tensor(lean["params"]), torch.tensor(plain["params"])
        assert ((got - ref).norm() / ref.norm()).item() <= 1e-6
