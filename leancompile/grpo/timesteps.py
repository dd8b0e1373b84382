"""Which denoising steps of each trajectory are trained, drawn before the rollout starts.

GRPO baselines choose the trained steps after sampling; LeanGRPO must know them before (a step
that will be trained runs with grad during the rollout, the others under ``no_grad``). Drawing
early changes nothing in expectation: the choice does not depend on the trajectory
(``docs/leangrpo.md`` section 3). Three strategies, read from the baselines' code:

``"first"`` (FlowGRPO, ``scripts/train_sd3.py``)
    The first ``int(num_steps * fraction)`` steps of every sample: ``num_train_timesteps =
    int(config.sample.num_steps * config.train.timestep_fraction)``, trained as
    ``range(num_train_timesteps)``. Its configs use ``fraction=0.99``, which drops the last step.
``"window"`` (FlowGRPO Fast, ``sd3_pipeline_with_logprob_fast.py``, ``train_sd3_fast.py``)
    A contiguous window of ``window_size`` steps whose start is uniform over
    ``[lo, hi - window_size]`` (inclusive; ``random.randint(lo, hi - size)``), ``(lo, hi) =
    window_range``. FlowGRPO draws one window per pipeline call, shared by every sample of that
    call; steps outside it run as the deterministic ODE (``noise_level=0``). Its Fast configs
    use ``window_size=3``, ``window_range=(0, num_steps // 2)``, our defaults.
``"dance_grpo"`` (DanceGRPO, ``fastvideo/train_grpo_flux.py``)
    Per sample, a uniformly random subset of ``int((num_steps - 1) * fraction)`` of the first
    ``num_steps - 1`` steps (DanceGRPO drops the last step with ``[:, :-1]``, then takes the
    first ``int(len * timestep_fraction)`` entries of a per-sample ``randperm``). DanceGRPO
    trains them in that random order; we return them sorted (the gradient is a sum).

Also ``same_noise_latents``, the initial-latent layout of DanceGRPO's ``init_same_noise``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["STRATEGIES", "TimestepSelection", "select_timesteps", "same_noise_latents"]

STRATEGIES = ("first", "window", "dance_grpo")

_DEFAULT_WINDOW_SIZE = 3


@dataclass(frozen=True, kw_only=True)
class TimestepSelection:
    """Which steps are trained. Fields that do not apply to ``strategy`` must stay ``None``
    (or ``False``), so that a setting never silently does nothing."""

    strategy: str = "first"
    """``"first"`` (FlowGRPO), ``"window"`` (FlowGRPO Fast) or ``"dance_grpo"``."""

    fraction: float | None = None
    """``"first"``: train the first ``int(num_steps * fraction)`` steps (FlowGRPO
    ``timestep_fraction``, 0.99 in its configs). ``"dance_grpo"``: train
    ``int((num_steps - 1) * fraction)`` random steps (0.6 in its scripts). In ``(0, 1]``;
    ``None`` means 1.0. Not used by ``"window"``."""

    window_size: int | None = None
    """``"window"`` only: number of consecutive steps (FlowGRPO ``sde_window_size``); ``None``
    means 3, the Fast configs' value."""

    window_range: tuple[int, int] | None = None
    """``"window"`` only: ``(lo, hi)``, the window lies inside steps ``lo .. hi - 1``
    (FlowGRPO ``sde_window_range``). ``None`` means ``(0, num_steps // 2)``, the Fast configs'
    value."""

    window_per_sample: bool = False
    """``"window"`` only: draw a window per sample instead of one shared by the whole call
    (FlowGRPO shares one per pipeline call)."""

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not known; use one of {STRATEGIES}")
        if self.strategy == "window":
            if self.fraction is not None:
                raise ValueError(f"fraction={self.fraction} has no effect with strategy='window'; "
                                 "leave it None and set window_size/window_range")
            size = self.window_size
            if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                     or size < 1):
                raise ValueError(f"window_size={size!r} must be an int >= 1")
            if self.window_range is not None:
                rng = tuple(self.window_range)
                if len(rng) != 2 or not all(isinstance(b, int) and not isinstance(b, bool)
                                            for b in rng):
                    raise ValueError(f"window_range={self.window_range!r} must be two ints "
                                     "(lo, hi)")
                lo, hi = rng
                need = _DEFAULT_WINDOW_SIZE if size is None else size
                if lo < 0 or hi - lo < need:
                    raise ValueError(
                        f"window_range={rng} cannot hold a window of {need} steps; use "
                        f"0 <= lo and hi - lo >= window_size, e.g. ({max(lo, 0)}, "
                        f"{max(lo, 0) + need})")
                object.__setattr__(self, "window_range", rng)
        else:
            unused = [name for name, value in (("window_size", self.window_size),
                                               ("window_range", self.window_range))
                      if value is not None]
            if self.window_per_sample:
                unused.append("window_per_sample")
            if unused:
                raise ValueError(f"{unused} only apply to strategy='window'; with "
                                 f"strategy={self.strategy!r} leave them unset")
            f = self.fraction
            if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                                  or not 0 < f <= 1):
                raise ValueError(f"fraction={f!r} must be in (0, 1]; FlowGRPO uses 0.99, "
                                 "DanceGRPO 0.6")

    def num_selected(self, num_steps: int) -> int:
        """How many steps each row gets, ``S``; raises ``ValueError`` if that is < 1."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r} must be an int >= 1")
        fraction = 1.0 if self.fraction is None else self.fraction
        if self.strategy == "first":
            count = int(num_steps * fraction)
            if count < 1:
                raise ValueError(
                    f"strategy='first' with fraction={fraction} and num_steps={num_steps} "
                    f"selects int({num_steps} * {fraction}) = 0 steps; use fraction >= "
                    f"1/num_steps = {1 / num_steps:.4g}")
            return count
        if self.strategy == "dance_grpo":
            if num_steps < 2:
                raise ValueError(
                    f"strategy='dance_grpo' chooses among the first num_steps - 1 steps; "
                    f"num_steps={num_steps} leaves none; use num_steps >= 2")
            count = int((num_steps - 1) * fraction)
            if count < 1:
                raise ValueError(
                    f"strategy='dance_grpo' with fraction={fraction} and num_steps={num_steps} "
                    f"selects int(({num_steps} - 1) * {fraction}) = 0 steps; use fraction >= "
                    f"1/(num_steps - 1) = {1 / (num_steps - 1):.4g}")
            return count
        return self.window_size or _DEFAULT_WINDOW_SIZE

    def resolved_window_range(self, num_steps: int) -> tuple[int, int]:
        """``window_range``, with ``None`` resolved against ``num_steps`` and checked."""
        size = self.num_selected(num_steps)
        lo, hi = self.window_range if self.window_range is not None else (0, num_steps // 2)
        if hi > num_steps or hi - lo < size:
            raise ValueError(
                f"window_range=({lo}, {hi}) with num_steps={num_steps} cannot hold a window of "
                f"{size} steps inside the trajectory; use 0 <= lo, hi <= num_steps and "
                f"hi - lo >= window_size (e.g. window_range=(0, {min(num_steps, size)}) or a "
                f"smaller window_size)")
        return lo, hi


def select_timesteps(config: TimestepSelection, *, batch: int, num_steps: int,
                     generator: torch.Generator | None = None) -> Tensor:
    """Step indices to train, shape ``[batch, S]`` int64 on the CPU, sorted ascending per row
    and distinct within a row. ``num_steps`` is the number of denoising steps ``T``; indices are
    in ``[0, T)``. Random strategies draw from ``generator`` (a CPU ``torch.Generator``) or
    from torch's global generator; the same generator state gives the same selection."""
    if not isinstance(config, TimestepSelection):
        raise TypeError(f"config must be a TimestepSelection; got {type(config).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an int >= 1")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got "
                        f"{type(generator).__name__}")
    count = config.num_selected(num_steps)

    if config.strategy == "first":
        return torch.arange(count).expand(batch, count).clone()

    if config.strategy == "dance_grpo":
        keys = torch.rand(batch, num_steps - 1, generator=generator)
        chosen = keys.argsort(dim=1)[:, :count]
        return chosen.sort(dim=1).values

    lo, hi = config.resolved_window_range(num_steps)
    rows = batch if config.window_per_sample else 1
    start = torch.randint(lo, hi - count + 1, (rows, 1), generator=generator)
    return (start + torch.arange(count)).expand(batch, count).clone()


def same_noise_latents(initial: Tensor, group_size: int) -> Tensor:
    """One initial latent per prompt, repeated for its ``group_size`` samples: ``initial``
    ``[num_prompts, ...]`` becomes ``[num_prompts * group_size, ...]``, prompt-major (row ``b``
    is prompt ``b // group_size``, the layout of ``group_ids_for``), so only the SDE noise
    differs within a group.

    DanceGRPO's ``init_same_noise`` draws a single ``(1, C, h, w)`` latent per rollout call and
    gives it to every row of that call; the rows are its prompts ``repeat_interleave``-d by
    ``num_generations``, and its scripts put one prompt on each rank, so that is one latent per
    group. With several prompts per call we keep one latent per prompt. (FlowGRPO's
    ``same_latent`` gets the same effect from a generator seeded by a hash of the prompt.)
    """
    if not isinstance(initial, Tensor) or initial.ndim < 1:
        raise ValueError("initial must be a tensor [num_prompts, ...] with one latent per prompt")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1")
    return initial.repeat_interleave(group_size, dim=0)
