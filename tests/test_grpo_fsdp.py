"""``GRPOTrainer(parallel="fsdp")`` on gloo: parameters sharded along dim 0, gathered inside the
traced step (all-gathers in the forward graph, reduce-scatters in the backward graph); every
layout x schedule gives the single-process gradients; Reweight's reductions are taken out of
its per-row backward and done once per update; ranks whose calls would not pair up stop with a
clear error; an optimizer step on the shards equals the single-process step."""

import copy
import dataclasses
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from leancompile.passes.gather_at_use import peak_gathered_bytes

from grpo_reference import agreement, expected_syncs
from models import ToyFlowPolicy
from ranks import from_rank, spawn


def mean_latent_reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


def _full(grads: dict, shapes: dict, world: int) -> dict:
    """Every rank's gradient parts gathered into the full gradients."""
    out = {}
    for name, g in grads.items():
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g.contiguous())
        out[name] = torch.cat(parts)[:shapes[name][0]]
    return out


def _graph_key(extra: dict) -> tuple:
    """Cases with equal keys share compiled steps (grad_sync changes no graph)."""
    return tuple(sorted((k, v) for k, v in extra.items() if k != "grad_sync"))


_COLLECTIVE_ONLY = ("compiler", "bucket_cap_mb", "overlap")


def _reference_key(extra: dict) -> tuple:
    """The one-process reference's key: aot_eager, and without what changes only the
    collectives (one process has none)."""
    return _graph_key({k: v for k, v in extra.items() if k not in _COLLECTIVE_ONLY})


def _after_passes(graph, phase: str, op: str) -> int:
    """How often ``op`` occurs in the step's ``phase`` graph after the passes (the graph the
    compiler compiled, Inductor's included)."""
    return sum(r.op_counts_after.get(op, 0) for r in graph.report.graphs if r.phase == phase)


def _issued_reductions(graph) -> tuple[int, int]:
    """The reductions one run of a step's backward graph issues: its reduce-scatters after
    the passes, and those FlashOverlap turned into P2P steps."""
    collectives = _after_passes(graph, "backward",
                                "_c10d_functional.reduce_scatter_tensor.default")
    flash = sum(site.kind == "mm+reduce_scatter"
                for p in graph.report.pass_results("flash_overlap") for site in p.rewritten)
    return collectives, flash


