"""``leancompile check-inputs``: the bad-input matrix. Every public entry point called with
invalid arguments, and the error a user gets back.

Each row is (entry point, what is wrong, a call); running a row must raise ``TypeError``,
``ValueError``, ``NotImplementedError`` or ``RuntimeError`` whose text names the offending
value (``expect``). The command prints one row per case (``--json`` for the records);
``tests/test_check_inputs.py`` asserts every row. Nothing here needs a process group or
compiles anything heavy: a row that compiles uses a two-layer MLP.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Case", "cases", "main", "run_cases"]


@dataclass(frozen=True)
class Case:
    entry: str
    problem: str
    call: Callable[[], object]
    expect: str
    """A fragment the error text must contain (the bad value, or the fix)."""


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))


class _Policy(torch.nn.Module):
    """The smallest policy with the contract of ``leancompile.integrations.diffusers``."""

    condition_keys = ("prompt_embeds",)

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4 + 2 + 1, 4)
        self.register_buffer("sigmas", torch.linspace(1, 0, 4), persistent=False)

    def velocity(self, latents, step_index, conditions):
        t = self.sigmas[step_index].reshape(-1, 1)
        return self.net(torch.cat([latents, conditions["prompt_embeds"], t], 1))

    def initial_latents(self, batch, generator=None):
        return torch.randn(batch, 4, generator=generator)


def _trainer(reward, **config):
    from .grpo.trainer import GRPOConfig, GRPOTrainer

    return GRPOTrainer(_Policy(), reward, None, GRPOConfig(group_size=2, **config))


def _step_with(reward):
    trainer = _trainer(reward, schedule="recompute")
    return trainer.compute_gradients({"prompt_embeds": torch.zeros(1, 2)},
                                     torch.Generator().manual_seed(0))


def cases() -> list[Case]:
    """The rows (built on call: they import the package's modules)."""
    import leancompile
    from .grpo.advantages import group_advantages, group_ids_for
    from .grpo.layout import assign
    from .grpo.rewards import check_rewards
    from .grpo.sde import sde_step
    from .grpo.timesteps import TimestepSelection, select_timesteps
    from .grpo.trainer import GRPOConfig, GRPOTrainer
    from .runtime.p2p import start_exchange

    x = torch.zeros(2, 4)
    return [
        # compile entry points
        Case("backend", "unknown compiler", lambda: leancompile.backend(compiler="tvm"), "tvm"),
        Case("backend", "unknown option", lambda: leancompile.backend(chunk=2), "chunk"),
        Case("backend", "strict without an overlap pass",
             lambda: leancompile.backend(strict=True), "strict=True checks"),
        Case("backend", "device without overlap='auto'",
             lambda: leancompile.backend(overlap="flash", device="h200"), "overlap='auto'"),
        Case("backend", "overlap_sites with an unknown setting",
             lambda: leancompile.backend(overlap="flash", overlap_sites={"mm": "ring"}),
             "each site takes one of"),
        Case("backend", "overlap_sites without overlap=",
             lambda: leancompile.backend(overlap_sites={"mm": "flash"}),
             "pass overlap='flash' or 'slice'"),
        Case("simulate", "unknown device profile",
             lambda: leancompile.simulate([], device="tpu-v9"), "tpu-v9"),
        Case("backend", "unknown pass to disable",
             lambda: leancompile.backend(disable=("fuse_all",)), "fuse_all"),
        Case("backend", "unknown overlap", lambda: leancompile.backend(overlap="async"),
             "async"),
        Case("backend", "chunks < 1", lambda: leancompile.backend(overlap="slice", chunks=0),
             "chunks"),
        Case("backend", "unknown variant",
             lambda: leancompile.backend(overlap="flash", variant="tree"), "tree"),
        Case("backend", "chunks with overlap='flash'",
             lambda: leancompile.backend(overlap="flash", chunks=4), "overlap='slice' only"),
        Case("backend", "chunks_per_rank with overlap='slice'",
             lambda: leancompile.backend(overlap="slice", chunks_per_rank=2),
             "overlap='flash' only"),
        Case("backend", "variant without overlap",
             lambda: leancompile.backend(variant="direct"), "overlap=None"),
        Case("backend", "a LeanGRPO schedule", lambda: leancompile.backend(schedule="retain"),
             "lean_compile"),
        Case("install", "a compiler", lambda: leancompile.install(compiler="aot_eager"),
             "compiler"),
        Case("install", "a LeanGRPO schedule", lambda: leancompile.install(schedule="retain"),
             "lean_compile"),
        Case("lean_compile", "compiler= instead of backend=",
             lambda: leancompile.lean_compile(_mlp(), compiler="aot_eager"), "backend"),
        Case("lean_compile", "unknown schedule",
             lambda: leancompile.lean_compile(_mlp(), schedule="fast"), "fast"),
        Case("lean_compile", "not callable", lambda: leancompile.lean_compile(3, schedule="retain"),
             "int"),
        Case("lean_compile", "unknown keyword",
             lambda: leancompile.lean_compile(_mlp(), schedule="retain", budget=3), "budget"),
        Case("lean_compile", "unknown fallback",
             lambda: leancompile.lean_compile(_mlp(), schedule="retain", fallback="skip"),
             "fallback='skip'"),
        Case("lean_compile", "deferred reductions with schedule auto",
             lambda: leancompile.lean_compile(_mlp(), schedule="auto", defer_reductions=True),
             "schedule='auto'"),
        # GRPO configuration
        Case("GRPOConfig", "unknown schedule", lambda: GRPOConfig(schedule="fast"), "fast"),
        Case("GRPOConfig", "unknown device profile", lambda: GRPOConfig(device="tpu-v9"),
             "tpu-v9"),
        Case("GRPOConfig", "unknown sde", lambda: GRPOConfig(sde="ddim"), "ddim"),
        Case("GRPOConfig", "eta = 0", lambda: GRPOConfig(eta=0.0), "eta"),
        Case("GRPOConfig", "group of 1", lambda: GRPOConfig(group_size=1), "group_size=1"),
        Case("GRPOConfig", "timestep_fraction 0", lambda: GRPOConfig(timestep_fraction=0.0),
             "timestep_fraction"),
        Case("GRPOConfig", "negative beta", lambda: GRPOConfig(beta=-0.1), "beta=-0.1"),
        Case("GRPOConfig", "unknown reference", lambda: GRPOConfig(reference="ema"), "ema"),
        Case("GRPOConfig", "unknown compiler", lambda: GRPOConfig(compiler="tvm"), "tvm"),
        Case("GRPOConfig", "0 updates per rollout", lambda: GRPOConfig(updates_per_rollout=0),
             "updates_per_rollout"),
        Case("GRPOConfig", "memory_fraction > 1", lambda: GRPOConfig(memory_fraction=1.5),
             "memory_fraction"),
        Case("GRPOConfig", "unknown layout", lambda: GRPOConfig(layout="ring"), "ring"),
        # trainer
        Case("GRPOTrainer", "config not a GRPOConfig",
             lambda: GRPOTrainer(
                 _Policy(), lambda *a: None, None, {"group_size": 2}), "GRPOConfig"),
        Case("GRPOTrainer", "unknown parallel", lambda: GRPOTrainer(
                 _Policy(), lambda *a: None, None, GRPOConfig(), parallel="dp"), "dp"),
        Case("GRPOTrainer", "parallel='fsdp' without a process group",
             lambda: GRPOTrainer(
                 _Policy(), lambda *a: None, None, GRPOConfig(), parallel="fsdp"),
             "init_process_group"),
        Case("GRPOConfig", "unknown overlap", lambda: GRPOConfig(overlap="async"), "async"),
        Case("GRPOTrainer", "parallel='ddp' without a process group",
             lambda: GRPOTrainer(
                 _Policy(), lambda *a: None, None, GRPOConfig(), parallel="ddp"),
             "init_process_group"),
        Case("GRPOTrainer", "frozen policy",
             lambda: GRPOTrainer(
                 _Policy().requires_grad_(False), lambda *a: None, None, GRPOConfig()),
             "requires_grad"),
        Case("GRPOTrainer.step", "no optimizer",
             lambda: _trainer(lambda *a: None).step({"prompt_embeds": torch.zeros(1, 2)}),
             "optimizer"),
        Case("GRPOTrainer.compute_gradients", "reward of the wrong shape",
             lambda: _step_with(lambda lat, c: torch.zeros(lat.shape[0], 1)), "(2,)"),
        Case("GRPOTrainer.compute_gradients", "NaN reward",
             lambda: _step_with(lambda lat, c: torch.full((lat.shape[0],), float("nan"))),
             "nan"),
        Case("GRPOTrainer.compute_gradients", "reward not a tensor",
             lambda: _step_with(lambda lat, c: [0.0] * lat.shape[0]), "list"),
        Case("GRPOTrainer.load", "no checkpoint there",
             lambda: GRPOTrainer.load(
                 "/nonexistent-run", _Policy(), None, None), "trainer.save"),
        # pieces
        Case("check_rewards", "integer rewards",
             lambda: check_rewards(torch.zeros(2, dtype=torch.long), 2), "int64"),
        Case("group_advantages", "2-D rewards",
             lambda: group_advantages(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long)),
             "1-D"),
        Case("group_ids_for", "0 prompts", lambda: group_ids_for(0, 2), "num_prompts=0"),
        Case("select_timesteps", "batch 0",
             lambda: select_timesteps(TimestepSelection(), batch=0, num_steps=4), "batch=0"),
        Case("TimestepSelection", "unknown strategy",
             lambda: TimestepSelection(strategy="last"), "last"),
        Case("sde_step", "unknown kind",
             lambda: sde_step("ddim", latents=x, velocity=x, sigma=torch.ones(2),
                              sigma_next=torch.zeros(2), eta=0.7, sigma_max=torch.ones(2),
                              noise=x), "ddim"),
        Case("layout.assign", "rank outside the world",
             lambda: assign("shared", num_prompts=1, group_size=2, world_size=2, rank=2),
             "rank=2"),
        Case("p2p.start_exchange", "peer below -1",
             lambda: start_exchange(x, (2, 4), -2, 0, "0"), "peer_send=-2"),
    ]


def run_cases() -> list[dict]:
    """Run every row; returns ``{entry, problem, error, message, ok}`` per row (``ok``: one of
    the expected exception types, with ``expect`` in its text)."""
    records = []
    for case in cases():
        try:
            case.call()
            error, message = None, "no error raised"
        except (TypeError, ValueError, NotImplementedError, RuntimeError,
                FileNotFoundError) as e:
            error, message = type(e).__name__, str(e)
        ok = error is not None and case.expect.lower() in message.lower()
        records.append({"entry": case.entry, "problem": case.problem, "error": error,
                        "message": message, "expect": case.expect, "ok": ok})
    return records


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="leancompile check-inputs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    records = run_cases()
    if ns.json:
        print(json.dumps(records, indent=2))
    else:
        for r in records:
            mark = "ok " if r["ok"] else "BAD"
            first = r["message"].splitlines()[0] if r["message"] else ""
            print(f"{mark} {r['entry']:30s} {r['problem']:38s} {r['error'] or '-':20s} "
                  f"{first[:160]}")
        bad = [r for r in records if not r["ok"]]
        print(f"{len(records) - len(bad)} of {len(records)} rows raise a clear error")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
