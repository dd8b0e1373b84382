"""``leancompile bench realloop``: FlowGRPO's ``scripts/train_sd3.py`` loop as a user runs it
(``leancompile.demos.real_loops``: SD3 with peft LoRA, accelerate, classifier-free guidance,
the KL reference, two optimizer steps per epoch), one epoch per row and round:

- ``eager``: the loop as written;
- ``torch <backend>``: the loop with ``torch.compile(transformer, backend=...)``;
- ``lean <backend> <schedule>``: the loop with ``lean_compile(transformer, backend=...,
  schedule=...)`` and its two phase lines.

Every row trains its own copy of the same initial pipeline from the same seeds. Rounds are
interleaved (round r runs every row once, in turn) after one warm-up round (the compiles);
each row's epoch seconds are printed as min and median over the rounds.

The loop's ideal ratio. Per epoch the plain loop samples ``N_s`` no-grad forwards (each a
classifier-free-guidance batch) and trains ``N_u`` calls (forward + backward, and the KL
reference's no-grad forward). The first optimizer step's window, ``n_first`` calls, trains on
the parameters that sampled; the later windows come after ``optimizer.step()``. The best a
LeanGRPO schedule can do is run those ``n_first`` sampling calls with gradients (``F``
instead of ``F0``) and skip their training forwards (``-F``): per reused call it saves ``F0``,
the no-grad forward. So ``ideal = P / (P - n_first * F0)``, with ``P`` the plain compiled loop's
epoch and ``F0`` its transformer's sampling call, timed inside the loop by hooks on the compiled
module (``F``, its trained forward, printed beside it). A wrapped row's ``of ideal`` is its
ratio over ``P`` divided by ``ideal``.

Sizes: ``tiny`` is the demo loop's SD3 (2 layers, hidden 16, 4x4 latents: per-call overhead shows);
``compute`` is 4 layers, hidden 256, 32x32 latents in 2x2 patches (256 image tokens), where a
forward takes long enough on a CPU core that compute dominates.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

__all__ = ["SIZES", "ideal_ratio", "run_realloop_bench", "main"]

SIZES = {
    "tiny": {"sizes": {}, "resolution": 32},
    "compute": {"sizes": {"num_layers": 4, "attention_head_dim": 64, "num_attention_heads": 4,
                          "sample_size": 32, "patch_size": 2, "pos_embed_max_size": 16},
                "resolution": 256},
}
"""Transformer sizes (``tiny_sd3_pipeline``'s keywords) and the image resolution (8 pixels
per latent, as SD3's VAE)."""


def _config(size: str):
    from ..demos.real_loops.flow_grpo_sd3 import FlowGRPOConfig

    return FlowGRPOConfig(resolution=SIZES[size]["resolution"], epochs=1)


def _rows(backends: tuple[str, ...], schedules: tuple[str, ...]) -> list[tuple]:
    rows = [("eager", None, None)]
    rows += [("torch", b, None) for b in ("aot_eager", "inductor")]
    rows += [("lean", b, s) for b in backends for s in schedules]
    return rows


def _name(row) -> str:
    return " ".join(part for part in row if part)


class _CallTimer:
    """Hooks on a compiled transformer (``torch.compile``'s module runs its own hooks outside
    the compiled code) that time each call inside the loop: sampling calls (no grad, eval
    mode) and trained calls (grad mode), seconds per call. Host time: on a GPU the calls
    would need a synchronize to be timed this way; this bench runs on the CPU."""

    def __init__(self, module):
        self.sampling: list[float] = []
        self.trained: list[float] = []
        self._start = 0.0
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, module, args):
        self._start = time.perf_counter()

    def _after(self, module, args, out):
        seconds = time.perf_counter() - self._start
        if torch.is_grad_enabled():
            self.trained.append(seconds)
        elif not module.training:
            self.sampling.append(seconds)

    def clear(self) -> None:
        self.sampling.clear()
        self.trained.clear()