def _fsdp_worker(rank, world, init, out):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer

    # (FLUX under fsdp, every schedule: tests/test_ulysses.py's (dp, sp) mesh, sequence
    # parallel too, which saves this file two FLUX compiles)
    base = ToyFlowPolicy()
    conditions = base.example_conditions(world, generator=torch.Generator().manual_seed(1))
    # One prompt group per rank (conventional), one row of every group per rank (shared),
    # and the same trained steps for every sample: every rank makes the same calls.
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=world,
                        timestep_fraction=0.75)
    # Every layout x schedule on 2 ranks (the same calls on every rank: two ranks show each
    # cell), with the KL term and global-std advantages (LoRA and chunked updates there
    # too); on 4 ranks, calls that differ across ranks and FlashOverlap's ring of 4 (below).
    cases = [(layout, s, {}) for layout in ("shared", "conventional", "scattered")
             for s in ("recompute", "retain", "reweight")] if world == 2 else []
    cases += [("shared", "reweight", {"beta": 0.1}), ("shared", "retain", {"beta": 0.1}),
              ("shared", "reweight", {"global_std": True}),
              # one reduction for the whole update: the full-size gradient held to the end
              ("shared", "reweight", {"grad_sync": "update"}),
              # one collective per parameter, not bucketed
              ("shared", "retain", {"bucket_cap_mb": None}),
              # buckets of 1258 bytes: the parts (768 + 64, 512 + 16 bytes) gather in two,
              # the full gradients (1536, 128, 1024, 32) reduce in two or three
              ("shared", "retain", {"bucket_cap_mb": 0.0012}),
              # Inductor: its buckets' gradients accumulate over the trained steps'
              # backwards (no two parameters' gradients may share memory)
              ("shared", "retain", {"compiler": "inductor"})] if world == 2 else []
    # FlashOverlap on the same graphs: the weight gathers feeding matmuls and the weight
    # gradients feeding reduce-scatters become P2P schedules; every schedule on 2 ranks, and
    # on 4 the ring of 4 (the P2P schedule does not depend on the GRPO schedule) under
    # Retain, whose graphs hold the most gathers (the backward gathers again).
    cases += [("shared", s, {"overlap": "flash"}) for s in (
        ("recompute", "retain", "reweight") if world == 2 else ("retain",))]
    # Calls that differ across ranks: DanceGRPO's per-sample trained steps, a rank
    # without rows (one prompt group, conventional), worker groups of the shared layout
    # with different numbers of prompts (group_size 2 < 4 ranks, 3 prompts). The ranks
    # pad to the union of their calls with a stand-in row whose loss is times zero.
    dance = {"sde": "dance_grpo", "eta": 0.3, "timestep_fraction": 0.5, "prompts": 3}
    cases += [("shared", "retain", dance), ("shared", "reweight", dance),
              ("conventional", "retain", {"group_size": 2, "prompts": 1}),
              ("shared", "reweight", {"group_size": 2, "prompts": 3}),
              # Reweight reducing per round of prompt groups where ranks own unequal
              # numbers of groups: 5 prompts as 2+1+1+1 (two rounds, three ranks pad the
              # second), 3 prompts as 1+1+1+0 (rank 3 only pads)
              ("conventional", "reweight", {"group_size": 2, "prompts": 5}),
              ("conventional", "reweight", {"group_size": 2, "prompts": 3})] if world == 4 \
        else []
    shapes = {n: tuple(p.shape) for n, p in base.named_parameters()}
    results = []
    # One policy for the single-process references and one the first fsdp trainer shards;
    # trainers with the same step share its compiled graphs (compiling is the slow part).
    single_policy, sharded_policy = copy.deepcopy(base), copy.deepcopy(base)
    compiled: dict = {}
    compiled_single: dict = {}
    for layout, schedule, extra in cases:
        prompts = extra.get("prompts")
        cfg = dataclasses.replace(config, layout=layout, **{k: v for k, v in extra.items()
                                                            if k != "prompts"})
        case_conditions = conditions if prompts is None else base.example_conditions(
            prompts, generator=torch.Generator().manual_seed(1))
        key = _graph_key(extra)
        # The references: one process under aot_eager, without the options that only change
        # how collectives run (a case that differs only in those shares the reference).
        ref_key = _reference_key(extra)

        def reference():
            single = GRPOTrainer(single_policy, mean_latent_reward, None, dataclasses.replace(
                cfg, **{k: getattr(config, k) for k in _COLLECTIVE_ONLY}))
            if ref_key in compiled_single:
                single._steps = compiled_single[ref_key]
            compiled_single[ref_key] = single._steps
            ref = single.compute_gradients(case_conditions, torch.Generator().manual_seed(5),
                                           schedule=schedule)
            return ref.grads, ref.rollout.rewards

        # Each step's references on one rank (the rank that compiles it), spread over ranks.
        owner = list(dict.fromkeys(_reference_key(c[2]) for c in cases)).index(ref_key)
        ref_grads, ref_rewards = from_rank(rank, owner % world, reference)
        trainer = GRPOTrainer(sharded_policy, mean_latent_reward, None, cfg, parallel="fsdp")
        if key in compiled:
            trainer._steps = compiled[key]
        compiled[key] = trainer._steps
        # explain's prediction of the update's gradient reductions, before it runs
        explained = trainer.explain(case_conditions, torch.Generator().manual_seed(5),
                                    schedule=schedule)
        predicted = explained.gradient_sync[schedule]
        got = trainer.compute_gradients(case_conditions, torch.Generator().manual_seed(5),
                                        schedule=schedule)
        local = {n: tuple(p.shape) for n, p in trainer.policy.named_parameters()}
        full = _full(got.grads, shapes, world)
        _, rel = agreement(full, ref_grads)
        lean = trainer.lean_step(list(conditions), None, trainer._regathers(schedule))
        graph = lean.graphs[0]
        ops = [str(n.target) for gm in (graph.forward, graph.backward) for n in gm.graph.nodes]
        unrewritten = [str(n.target) for n in graph.backward_aten.graph.nodes]
        results.append({
            "case": f"{layout}/{schedule}/{extra}", "rel": rel, "schedule": got.schedule,
            "syncs": got.sync_collectives, "sync_bytes": got.sync_bytes,
            "predicted_syncs": list(predicted),
            "full_grad_bytes": sum(-(-s[0] // world) * world * torch.Size(s[1:]).numel() * 4
                                   for s in shapes.values()),
            "expected_syncs": expected_syncs(cfg, schedule, case_conditions[
                next(iter(case_conditions))].shape[0], world, parallel="fsdp"),
            "buffer_bytes": got.buffer_bytes,
            "parameters": len(shapes),
            "sharded": all(local[n][0] == -(-shapes[n][0] // world) for n in shapes),
            "gathers": _after_passes(graph, "forward",
                                     "_c10d_functional.all_gather_into_tensor.default"),
            "reduce_scatters": sum("reduce_scatter_tensor" in o for o in ops),
            "reductions": sum("reduce_scatter_tensor" in o for o in unrewritten),
            # what the backward graph that runs issues: its reduce-scatters (after bucketing),
            # and those FlashOverlap turned into P2P steps (each still one reduction)
            "backward_rs": _issued_reductions(graph)[0],
            "flash_rs": _issued_reductions(graph)[1],
            "bucket_cap_mb": cfg.bucket_cap_mb,
            "p2p": sum("p2p_start" in o for o in ops),
            "flash": "overlap" in extra,
            "report": str(graph.report),
            "backwards": lean.stats.backward_graphs_run,
            # Retain's backward gathers the parameters again (reshard_after_forward)
            "backward_gathers": sum("all_gather_into_tensor" in o for o in unrewritten),
            # gathered weights alive at once in an untrained call (gather_at_use)
            "inference_peak": peak_gathered_bytes(graph.inference),
            "full_bytes": sum(torch.Size(s).numel() * 4 for s in shapes.values()),
            "explained_peak": explained.gathered_peak,
            "rewards": float((got.rollout.rewards - ref_rewards).abs().max())})
    report = {"results": results}
    # An optimizer built on the full parameters before the trainer: the trainer points it
    # at the shards; one step equals the single-process step.
    # (clipping at a norm the gradient exceeds: the norm is over every rank's parts)
    cfg = dataclasses.replace(config, layout="shared", schedule="retain",
                              max_grad_norm=1e-3)
    def single_step():
        policy = copy.deepcopy(base)
        GRPOTrainer(policy, mean_latent_reward,
                    torch.optim.AdamW(policy.parameters(), lr=1e-2), cfg).step(
            conditions, torch.Generator().manual_seed(9))
        return {n: p.detach() for n, p in policy.named_parameters()}

    stepped = from_rank(rank, 0, single_step)
    policy = copy.deepcopy(base)
    sharded = GRPOTrainer(policy, mean_latent_reward,
                          torch.optim.AdamW(policy.parameters(), lr=1e-2), cfg,
                          parallel="fsdp")
    sharded.step(conditions, torch.Generator().manual_seed(9))
    after = _full({n: p.detach() for n, p in policy.named_parameters()}, shapes, world)
    _, report["step_rel"] = agreement(after, stepped)
    views = sharded.sharding.dtensors(policy)
    report["dtensor_shapes_ok"] = all(tuple(v.shape) == shapes[n] for n, v in views.items())
    # Checkpoint (parts through torch.distributed.checkpoint, optimizer state per rank),
    # one more step; resumed into a fresh policy and optimizer, the same step again.
    run_dir = os.path.join(out, "run")
    sharded.save(run_dir)
    sharded.step(conditions, torch.Generator().manual_seed(10))
    first = _full({n: p.detach() for n, p in policy.named_parameters()}, shapes, world)
    fresh = copy.deepcopy(base)
    resumed = GRPOTrainer.load(run_dir, fresh, mean_latent_reward,
                               torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                               parallel="fsdp")
    resumed.step(conditions, torch.Generator().manual_seed(10))
    again = _full({n: p.detach() for n, p in fresh.named_parameters()}, shapes, world)
    report["resume_equal"] = all(torch.equal(first[n], again[n]) for n in shapes)
    report["resume_step"] = resumed.step_count
    if world == 2:
        # Two chunks per rollout: each update counts its own backward graphs' reductions.
        pending = trainer.rollout(conditions, torch.Generator().manual_seed(5), chunks=2,
                                  schedule="retain")
        lean = pending.setup.lean
        counts = [pending.update(chunk=c).sync_collectives for c in (0, 1)]
        report["chunk_syncs"] = counts + [sum(_issued_reductions(lean.graphs[0])) *
                                          lean.stats.backward_graphs_run]
        # A parameter change between rollout and update, and chunks updated out of order:
        # every rank recomputes alike (DanceGRPO subsets, global-std Reweight: a rank may have
        # no trained row at the first trained step).
        stale_cfg = GRPOConfig(sde="dance_grpo", eta=0.3, group_size=world, layout="shared",
                               timestep_fraction=0.75, global_std=True, schedule="reweight")
        def stale_and_out_of_order(parallel, cfg=stale_cfg):
            policy = copy.deepcopy(base)
            tr = GRPOTrainer(policy, mean_latent_reward, None, cfg, parallel=parallel)
            pending = tr.rollout(conditions, torch.Generator().manual_seed(5))
            with torch.no_grad():
                for name in tr.trainable:
                    dict(policy.named_parameters())[name].add_(0.01)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stale = pending.update().grads
            pending = tr.rollout(conditions, torch.Generator().manual_seed(6), chunks=2)
            later, first = pending.update(chunk=1).grads, pending.update(chunk=0).grads
            return stale, later, first

        single = from_rank(rank, 0, lambda: stale_and_out_of_order(None))
        report["stale_rel"] = [agreement(_full(f, shapes, world), s)[1]
                               for f, s in zip(stale_and_out_of_order("fsdp"), single)]
        # The same with per-group statistics: Reweight trains and reduce-scatters each prompt
        # group in the rollout (two rounds), then the stale update and the chunks recompute.
        per_group_cfg = dataclasses.replace(stale_cfg, global_std=False)
        single = from_rank(rank, 0, lambda: stale_and_out_of_order(None, per_group_cfg))
        report["stale_rel"] += [agreement(_full(f, shapes, world), s)[1] for f, s in zip(
            stale_and_out_of_order("fsdp", per_group_cfg), single)]
        # LoRA adapters sharded (lora_B random, so the policy is not its reference yet), with
        # the KL to the adapter-free reference: zero adapters at full size.
        from peft import LoraConfig, get_peft_model

        lora = copy.deepcopy(base)
        torch.manual_seed(3)
        lora.net = get_peft_model(lora.net, LoraConfig(r=2, target_modules=["0", "2"],
                                                       init_lora_weights=False))
        lora_shapes = {n: tuple(p.shape) for n, p in lora.named_parameters()
                       if p.requires_grad}
        lora_cfg = dataclasses.replace(config, layout="shared", beta=0.1, reference="adapter")
        report["lora_rel"] = {}
        for schedule in ("retain", "reweight"):
            def lora_reference():
                single = GRPOTrainer(copy.deepcopy(lora), mean_latent_reward, None, lora_cfg)
                ref = single.compute_gradients(conditions, torch.Generator().manual_seed(5),
                                               schedule=schedule)
                return ref.grads, ref.kl

            ref_grads, ref_kl = from_rank(rank, 0, lora_reference)
            sharded = GRPOTrainer(copy.deepcopy(lora), mean_latent_reward, None, lora_cfg,
                                  parallel="fsdp")
            got = sharded.compute_gradients(conditions, torch.Generator().manual_seed(5),
                                            schedule=schedule)
            _, report["lora_rel"][schedule] = agreement(
                _full(got.grads, lora_shapes, world), ref_grads)
            report["lora_kl"] = [got.kl, ref_kl]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def _run(tmp_path, world):
    spawn(_fsdp_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
          nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check(ranks):
    for r, report in enumerate(ranks):
        for entry in report["results"]:
            schedule = entry["case"].split("/")[1]
            assert entry["schedule"] == schedule, entry
            assert entry["sharded"], entry
            assert entry["rel"] <= (1e-5 if schedule == "reweight" else 1e-6), (r, entry)
            assert entry["rewards"] <= 1e-6, (r, entry)
            if entry["flash"]:
                # The weights' gathers and gradient reductions became P2P schedules; the
                # biases' (no matmul slices along them) stay collectives, with the reason.
                report = entry["report"]
                assert "rewrote 2 x all_gather+mm" in report, report
                assert "rewrote 2 x mm+reduce_scatter" in report, report
                assert "only the bias of addmm" in report, report
                # ... and the two biases' gathers share a bucket
                assert entry["p2p"] > 0 and entry["gathers"] == 1, entry
            elif entry["bucket_cap_mb"] is None:
                # The gathers are in the forward graph, the reductions in the backward graph,
                # one per parameter.
                assert entry["gathers"] == entry["parameters"], entry
                # each gathered where it is first read: an untrained call never holds every
                # gathered weight at once
                assert entry["inference_peak"] < entry["full_bytes"], entry
                assert entry["backward_rs"] == entry["reductions"], entry
                assert entry["p2p"] == 0, entry
            elif entry["bucket_cap_mb"] >= 1:
                # Bucketed (default 25 MiB): every gather in one, every reduction in one.
                assert (entry["gathers"], entry["backward_rs"]) == (1, 1), entry
                assert "bucket_collectives: " in entry["report"], entry["report"]
            else:  # a cap below the parameters' bytes: several buckets of each
                assert 1 < entry["gathers"] < entry["parameters"], entry
                assert 1 < entry["backward_rs"] < entry["reductions"], entry
            assert 0 < entry["reductions"] <= entry["parameters"], entry
            # Retain keeps the parts, not the gathered weights: its backward gathers the
            # weights it reads again (GRPOConfig.reshard_after_forward); the others' backward,
            # right after their forward, reads the gathered weights it saved.
            assert (entry["backward_gathers"] > 0) == (schedule == "retain"), entry
            assert entry["predicted_syncs"] == [entry["syncs"], entry["sync_bytes"]], entry
            assert entry["explained_peak"]["inference"] == entry["inference_peak"], entry
            if schedule == "reweight":
                # Taken out of the per-row backward: one reduce-scatter of every (padded) full
                # gradient per round of prompt groups (grad_sync="update" or advantages that
                # wait for the whole batch: per update); no backward graph ran.
                assert entry["syncs"] == entry["expected_syncs"], entry
                assert entry["sync_bytes"] == entry["syncs"] * entry["full_grad_bytes"], entry
                assert entry["backwards"] == 0, entry
            else:
                assert entry["backwards"] > 0, entry
                assert entry["syncs"] == (entry["backward_rs"] + entry["flash_rs"]) * \
                    entry["backwards"], entry


def test_fsdp_four_ranks_calls_that_differ_across_ranks_equal_one_process(tmp_path):
    ranks = _run(tmp_path, 4)
    _check(ranks)
    for report in ranks:
        assert report["step_rel"] <= 1e-6, report["step_rel"]
        assert report["dtensor_shapes_ok"]
        assert report["resume_equal"] and report["resume_step"] == 2, report


def test_fsdp_two_ranks_toy_every_layout_and_schedule_equals_one_process(tmp_path):
    ranks = _run(tmp_path, 2)
    _check(ranks)
    for report in ranks:
        assert report["step_rel"] <= 1e-6 and report["dtensor_shapes_ok"], report
        assert report["resume_equal"] and report["resume_step"] == 2, report
        # Reweight per round of prompt groups (two rounds here, one sample of each group per
        # rank) frees a group's reduce-scattered full-size gradient before the next group's
        # buffer fills; reducing once per update holds it beside that buffer.
        by_case = {e["case"]: e for e in report["results"]}
        group = by_case["shared/reweight/{}"]
        update = by_case["shared/reweight/{'grad_sync': 'update'}"]
        assert (group["syncs"], update["syncs"]) == (2, 1), (group, update)
        assert update["buffer_bytes"] - group["buffer_bytes"] == group["full_grad_bytes"], \
            (group, update)
        first, second, total = report["chunk_syncs"]
        assert first > 0 and second > 0 and first + second == total, report["chunk_syncs"]
        assert all(rel <= 1e-5 for rel in report["lora_rel"].values()), report["lora_rel"]
        assert all(rel <= 1e-6 for rel in report["stale_rel"]), report["stale_rel"]
        assert report["lora_kl"][1] > 0 and abs(report["lora_kl"][0] - report["lora_kl"][1]) \
            <= 1e-6 * report["lora_kl"][1], report["lora_kl"]


def test_sharding_keeps_tied_parameters_tied_and_refuses_0_dim_before_changing_anything():
    from leancompile.grpo.fsdp import ParameterSharding

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    full = model.embed.weight.detach().clone()
    sharding = ParameterSharding(model, None, rank=1, world_size=2)
    assert model.head.weight is model.embed.weight  # still one parameter
    assert sharding.aliases == {"embed.weight": ["head.weight"]}
    # 5 rows over 2 ranks: 3 per part, rank 1 holds rows 3..4 and one row of padding.
    assert torch.equal(model.embed.weight[:2], full[3:]) and not model.embed.weight[2].any()

    model = Tied()
    model.scale = torch.nn.Parameter(torch.tensor(2.0))
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"\['scale'\] are 0-dim"):
        ParameterSharding(model, None, rank=0, world_size=2)
    assert all(p is before[n] for n, p in model.named_parameters())  # nothing replaced
