"""The time-to-reward race: FlowGRPO's loop as its users write it (``user_loops.py``), trained
on the GRPO demo's task twice from the same weights and seeds, once with its velocity under
plain ``torch.compile`` and once under ``lean_compile(schedule="auto")`` with the same
backend (the three lines of ``loop_demo``), one iteration of each in turn.

The task: a small random-init diffusers FLUX (one double and one single block, two heads of
64) on 16x16 latents, decoded by the demo's tiny VAE; the reward is the closeness of the
decoded pixels to red (``grpo_demo``). The loop: 4 prompts x 4 samples, 6 denoising steps of
which the first 4 are trained (FlowGRPO's ``timestep_fraction`` 0.75), sampling batches of 8, samples shuffled and timesteps permuted
before training in batches of 4, PPO, AdamW, one optimizer step per rollout (the update is
on-policy, so every trained call can reuse its rollout forward).

Each loop is compiled first (one warm-up iteration, after which both get their initial
weights back); then the iterations alternate, plain first on even iterations and wrapped first
on odd ones, so that the machine's drift hits both. A loop's clock counts only its own
iterations (rollout with scoring, update): the time at which it reached a reward is the sum
of its earlier iterations plus the rollout that scored it. Printed: each iteration's mean
reward and clock of both loops, the clock at which each first reached the threshold, their
ratio (the time-to-reward speed-up), the median iteration times, and how far the two runs'
parameters are apart (same seeds and on-policy gradients: they differ by rounding only, which
the loop's feedback can grow). Saved: ``race.png``, mean reward against wall seconds for both.

    leancompile demo race [--out DIR]
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["RaceConfig", "run_race", "time_to_reward", "main"]


@dataclass(frozen=True, kw_only=True)
class RaceConfig:
    """The race's settings (defaults: the module docstring's task)."""

    iterations: int = 10
    threshold: float = -0.55
    """The mean reward to reach (the untrained policy scores about -0.8: mid-grey noise)."""
    backend: str = "inductor"
    schedule: str = "auto"
    attention_head_dim: int = 64
    lr: float = 3e-3
    prompts: int = 4
    group_size: int = 4
    sample_batch: int = 8
    train_batch: int = 4
    num_inference_steps: int = 6
    seed: int = 0


def time_to_reward(rewards, rollout_times, update_times, threshold: float) -> float | None:
    """The clock at which a loop first scored a mean reward >= ``threshold``: every earlier
    iteration's rollout and update, plus the rollout of the iteration that scored it. None
    when no iteration reached it."""
    if not len(rewards) == len(rollout_times) == len(update_times):
        raise ValueError(f"time_to_reward: {len(rewards)} rewards, {len(rollout_times)} rollout "
                         f"times and {len(update_times)} update times; pass one of each per "
                         "iteration")
    clock = _clock(rollout_times, update_times)
    return next((at for reward, at in zip(rewards, clock) if reward >= threshold), None)


def _clock(rollout_times, update_times) -> list[float]:
    """The clock at which each iteration's reward was scored (the x of the plot)."""
    clock, points = 0.0, []
    for rollout, update in zip(rollout_times, update_times):
        points.append(clock + rollout)
        clock += rollout + update
    return points