def _loop_counts(config) -> dict:
    """Per epoch: sampling calls, trained calls, and the first optimizer step's window."""
    n_train = config.num_train_timesteps
    sampling = config.num_batches_per_epoch * config.num_steps
    trained = config.num_batches_per_epoch * n_train * config.num_inner_epochs
    window = config.gradient_accumulation_steps * n_train
    return {"sampling_calls": sampling, "trained_calls": trained,
            "first_window_calls": min(window, trained),
            "optimizer_steps": trained // window}


def ideal_ratio(plain_seconds: float, f0: float, first_window_calls: int) -> float:
    """The loop's ideal ratio over its plain compiled epoch (module docstring): each call of
    the first optimizer step's window saves one no-grad forward."""
    saved = first_window_calls * f0
    if not 0 <= saved < plain_seconds:
        raise ValueError(f"ideal_ratio: {first_window_calls} calls x F0 {f0:.4f} s = "
                         f"{saved:.4f} s is not within the plain epoch's {plain_seconds:.4f} s "
                         "(F0 timed on another machine state, or a wrong window?)")
    return plain_seconds / (plain_seconds - saved)


def run_realloop_bench(*, size: str = "tiny", backends: tuple[str, ...] = ("inductor",),
                       schedules: tuple[str, ...] = ("recompute", "retain", "auto"),
                       rounds: int = 5, log=print) -> dict:
    """The rows of the module docstring, ``rounds`` interleaved rounds after a warm-up round;
    returns the figures (``rows``: per row the epoch seconds of every round, min and median,
    rollout and update seconds; ``calls``: F0 and F per backend; ``ideal`` and each wrapped
    row's ``of_ideal``)."""
    from ..demos.real_loops.flow_grpo_sd3 import (flow_grpo_train_sd3, prepare_flow_grpo,
                                                  sd3_prompt_bank, tiny_sd3_pipeline)

    if size not in SIZES:
        raise ValueError(f"size={size!r}; use one of {tuple(SIZES)}")
    config = _config(size)
    prompts = sd3_prompt_bank(config.prompts, config.text_tokens)
    base = tiny_sd3_pipeline(0, **SIZES[size]["sizes"])
    rows = _rows(tuple(backends), tuple(schedules))
    pipelines = {row: prepare_flow_grpo(copy.deepcopy(base), config, compile=row[0],
                                        backend=row[1] or "inductor",
                                        schedule=row[2] or "retain")
                 for row in rows}
    times = {row: [] for row in rows}
    phases = {row: [] for row in rows}
    reuse = {}
    timers = {b: _CallTimer(pipelines[("torch", b, None)].transformer)
              for b in ("aot_eager", "inductor")}
    calls_by_backend = {b: [] for b in timers}
    counts = _loop_counts(config)
    shape = SIZES[size]["sizes"] or "the demo loop's 2-layer SD3"
    log(f"FlowGRPO train_sd3.py loop, size {size} ({shape}), "
        f"{counts['sampling_calls']} sampling calls, {counts['trained_calls']} trained calls, "
        f"{counts['optimizer_steps']} optimizer steps per epoch; {rounds} rounds after a warm-up")
    for r in range(rounds + 1):
        for row in rows:
            torch.manual_seed(r)
            if row[0] == "torch":
                timers[row[1]].clear()
            start = time.perf_counter()
            run = flow_grpo_train_sd3(pipelines[row], prompts, config)
            seconds = time.perf_counter() - start
            if r == 0:
                log(f"  warm-up {_name(row)}: {seconds:.2f} s")
                continue
            times[row].append(seconds)
            if row[0] == "torch":
                timer = timers[row[1]]
                calls_by_backend[row[1]].append({"F0": statistics.median(timer.sampling),
                                                 "F": statistics.median(timer.trained)})
            phases[row].append((run.rollout_seconds, run.update_seconds))
            if run.stats is not None:
                reuse[row] = {"reused_calls": run.stats.reused_calls,
                              "update_calls": run.stats.update_calls,
                              "forwards_run": run.stats.forwards_run,
                              "unused_bytes": run.stats.unused_bytes}
    result = {"size": size, "rounds": rounds, "counts": counts, "rows": {}, "calls": {},
              "ideal": {}}
    for backend, measured in calls_by_backend.items():
        result["calls"][backend] = {k: statistics.median(m[k] for m in measured)
                                    for k in ("F0", "F")}
    for row in rows:
        result["rows"][_name(row)] = {
            "seconds": times[row], "min": min(times[row]),
            "median": statistics.median(times[row]),
            "rollout_median": statistics.median(p[0] for p in phases[row]),
            "update_median": statistics.median(p[1] for p in phases[row]),
            **({"reuse": reuse[row]} if row in reuse else {})}
    eager = result["rows"]["eager"]["median"]
    for backend in calls_by_backend:
        plain = result["rows"][f"torch {backend}"]["median"]
        f0 = result["calls"][backend]["F0"]
        result["ideal"][backend] = ideal_ratio(plain, f0, counts["first_window_calls"])
    log(f"\n{'row':<26}{'min s':>8}{'median s':>10}{'rollout':>9}{'update':>8}"
        f"{'vs eager':>10}{'vs plain':>10}{'of ideal':>10}")
    for row in rows:
        rec = result["rows"][_name(row)]
        line = (f"{_name(row):<26}{rec['min']:>8.3f}{rec['median']:>10.3f}"
                f"{rec['rollout_median']:>9.3f}{rec['update_median']:>8.3f}"
                f"{eager / rec['median']:>9.2f}x")
        if row[0] == "lean":
            plain = result["rows"][f"torch {row[1]}"]["median"]
            ratio = plain / rec["median"]
            rec["vs_plain"] = ratio
            rec["of_ideal"] = ratio / result["ideal"][row[1]]
            line += f"{ratio:>9.2f}x{rec['of_ideal']:>9.1%}"
        log(line)
    for backend, c in result["calls"].items():
        log(f"torch {backend}: per call F0 {c['F0'] * 1e3:.1f} ms (sampling), F "
            f"{c['F'] * 1e3:.1f} ms (trained forward); ideal ratio over the plain loop "
            f"{result['ideal'][backend]:.3f}x (saves {counts['first_window_calls']} x F0 of "
            f"{result['rows'][f'torch {backend}']['median']:.3f} s)")
    for row, r in reuse.items():
        log(f"{_name(row)}: {r['reused_calls']}/{r['update_calls']} update calls reused, "
            f"{r['forwards_run']} update forwards run, {r['unused_bytes'] / 2**20:.2f} MiB kept "
            "and never used (last epoch)")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="leancompile bench realloop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--backend", nargs="+", choices=("inductor", "aot_eager"),
                   default=["inductor"], help="the wrapped rows' backends")
    p.add_argument("--schedule", nargs="+", default=["recompute", "retain", "auto"],
                   choices=("recompute", "retain", "reweight", "auto"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    result = run_realloop_bench(size=args.size, backends=tuple(args.backend),
                                schedules=tuple(args.schedule), rounds=args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