def run_race(config: RaceConfig = RaceConfig(), *, log=print) -> dict:
    """Run the race; returns ``rewards``, ``rollout_times``, ``update_times`` and
    ``time_to_reward`` per loop (``plain``, ``lean``), ``speedup`` (plain's time to reward
    over lean's, None unless both reached it), ``iteration_speedup`` (median iteration times),
    ``param_rel_l2`` (per iteration, lean against plain), and ``stats`` (lean's counters)."""
    import leancompile

    from ..grpo.rewards import TargetColorReward, decoded
    from .grpo_demo import TARGET, build_demo
    from .user_loops import LoopConfig, flow_grpo_iterations

    if config.iterations < 1:
        raise ValueError(f"iterations={config.iterations}: the race needs at least one")
    base, vae = build_demo(seed=config.seed, num_inference_steps=config.num_inference_steps,
                           attention_head_dim=config.attention_head_dim)
    base.requires_grad_(True)
    reward = decoded(TargetColorReward(target=TARGET), vae=vae,
                     to_vae_latents=base.to_vae_latents)  # (latents, conditions=None)
    loop = LoopConfig(prompts=config.prompts, group_size=config.group_size,
                      sample_batch=config.sample_batch, train_batch=config.train_batch,
                      timestep_fraction=0.75, lr=config.lr, iterations=config.iterations)
    policies, fns = {}, {}
    for name in ("plain", "lean"):
        policies[name] = copy.deepcopy(base)
        velocity = policies[name].velocity
        fns[name] = (torch.compile(velocity, backend=config.backend) if name == "plain" else
                     leancompile.lean_compile(velocity, backend=config.backend,
                                              schedule=config.schedule))
        log(f"compiling the {name} loop (one warm-up iteration) ...")
        for _ in flow_grpo_iterations(policies[name], fns[name],
                                      dataclasses.replace(loop, iterations=1),
                                      seed=config.seed, reward=reward):
            pass
        policies[name].load_state_dict(base.state_dict())
    fns["lean"].reset_stats()
    runs = {name: flow_grpo_iterations(policies[name], fns[name], loop, seed=config.seed,
                                       reward=reward) for name in policies}
    results = {}
    log(f"\n{'iteration':>9}  {'plain reward':>12} {'clock s':>8}  {'lean reward':>11} "
        f"{'clock s':>8}")
    for i in range(config.iterations):
        for name in (("plain", "lean") if i % 2 == 0 else ("lean", "plain")):
            results[name] = next(runs[name])
        p, q = results["plain"], results["lean"]
        at_p, at_q = (_clock(r.rollout_times, r.update_times)[-1] for r in (p, q))
        log(f"{i + 1:>9}  {p.rewards[-1]:>12.4f} {at_p:>8.2f}  {q.rewards[-1]:>11.4f} "
            f"{at_q:>8.2f}")
    out = {"config": dataclasses.asdict(config), "loops": {}}
    for name, result in results.items():
        out["loops"][name] = {
            "rewards": list(result.rewards), "rollout_times": list(result.rollout_times),
            "update_times": list(result.update_times),
            "clock": _clock(result.rollout_times, result.update_times),
            "time_to_reward": time_to_reward(result.rewards, result.rollout_times,
                                             result.update_times, config.threshold),
            "median_iteration": statistics.median(
                r + u for r, u in zip(result.rollout_times, result.update_times))}
    plain, lean = out["loops"]["plain"], out["loops"]["lean"]
    both = plain["time_to_reward"] is not None and lean["time_to_reward"] is not None
    out["speedup"] = plain["time_to_reward"] / lean["time_to_reward"] if both else None
    out["iteration_speedup"] = plain["median_iteration"] / lean["median_iteration"]
    out["param_rel_l2"] = [_rel_l2(a, b) for a, b in zip(results["lean"].history,
                                                        results["plain"].history)]
    stats = fns["lean"].stats
    out["stats"] = {"reused_calls": stats.reused_calls, "update_calls": stats.update_calls,
                    "forwards_run": stats.forwards_run}
    for name, rec in out["loops"].items():
        reached = rec["time_to_reward"]
        log(f"{name}: reward {config.threshold:+.2f} reached "
            + (f"at {reached:.2f} s" if reached is not None else "never")
            + f"; median iteration {rec['median_iteration']:.3f} s")
    if out["speedup"] is not None:
        log(f"time to reward: {out['speedup']:.2f}x faster with lean_compile(schedule="
            f"{config.schedule!r}); per iteration {out['iteration_speedup']:.2f}x")
    else:
        log(f"time to reward: not measured (a loop did not reach {config.threshold:+.2f} in "
            f"{config.iterations} iterations); per iteration {out['iteration_speedup']:.2f}x")
    log(f"lean: {stats.reused_calls}/{stats.update_calls} update calls reused, "
        f"{stats.forwards_run} update forwards run; parameters vs plain (relative L2) after "
        f"the first iteration {out['param_rel_l2'][0]:.1e}, after the last "
        f"{out['param_rel_l2'][-1]:.1e}")
    return out


def _rel_l2(a: dict, b: dict) -> float:
    fa = torch.cat([t.flatten().double() for t in a.values()])
    fb = torch.cat([t.flatten().double() for t in b.values()])
    return ((fa - fb).norm() / fb.norm()).item()


def plot_race(race: dict, path: Path) -> bool:
    """Mean reward against each loop's wall seconds, the threshold, and where each loop
    reached it; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    config = race["config"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = {"plain": f"plain torch.compile({config['backend']})",
              "lean": f"lean_compile(schedule={config['schedule']!r})"}
    for (name, rec), color in zip(race["loops"].items(), ("tab:grey", "tab:red")):
        ax.plot(rec["clock"], rec["rewards"], marker="o", markersize=4, color=color,
                label=labels[name])
        if rec["time_to_reward"] is not None:
            ax.axvline(rec["time_to_reward"], color=color, linestyle=":", linewidth=1)
    ax.axhline(config["threshold"], color="black", linestyle="--", linewidth=1,
               label=f"threshold {config['threshold']:+.2f}")
    title = "FlowGRPO's loop on tiny FLUX, reward: red images"
    if race["speedup"] is not None:
        title += (f"\ntime to reward {race['speedup']:.2f}x faster, per iteration "
                  f"{race['iteration_speedup']:.2f}x")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("wall seconds (each loop's own iterations)")
    ax.set_ylabel("mean reward (- distance to red)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(*, out: str = "leancompile-out", config: RaceConfig = RaceConfig(),
         threads: int | None = 1) -> int:
    """Run the race, print it and save ``out/race/race.png``; returns 0 when both loops
    reached the threshold, 1 otherwise. ``threads``: torch's intra-op threads during the race
    (restored on return; None: leave them), as in ``grpo_demo``."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        print(f"FlowGRPO-style loop, {config.prompts} prompts x {config.group_size} samples, "
              f"{config.num_inference_steps} steps (the first "
              f"{int(config.num_inference_steps * 0.75)} trained), one optimizer step per "
              f"rollout, reward: decoded pixels close to red; plain torch.compile(backend="
              f"{config.backend!r}) against lean_compile(schedule={config.schedule!r}), "
              f"same weights and seeds, iterations alternating")
        race = run_race(config)
    finally:
        torch.set_num_threads(previous)
    out_dir = Path(out) / "race"
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot_race(race, out_dir / "race.png"):
        print(f"plot: {out_dir / 'race.png'}")
    return 0 if race["speedup"] is not None else 1
